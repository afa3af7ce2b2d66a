#!/usr/bin/env bash
# The GPU check (docs/performance.md "GPU check"): each stage writes OUT_DIR/<stage>.json when it ends.
#
#   scripts/gpu_check.sh --prepare            where a registry is reachable: the wheels the GPU machine's Python
#                                             lacks into scripts/gpu_wheels/ (git-ignored: copy it along)
#   scripts/gpu_check.sh [OUT_DIR]            on the GPU machine: pip install --no-index --target those wheels into a
#                                             temporary folder, then run the stages (<= 5 min)
#   scripts/gpu_check.sh --dry-run [OUT_DIR]  anywhere, on CPU, tiny sizes: the same install and the same stages
#
# OUT_DIR defaults to runs/gpu_check.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(dirname "$here")
# As the Makefile picks it: $PYTHON, the active env's, ./.venv's, else python3 (the GPU machine's, with torch).
python=${PYTHON:-}
for candidate in "${VIRTUAL_ENV:-}" "${CONDA_PREFIX:-}" "$root/.venv"; do
  if [[ -z $python && -n $candidate && -x $candidate/bin/python ]]; then python=$candidate/bin/python; fi
done
python=${python:-python3}
wheels=${GPU_CHECK_WHEELS:-$here/gpu_wheels}
# What the GPU machine's Python lacks (pure Python): jsonargparse and its [signatures] extras. wandb is optional and
# unused here; the dry-run hides it too.
WHEELS=(jsonargparse docstring_parser typeshed_client)

mode=gpu out=runs/gpu_check
for arg in "$@"; do
  case "$arg" in
    --prepare) mode=prepare ;;
    --dry-run) mode=dry-run ;;
    -h | --help) sed -n '2,10p' "$0" | cut -c3-; exit 0 ;;
    -*) echo "gpu_check.sh: unknown option $arg (see --help)" >&2; exit 2 ;;
    *) out=$arg ;;
  esac
done

if [[ $mode == prepare ]]; then
  specs=()
  for name in "${WHEELS[@]}"; do  # the versions constraints.txt pins
    specs+=("$(grep -iE "^${name//_/[-_]}==" "$root/constraints.txt")") ||
      { echo "gpu_check.sh: $name is not pinned in constraints.txt" >&2; exit 2; }
  done
  rm -rf "$wheels" && mkdir -p "$wheels"
  "$python" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 -d "$wheels" "${specs[@]}"
  echo "gpu_check.sh: wheels for the GPU machine in $wheels; copy that folder along with the checkout."
  exit 0
fi

site=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check-site.XXXXXX")
trap 'rm -rf "$site"' EXIT
if compgen -G "$wheels/*.whl" > /dev/null; then
  echo "gpu_check.sh: installing the prepared wheels of $wheels"
elif [[ $mode == dry-run ]]; then  # offline (make test): this environment's copies, repacked as wheels
  "$python" "$here/gpu_check_repack.py" "$site/wheels" "${WHEELS[@]}"
  wheels=$site/wheels
elif "$python" -c "import jsonargparse, docstring_parser, typeshed_client" 2> /dev/null; then
  wheels=
  echo "gpu_check.sh: no wheels in $wheels, and none needed: $python imports jsonargparse and its extras"
else
  echo "gpu_check.sh: error: $python lacks jsonargparse (and its extras) and $wheels holds no wheels. Run" \
    "scripts/gpu_check.sh --prepare where a package registry is reachable, then copy $wheels along." >&2
  exit 2
fi
if [[ -n $wheels ]]; then
  "$python" -m pip install --quiet --no-index --no-deps --target "$site/lib" "$wheels"/*.whl
  export GPU_CHECK_SITE=$site/lib
  export PYTHONPATH=$site/lib${PYTHONPATH:+:$PYTHONPATH}
fi
# The repository's `project`, and gpu_check_probes (reached by class_path).
export PYTHONPATH=$root:$here${PYTHONPATH:+:$PYTHONPATH}
cd "$root"
if [[ $mode == dry-run ]]; then
  # What the GPU machine lacks imports only from the installed wheels (gpu_check_site/).
  export GPU_CHECK_HIDE="${WHEELS[*]} wandb" PYTHONPATH=$here/gpu_check_site:$PYTHONPATH
  "$python" "$here/gpu_check.py" --dry-run --jobs 2 --out "$out"
else
  "$python" "$here/gpu_check.py" --out "$out"
fi

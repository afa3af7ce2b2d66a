#!/usr/bin/env bash
# The GPU check: doctor, a short fit (bf16), the sync check, a nondeterministic-op error, DDP over NCCL, `make
# bench` on the GPU, peak memory. Each stage writes OUT_DIR/<stage>.json when it ends (docs/performance.md "GPU check").
#
#   scripts/gpu_check.sh --prepare            where a package registry is reachable: download the wheels the GPU
#                                             machine's Python lacks into scripts/gpu_wheels/ (git-ignored: copy it
#                                             along with the checkout)
#   scripts/gpu_check.sh [OUT_DIR]            on the GPU machine: install those wheels into a temporary folder with
#                                             pip --no-index --no-deps --target, then run the stages (<= 5 min)
#   scripts/gpu_check.sh --dry-run [OUT_DIR]  anywhere, on CPU, tiny sizes: the same install and the same stages
#
# OUT_DIR defaults to runs/gpu_check.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(dirname "$here")
# The Python that runs everything, as the Makefile picks it: $PYTHON, else the active virtualenv's or conda env's,
# else ./.venv's, else python3 (the GPU machine's own, with torch: nothing is installed into it).
python=${PYTHON:-}
for candidate in "${VIRTUAL_ENV:-}" "${CONDA_PREFIX:-}" "$root/.venv"; do
  if [[ -z $python && -n $candidate && -x $candidate/bin/python ]]; then python=$candidate/bin/python; fi
done
python=${python:-python3}
wheels=${GPU_CHECK_WHEELS:-$here/gpu_wheels}
# What the GPU machine's Python lacks: jsonargparse and the extras of jsonargparse[signatures] (pure Python). It
# has torch, lightning, torchmetrics, torchvision, tensorboard, rich, PyYAML and typing-extensions. wandb is
# optional (configs/logger/wandb.yaml): the check does not use it, and the dry-run hides it too.
WHEELS=(jsonargparse docstring_parser typeshed_client)
MISSING_THERE="${WHEELS[*]} wandb"

mode=gpu out=runs/gpu_check
for arg in "$@"; do
  case "$arg" in
    --prepare) mode=prepare ;;
    --dry-run) mode=dry-run ;;
    -h | --help) sed -n '2,12p' "$0" | cut -c3-; exit 0 ;;
    -*) echo "gpu_check.sh: unknown option $arg (see --help)" >&2; exit 2 ;;
    *) out=$arg ;;
  esac
done

pins() {  # NAME==VERSION for each of WHEELS, as constraints.txt pins it
  local name pin
  for name in "${WHEELS[@]}"; do
    pin=$(grep -iE "^${name//_/[-_]}==" "$root/constraints.txt") ||
      { echo "gpu_check.sh: $name is not pinned in constraints.txt" >&2; return 2; }
    echo "$pin"
  done
}

if [[ $mode == prepare ]]; then
  specs=$(pins)
  rm -rf "$wheels" && mkdir -p "$wheels"
  # Pure-Python wheels (py3-none-any) fit any platform; the tags name the GPU machine's Python all the same.
  # shellcheck disable=SC2086
  "$python" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 -d "$wheels" $specs
  echo "gpu_check.sh: wheels for the GPU machine in $wheels; copy that folder along with the checkout."
  exit 0
fi

site=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check-site.XXXXXX")
trap 'rm -rf "$site"' EXIT
if compgen -G "$wheels/*.whl" > /dev/null; then
  echo "gpu_check.sh: installing the prepared wheels of $wheels"
elif [[ $mode == dry-run ]]; then
  # Offline (make test): no prepared wheels. The same packages, installed here, repacked as wheels.
  "$python" "$here/gpu_check_repack.py" "$site/wheels" "${WHEELS[@]}"
  wheels=$site/wheels
elif "$python" -c "import jsonargparse, docstring_parser, typeshed_client" 2> /dev/null; then
  wheels=  # this Python has them already
  echo "gpu_check.sh: no wheels in $here/gpu_wheels, and none needed: $python imports jsonargparse and its extras"
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
# The repository's `project`, and gpu_check_probes (the check's callback and model, by class_path).
export PYTHONPATH=$root:$here${PYTHONPATH:+:$PYTHONPATH}
cd "$root"
if [[ $mode == dry-run ]]; then
  # As on the GPU machine: the packages it lacks import only from the installed wheels (gpu_check_site/).
  export GPU_CHECK_HIDE=$MISSING_THERE PYTHONPATH=$here/gpu_check_site:$PYTHONPATH
  "$python" "$here/gpu_check.py" --dry-run --jobs 2 --out "$out"
else
  "$python" "$here/gpu_check.py" --out "$out"
fi

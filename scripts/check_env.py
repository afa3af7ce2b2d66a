"""`make <target> INSTALL=0`: check that this Python satisfies pyproject.toml instead of installing anything.

    python scripts/check_env.py [--pyproject pyproject.toml] [--extras report]

For an environment that is not this project's own (a cluster's conda env with its own torch build): `make`
otherwise pip-installs the pinned set of constraints.txt, torch included. Here every requirement of
`[project] dependencies` (and of the extras asked for, `report` by default: `make train` draws report.png) is
looked up in the installed distributions, the extras of a requirement (`jsonargparse[signatures]`) included.
Prints one `ok:` or `missing:` line per requirement and, when something is missing or too old, the one pip
command that adds just that (it leaves a torch that satisfies `torch>=2.6` alone); exit code 1 then.
"""

import argparse
import re
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent


def read_requirements(pyproject: Path, extras: list[str]) -> list[str]:
    text = pyproject.read_text()
    try:
        import tomllib  # Python 3.11+

        project = tomllib.loads(text)["project"]
        deps = list(project.get("dependencies", []))
        for extra in extras:
            deps += project.get("optional-dependencies", {}).get(extra, [])
        return deps
    except ImportError:  # Python 3.10: the two lists are plain arrays of strings
        found = []
        for key in ["dependencies", *extras]:
            block = re.search(rf"^{re.escape(key)}\s*=\s*\[(.*?)\]", text, re.M | re.S)
            if block:
                found += re.findall(r'"([^"]+)"', re.sub(r"#.*", "", block[1]))
        return found


def problems(requirement: str, seen: set[str] | None = None) -> list[str]:
    """Why `requirement` is not satisfied here (empty: it is), its extras' requirements included."""
    req, seen = Requirement(requirement), seen if seen is not None else set()
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        return []
    key = f"{req.name.lower()}[{','.join(sorted(req.extras))}]"
    if key in seen:
        return []
    seen.add(key)
    try:
        version = metadata.version(req.name)
    except metadata.PackageNotFoundError:
        return [f"{requirement}: not installed"]
    if req.specifier and not req.specifier.contains(version, prereleases=True):
        return [f"{requirement}: {req.name} {version} is installed"]
    found = []
    for extra in req.extras:
        for dep in metadata.requires(req.name) or []:
            sub = Requirement(dep)
            if sub.marker is not None and sub.marker.evaluate({"extra": extra}):
                sub.marker = None
                found += problems(str(sub), seen)
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pyproject", type=Path, default=ROOT / "pyproject.toml")
    ap.add_argument(
        "--extras", nargs="*", default=["report"], help="optional-dependency groups also required"
    )
    args = ap.parse_args(argv)
    missing = []
    for requirement in read_requirements(args.pyproject, args.extras):
        found = problems(requirement)
        missing += [requirement] if found else []
        for line in found or [f"{requirement}: {metadata.version(Requirement(requirement).name)}"]:
            print(f"{'missing' if found else 'ok'}: {line}")
    if missing:
        quoted = " ".join(f"'{r}'" for r in missing)
        print(
            f"\nerror: {sys.executable} lacks what {args.pyproject.name} asks for (INSTALL=0 installs nothing). Add just "
            f"that, leaving the rest of this environment as it is:\n  {sys.executable} -m pip install {quoted}\n"
            "or run make without INSTALL=0 to install the pinned set of constraints.txt (torch included).",
            file=sys.stderr,
        )
        return 1
    print(f"ok: {sys.executable} satisfies {args.pyproject.name}; nothing installed (INSTALL=0)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

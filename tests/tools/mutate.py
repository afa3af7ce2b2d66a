"""Plant each known bug (tests/mutants/*.patch) and check that the tests of the claims it breaks fail.

    python tests/tools/mutate.py                 # every mutant (make mutants)
    python tests/tools/mutate.py --list          # names, claims and bugs, nothing run
    python tests/tools/mutate.py resume_drops_loader_position other_one   # a subset, by name
    python tests/tools/mutate.py --baseline      # first check that those tests pass without any mutant

A mutant is a `git diff` with a header:

    # claims: claim-id another-id
    # bug: one line saying what the planted bug does
    diff --git a/project/... b/project/...

Each one is applied to a private copy of the working tree (tracked and untracked, not ignored files; mtimes
kept, .venv linked), and `python -m pytest --claim <id> ...` runs there for its claims. `killed` = those tests
failed, as they must; `SURVIVED` = they passed with the bug in: the tests do not guard the claim. Exit code 0
only when every mutant applied and was killed. The working tree itself is never modified.
"""

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MUTANTS = REPO / "tests/mutants"


@dataclass
class Mutant:
    name: str
    path: Path
    claims: list[str]
    bug: str


def read_patch(path: Path) -> Mutant:
    """Parse a mutant's `# claims:` / `# bug:` header; ValueError names what is missing."""
    claims: list[str] | None = None
    bug: str | None = None
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        key, _, value = line[1:].partition(":")
        if key.strip() == "claims":
            claims = value.split()
        elif key.strip() == "bug":
            bug = value.strip()
    if not claims or not bug:
        raise ValueError(
            f"{path}: starts with '# claims: id1 id2' and '# bug: what it breaks' lines, then a git diff"
        )
    return Mutant(path.stem, path, claims, bug)


def mutants(names: list[str] | None = None) -> list[Mutant]:
    found = {p.stem: p for p in sorted(MUTANTS.glob("*.patch"))}
    unknown = [n for n in names or [] if n.removesuffix(".patch") not in found]
    if unknown:
        raise SystemExit(
            f"No mutant {', '.join(unknown)} in {MUTANTS} (python tests/tools/mutate.py --list)."
        )
    chosen = [n.removesuffix(".patch") for n in names] if names else list(found)
    return [read_patch(found[n]) for n in chosen]


def copy_tree(dest: Path) -> None:
    """The working tree as git sees it (tracked + untracked, not ignored), mtimes kept; .venv linked."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for rel in filter(None, listed.split("\0")):
        src = REPO / rel
        if not src.exists() and not src.is_symlink():  # deleted in the working tree, still tracked
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target, follow_symlinks=False)  # copy2 keeps mtimes: make does not reinstall
    venv = REPO / ".venv"
    if venv.exists():
        (dest / ".venv").symlink_to(venv)


def env_for(tree: Path) -> dict:
    # The venv installs this project in editable mode, pointing at the real checkout; PYTHONPATH puts the
    # copy first, for pytest and for every subprocess a test starts (python -m project ...).
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tree), *filter(None, [env.get("PYTHONPATH")])])
    return env


def run_claims(tree: Path, claims: list[str], timeout: float) -> tuple[int, str]:
    # -x: one failing test is enough to kill a mutant
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "-x"]
    for claim in claims:
        cmd += ["--claim", claim]
    # its own process group: on a timeout, the processes the tests started go too
    proc = subprocess.Popen(
        cmd,
        cwd=tree,
        env=env_for(tree),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        return -1, output + f"\n(timed out after {timeout:.0f} s)"
    return proc.returncode, output


def failed_tests(output: str) -> list[str]:
    return [
        line.split(" ", 1)[1].split(" - ")[0]
        for line in output.splitlines()
        if re.match(r"(FAILED|ERROR) ", line)
    ]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("names", nargs="*", help="mutants to run (file names without .patch); default: all")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--baseline", action="store_true", help="first run the claims' tests without mutants")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per mutant (default 900)")
    parser.add_argument(
        "--keep", action="store_true", help="keep the private copies (their paths are printed)"
    )
    args = parser.parse_args()
    chosen = mutants(args.names)
    if args.list:
        for m in chosen:
            print(f"{m.name}\n    claims: {' '.join(m.claims)}\n    bug:    {m.bug}")
        return 0
    if not chosen:
        print(f"No mutants in {MUTANTS}.")
        return 1

    results: list[tuple[str, str, float]] = []

    def one(name: str, patch: Path | None, claims: list[str]) -> str:
        tree = Path(tempfile.mkdtemp(prefix=f"mutant-{name}-"))
        t0 = time.monotonic()
        try:
            copy_tree(tree)
            if patch is not None:
                applied = subprocess.run(
                    ["git", "apply", str(patch)], cwd=tree, capture_output=True, text=True
                )
                if applied.returncode != 0:
                    verdict, detail = "DOES NOT APPLY", applied.stderr.strip()
                    results.append((name, verdict, time.monotonic() - t0))
                    print(f"{name:40s} {verdict:15s}\n    {detail}", flush=True)
                    return verdict
            code, output = run_claims(tree, claims, args.timeout)
        finally:
            if args.keep:
                print(f"    (copy kept: {tree})")
            else:
                shutil.rmtree(tree, ignore_errors=True)
        seconds = time.monotonic() - t0
        if patch is None:
            verdict = "passes" if code == 0 else "FAILS"
        elif code == 1:
            verdict = "killed"
        elif code == 0:
            verdict = "SURVIVED"
        elif code == 5:
            verdict = "NO TESTS"
        elif code == -1:
            verdict = "TIMEOUT"
        else:
            verdict = f"ERROR (pytest exit {code})"
        results.append((name, verdict, seconds))
        print(f"{name:40s} {verdict:15s} {seconds:6.1f} s   claims: {' '.join(claims)}", flush=True)
        for test in failed_tests(output):
            print(f"    failed: {test}")
        if verdict not in ("killed", "passes"):
            print("    " + "\n    ".join(output.strip().splitlines()[-25:]))
        return verdict

    t_start = time.monotonic()
    if args.baseline:
        every = sorted({c for m in chosen for c in m.claims})
        if one("(baseline: no mutant)", None, every) != "passes":
            print("The claims' tests fail without any mutant: fix them first (a kill would mean nothing).")
            return 1
    for m in chosen:
        print(f"-- {m.name}: {m.bug}", flush=True)
        one(m.name, m.path, m.claims)
    bad = [r for r in results if r[1] not in ("killed", "passes")]
    killed = sum(r[1] == "killed" for r in results)
    print(
        f"\n{killed} of {len(chosen)} mutants killed in {time.monotonic() - t_start:.0f} s"
        + (f"; not killed: {', '.join(f'{n} ({v})' for n, v, _ in bad)}" if bad else "")
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

"""README "Layout" is the tree: every path it names exists, and every file of the package is under a row."""

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def layout_rows() -> list[tuple[list[str], list[str]]]:
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        first, second = line.strip("|").split(" | ", 1)
        rows.append((re.findall(r"`([^`]+)`", first), re.findall(r"`([^`]+)`", second)))
    return rows


@pytest.mark.claim("layout-matches-tree")
def test_layout_names_existing_paths_and_covers_the_package():
    rows = layout_rows()
    assert len(rows) >= 20, "the Layout table was not found in README.md"
    named = []
    for paths, details in rows:
        for path in paths:
            assert (ROOT / path).exists(), f"README Layout names '{path}', which is not in the tree"
            named.append(path)
            if path.endswith("/"):  # files a folder's row names are in that folder
                for name in details:
                    if re.fullmatch(r"[\w*]+\.(py|sh|sbatch)", name):
                        assert list((ROOT / path).glob(name)), f"README Layout: '{name}' is not in {path}"
    tracked = subprocess.run(
        ["git", "ls-files", "project", "configs", "scripts"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    if not tracked:  # not a git checkout (an sdist): list the files instead
        tracked = [
            str(p.relative_to(ROOT)) for d in ("project", "configs", "scripts") for p in (ROOT / d).rglob("*")
        ]
    for path in tracked:
        if path.endswith(("__init__.py", ".gz", ".pyc")) or "__pycache__" in path:
            continue
        covered = any(path == n or (n.endswith("/") and path.startswith(n)) for n in named)
        assert covered, f"{path} has no row in README's Layout section: add it (one concept per file)"


# Files written as streams, read only by people or after their writer ends: a log is never "replaced".
STREAMS = {
    ("project/cli.py", "open"): "resumes.jsonl, one line appended per resume",
    ("project/sweep/check.py", "open"): "the dry run's console log, written by the child process as it runs",
    ("project/sweep/worker.py", "open"): "a trial's log (appended across retries)",
    ("project/data/chunks.py", "write_text"): "a temporary local copy uploaded to object storage",
}


def test_every_file_the_package_writes_goes_through_the_atomic_helper():
    r"""project/atomic.py is the one writer of files something reads back (checkpoints, summary.json, configs,
    indexes, reports): a write call anywhere else (write_text, write_bytes, open for writing, savefig or
    torch.save on a path) is a torn file waiting for a kill, unless it is a stream listed in STREAMS."""
    found = []
    for path in sorted((ROOT / "project").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in ("project/atomic.py", "project/checkpoint_io.py"):  # the helper, and its checkpoint user
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("write_text", "write_bytes"):
                found.append((rel, name, node.lineno))
            elif name == "open":
                modes = [a.value for a in node.args[1:2] if isinstance(a, ast.Constant)]
                modes += [
                    k.value.value
                    for k in node.keywords
                    if k.arg == "mode" and isinstance(k.value, ast.Constant)
                ]
                if isinstance(func, ast.Attribute) and not node.args and not modes:
                    modes = ["r"]  # Path.open() reads
                if any(set(str(m)) & set("wax+") for m in modes):
                    found.append((rel, name, node.lineno))
            elif name in ("save", "savefig") and node.args:
                # the target: torch.save(obj, target), image.save(target), fig.savefig(target); a plain name is
                # a file object (atomic_write's), a path expression or string is a direct write
                target = node.args[1] if _is_torch_save(func) and len(node.args) > 1 else node.args[0]
                if not isinstance(target, ast.Name):
                    found.append((rel, name, node.lineno))
    unexpected = [f"{rel}:{line} {name}()" for rel, name, line in found if (rel, name) not in STREAMS]
    assert not unexpected, (
        "these calls write a file without project/atomic.py (atomic_write / write_text_atomic): "
        + ", ".join(unexpected)
    )
    listed = {(rel, name) for rel, name, _ in found}
    assert listed >= set(STREAMS), f"STREAMS lists writes that are gone: {set(STREAMS) - listed}"


def _is_torch_save(func) -> bool:
    return isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "torch"

"""README "Layout" is the tree: every path it names exists, and every file of the package is under a row."""

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

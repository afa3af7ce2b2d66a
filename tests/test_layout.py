"""README "Layout" is the tree: every path it names exists, and every file of the package is under a row."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


ARCHITECTURE = ROOT / "docs" / "architecture.md"


def named_paths(text: str) -> list[str]:
    """The repository paths a page names in backticks (a folder ends with /)."""
    spans = re.findall(r"`([^`\s]+)`", text)
    return [s for s in spans if re.fullmatch(r"(project|configs|scripts|tests|docs)/[\w./-]*|Makefile", s)]


@pytest.mark.claim("layout-matches-tree")
def test_the_architecture_page_names_existing_paths_and_every_folder():
    text = ARCHITECTURE.read_text()
    assert len(text.splitlines()) <= 120, "docs/architecture.md: at most 120 lines"
    paths = named_paths(text)
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, f"docs/architecture.md names paths that are not in the tree: {missing}"
    folders = {p.parent.relative_to(ROOT).as_posix() + "/" for p in (ROOT / "project").rglob("*.py")}
    assert folders - {"project/"} <= set(paths), (
        f"a folder of the package without its line: {folders - set(paths)}"
    )


def optional_parts() -> list[str]:
    """The paths of the page's "Optional parts" table (its second column)."""
    section = ARCHITECTURE.read_text().split("## Optional parts", 1)[1].split("\n## ", 1)[0]
    rows = [
        line.split(" | ")[1] for line in section.splitlines() if line.startswith("| ") and "---" not in line
    ]
    return [p for row in rows[1:] for p in named_paths(row) if p.startswith("project/")]


@pytest.mark.claim("layout-matches-tree")
def test_the_core_imports_none_of_the_optional_parts(finished_run):
    """What `make train` with the default config imports, from its start to its end (the session's finished run)."""
    dump = (finished_run.checkout / "modules-at-exit.txt").read_text().split()
    modules = [m for m in dump if m.startswith("project")]
    assert "project.module" in modules and "project.data.datamodule" in modules, modules
    optional = optional_parts()
    assert "project/sweep/" in optional and "project/prepare.py" in optional, optional
    for path in optional:
        name = path.removesuffix(".py").removesuffix("/").replace("/", ".")
        imported = [m for m in modules if m == name or m.startswith(name + ".")]
        assert not imported, f"the core imports {imported}, an optional part (docs/architecture.md)"


# Files written as streams, read only by people or after their writer ends: a log is never "replaced".
STREAMS = {
    ("project/run_dir.py", "open"): "resumes.jsonl, one line appended per resume",
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

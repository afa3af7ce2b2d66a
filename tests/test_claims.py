"""Documentation claims are enforced: every `<!-- claim: id -->` in README.md or its docs/ pages has a test marked
`@pytest.mark.claim("id")`, every id a test names is in the README, and every planted bug in
tests/mutants/*.patch still applies and names README claims (`make mutants` runs them).

Test files are read with `ast`, not collected, so this holds whichever subset of the suite runs.
"""

import ast
import importlib.util
import re
import subprocess
from pathlib import Path

from tests.conftest import documentation

REPO = Path(__file__).resolve().parent.parent
ID = re.compile(r"[a-z0-9]+(?:-[a-z0-9]+)*")
CLAIM_COMMENT = re.compile(r"<!--\s*claim\b(.*?)-->", re.S | re.I)
# The syntax shown as an example inside code (fenced blocks, `inline spans`) is not a claim.
FENCED = re.compile(r"^ *(```|~~~).*?^ *\1[^\n]*$", re.S | re.M)
INLINE = re.compile(r"(`+).+?\1", re.S)

spec = importlib.util.spec_from_file_location("mutate", REPO / "tests/tools/mutate.py")
mutate = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mutate)


def readme_claims(text: str) -> tuple[list[str], list[str]]:
    """(claim ids in order, with repeats; malformed claim comments)."""
    text = INLINE.sub("", FENCED.sub("", text))
    ids, malformed = [], []
    for match in CLAIM_COMMENT.finditer(text):
        body = match.group(1)
        ident = body[1:].strip() if body.startswith(":") else ""
        (ids.append(ident) if ID.fullmatch(ident) else malformed.append(match.group(0)))
    return ids, malformed


def _is_claim_mark(node: ast.AST) -> bool:
    """`pytest.mark.claim`, or `mark.claim` after `from pytest import mark`."""
    if not (isinstance(node, ast.Attribute) and node.attr == "claim"):
        return False
    owner = node.value
    return (isinstance(owner, ast.Attribute) and owner.attr == "mark") or (
        isinstance(owner, ast.Name) and owner.id == "mark"
    )


def scan_source(source: str, where: str) -> tuple[dict[str, list[str]], list[str]]:
    """({id: ["file:line", ...]}, problems) for every claim marker in one file, wherever it appears:
    a decorator, `pytestmark = ...` (alone or in a list), `pytest.param(..., marks=...)`."""
    tree = ast.parse(source, filename=where)
    called = {id(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    found: dict[str, list[str]] = {}
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _is_claim_mark(node.func):
            if not node.args or node.keywords:
                problems.append(f"{where}:{node.lineno}: claim() takes the ids as positional strings")
            for arg in node.args:
                if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
                    problems.append(
                        f"{where}:{node.lineno}: a claim id must be a string literal (read statically)"
                    )
                elif not ID.fullmatch(arg.value):
                    problems.append(
                        f"{where}:{node.lineno}: malformed claim id {arg.value!r} (lowercase, dashes)"
                    )
                else:
                    found.setdefault(arg.value, []).append(f"{where}:{node.lineno}")
        elif _is_claim_mark(node) and id(node) not in called:
            problems.append(f"{where}:{node.lineno}: pytest.mark.claim without ids")
    return found, problems


def scan_tests() -> tuple[dict[str, list[str]], list[str]]:
    found: dict[str, list[str]] = {}
    problems: list[str] = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        ids, bad = scan_source(path.read_text(), str(path.relative_to(REPO)))
        for ident, places in ids.items():
            found.setdefault(ident, []).extend(places)
        problems += bad
    return found, problems


def test_readme_claim_ids_are_well_formed_and_unique():
    ids, malformed = readme_claims(documentation())
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    assert not malformed, (
        f"README.md: malformed claim comments (use <!-- claim: lowercase-dashes -->): {malformed}"
    )
    assert not duplicates, f"README.md: claim ids used twice: {duplicates}"
    assert ids, "README.md has no <!-- claim: id --> comments"


def test_every_readme_claim_has_a_test():
    ids, _ = readme_claims(documentation())
    found, _ = scan_tests()
    untested = [i for i in dict.fromkeys(ids) if i not in found]
    assert not untested, (
        f"README claims without a test: {untested}. Mark the test that fails when the claim breaks with "
        '@pytest.mark.claim("<id>"), or take the claim out of README.md.'
    )


def test_every_test_claim_is_in_the_readme(request):
    ids = set(readme_claims(documentation())[0])
    found, problems = scan_tests()
    assert not problems, "\n".join(problems)
    unknown = {i: places for i, places in found.items() if i not in ids}
    assert not unknown, (
        f"tests name claims that README.md lacks (add <!-- claim: id --> after the claim, or fix the id): {unknown}"
    )
    # A marker the static scan cannot see (an alias, a computed id) would escape the two checks above:
    # every marker pytest collected in this session must be one the scan found.
    collected = {i for item in request.session.items for m in item.iter_markers("claim") for i in m.args}
    assert collected <= set(found), f"claim markers the static scan missed: {sorted(collected - set(found))}"


def test_the_scanners_read_every_form():
    source = """
from pytest import mark
pytestmark = [pytest.mark.slow, pytest.mark.claim("in-list")]
other = pytest.mark.claim("module-mark")
@pytest.mark.claim("deco-a", "deco-b")
def test_a(): pass
@mark.claim("bare-mark")
def test_b(): pass
@pytest.mark.parametrize("x", [1, pytest.param(2, marks=pytest.mark.claim("in-param")),
                               pytest.param(3, marks=[pytest.mark.claim("in-param-list")])])
def test_c(x): pass
@pytest.mark.claim
def test_d(): pass
@pytest.mark.claim(NAME, "Bad_Id")
def test_e(): pass
"""
    found, problems = scan_source(source, "t.py")
    expected = {"in-list", "module-mark", "deco-a", "deco-b", "bare-mark", "in-param", "in-param-list"}
    assert set(found) == expected
    assert len(problems) == 3  # the bare mark, the name, the malformed id
    text = (
        "A. <!-- claim: one -->\n`<!-- claim: in-code -->`\n```\n<!-- claim: fenced -->\n```\n"
        "B. <!-- claim: Two_bad --> C. <!-- claim: one --> D. <!--claim:three-->"
    )
    assert readme_claims(text) == (["one", "one", "three"], ["<!-- claim: Two_bad -->"])


def test_every_mutant_applies_and_names_readme_claims():
    """`make mutants` needs every planted bug to apply to the current tree; one that rotted would fail there
    (or, worse, pass as killed for the wrong reason), so check here, where the tree changes."""
    ids = set(readme_claims(documentation())[0])
    patches = sorted((REPO / "tests/mutants").glob("*.patch"))
    assert patches, "tests/mutants/ holds no mutants"
    problems = []
    for path in patches:
        try:
            mutant = mutate.read_patch(path)
        except ValueError as exc:
            problems.append(str(exc))
            continue
        unknown = [c for c in mutant.claims if c not in ids]
        if unknown:
            problems.append(f"{path.name}: claims not in README.md: {unknown}")
        # --check: nothing is written; against the working tree, which is what mutate.py copies
        check = subprocess.run(
            ["git", "apply", "--check", str(path)], cwd=REPO, capture_output=True, text=True
        )
        if check.returncode != 0:
            problems.append(
                f"{path.name} no longer applies (regenerate it with git diff): {check.stderr.strip()}"
            )
    assert not problems, "\n".join(problems)

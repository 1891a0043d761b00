"""The project's contract lives in the repository: `docs/design.md`.

No file may cite a document that only exists outside the repository (a clone would not have it), and every section of
docs/design.md that the code cites by name must exist there as a heading.
"""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design.md"
# The project's starting documents, outside the repository, spelled in pieces so that this file does not cite them.
# The last one, in upper case and without its folder, is how some comments cited the first.
OUTSIDE = ("shared/DESIGN" + ".md", "shared/" + "guides", "shared/STYLE" + ".md", "DESIGN" + ".md")
# "docs/design.md, 'Section'", or several: "docs/design.md, 'One', 'Two'" / "'One' and 'Two'"; a name stays on one line
CITATION = re.compile(r"docs/design\.md(?P<names>(?:(?:,|\s+and)\s+'[^'\n]+')*)")
NAME = re.compile(r"'([^'\n]+)'")


def repo_files() -> list[Path]:
    """Tracked files, and new ones not ignored yet (they are committed with the change that adds them)."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    paths = [ROOT / p for p in out.decode().split("\0") if p]
    return [p for p in paths if "node_modules" not in p.parts and p.is_file()]


def text_of(path: Path) -> str | None:
    """The file's text, or None for a binary file."""
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def outside_citations(text: str) -> list[str]:
    return [
        f"line {text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}"
        for needle in OUTSIDE
        for m in re.finditer(re.escape(needle), text)
    ]


def cited_sections(text: str) -> list[str]:
    return [name for m in CITATION.finditer(text) for name in NAME.findall(m.group("names"))]


def headings() -> set[str]:
    return {m.group(1).strip() for m in re.finditer(r"^#+\s+(.+?)\s*#*\s*$", DESIGN.read_text(), re.MULTILINE)}


def test_the_checks_tell_a_citation_from_a_users_shared_folder():
    assert (
        outside_citations("tfmem run --save /shared/tfmem/worker0.json train.py; `%tfmem cluster /shared/tfmem`") == []
    )
    assert outside_citations("see " + OUTSIDE[0] + " §3") != []
    assert outside_citations("(" + OUTSIDE[3] + " §1)") != []
    assert cited_sections("(docs/design.md, 'Memory guard', 'Out of memory and limits' have it)") == [
        "Memory guard",
        "Out of memory and limits",
    ]
    assert cited_sections("docs/design.md, 'A' and 'B'; docs/design.md alone") == ["A", "B"]


def test_no_file_cites_a_document_outside_the_repository():
    found = {}
    for path in repo_files():
        text = text_of(path)
        if text is not None and (hits := outside_citations(text)):
            found[str(path.relative_to(ROOT))] = hits
    assert found == {}, "cite docs/design.md (a section by name) instead"


def test_every_cited_section_of_the_design_exists():
    known = headings()
    sources = [p for folder in ("tfmem_magic", "tests", "benchmarks") for p in (ROOT / folder).rglob("*.py")]
    cited = {}
    for path in sources:
        if path == Path(__file__).resolve():
            continue
        for name in cited_sections(path.read_text()):
            cited.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert cited, "the code cites no section of docs/design.md: is the citation form still \"docs/design.md, 'Name'\"?"
    missing = {name: where for name, where in cited.items() if name not in known}
    assert missing == {}, f"not a heading of docs/design.md; the headings are: {sorted(known)}"


def test_every_citation_of_the_design_in_the_package_names_a_section():
    """A citation in another form ("docs/design.md §3", a name in double quotes) would escape the check above."""
    bare = []
    for path in (ROOT / "tfmem_magic").rglob("*.py"):
        text = path.read_text()
        bare += [
            f"{path.relative_to(ROOT)}: {text[m.start() : m.end() + 30]!r}"
            for m in CITATION.finditer(text)
            if not m.group("names")
        ]
    assert bare == [], "cite as \"docs/design.md, 'Section name'\""

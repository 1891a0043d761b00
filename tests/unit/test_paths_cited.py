"""Every test file and docs page that the package, pyproject.toml, the README, docs/ and the lab extension cite exists.

A comment that says "tests/unit/test_x.py checks this" after the test moved to tests/integration/ sends the reader
to nothing; this finds each `tests/....py` and `docs/....md` path cited in those files and asserts it is there. A
path with a `*` is a glob and must match at least one file. After moving a test or a page, fix its citations (a
generated file, such as labextension/src/report.ts, through its generator: `cd labextension && npm run types`).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# "tests/unit/test_x.py", "docs/what-if.md", "tests/unit/test_*.py"; not "labextension/tests/x.py" nor "my_tests/x.py"
CITED = re.compile(r"(?<![\w./-])((?:tests|docs)/[\w./*-]*?\.(?:py|md))(?!\w)")


def citing_files() -> list[Path]:
    """The files whose citations are checked: the package's code and data (not its built lab extension), pyproject,
    the README, the docs pages and the lab extension's sources and scripts."""
    package = [
        p
        for p in sorted((ROOT / "tfmem_magic").rglob("*"))
        if p.suffix in {".py", ".json"} and "labextension" not in p.relative_to(ROOT / "tfmem_magic").parts
    ]
    return [
        *package,
        ROOT / "pyproject.toml",
        ROOT / "README.md",
        *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "labextension" / "src").glob("*.ts")),
        *sorted(p for p in (ROOT / "labextension" / "scripts").iterdir() if p.is_file()),
    ]


def cited_paths(text: str) -> list[str]:
    return [m.group(1) for m in CITED.finditer(text)]


def exists(path: str) -> bool:
    return any(ROOT.glob(path)) if "*" in path else (ROOT / path).is_file()


def test_the_pattern_finds_cited_paths():
    text = (
        "tests/unit/test_labextension.py checks it; see docs/what-if.md, (tests/integration/test_docs_site.py) and "
        "`tests/unit/test_*.py`; not labextension/tests/x.py, my_tests/y.py nor docs/panel.png"
    )
    assert cited_paths(text) == [
        "tests/unit/test_labextension.py",
        "docs/what-if.md",
        "tests/integration/test_docs_site.py",
        "tests/unit/test_*.py",
    ]


def test_every_cited_test_file_and_docs_page_exists():
    missing = []
    for path in citing_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        for cited in cited_paths(text):
            if not exists(cited):
                missing.append(f"{path.relative_to(ROOT)} cites {cited}, which does not exist")
    assert missing == [], "\n".join(sorted(set(missing)))

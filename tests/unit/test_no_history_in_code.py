"""The code, the README and docs/ carry facts, not history: no dates, no issue numbers of this project, no first-person
narration.

A run's result is a measurement of a named benchmark run, stated in docs/ (a table or a figure is the record); a comment
says why and points to the docs page. External references stay: "tensorflow/tensorflow#37556", "memray issue #519", a
commit hash, "arXiv 2510.21048", "TF 2.21".

Python files are read token by token: only comments and strings (docstrings, messages) are prose; a name in code is not.
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

HOW_TO_FIX = (
    "state it as a measurement of a named benchmark run in docs/, without a date; cite the docs page, not the issue; "
    "write without 'I' or 'my' (the fact, or the passive: 'the binary was checked')"
)

MONTHS = "January|February|March|April|May|June|July|August|September|October|November|December"
# A month of a year or of a day: "December 2026", "December 5", "5 December". Case-sensitive: "may 5" is a verb.
YEAR = r"(?:19[5-9]\d|20[0-3]\d)"  # 1950-2039: a year, where 2048 is a batch
MONTH_DATE = re.compile(rf"\b(?:{MONTHS})\s+(?:{YEAR}|[0-3]?\d(?:st|nd|rd|th)?)\b|\b[0-3]?\d\s+(?:{MONTHS})\b")
ISO_DATE = re.compile(rf"\b{YEAR}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])\b")
# "(2025)", not a call's argument: "Needs(2048)"
YEAR_IN_PARENTHESES = re.compile(rf"(?<![\w(])\({YEAR}\)")
# "issue 29", "issue #29", "Issue 29", "issues 25 and 26"; and GitHub's short form in parentheses: "(#29)", "(#2, #6)".
# A "#" elsewhere is left alone: a debugger's frame ("#8  _int_free"), a colour, a repository's "owner/name#123".
ISSUE = re.compile(r"\b[Ii]ssues?\s+#?\d+")
BARE_NUMBER = re.compile(r"\(#\d+(?:\s*(?:,|and)\s*#\d+)*\)")
# An issue of this project cited without its number: "the issue's target", "the issue reports", "(issue: huge traces)".
# "The issue is a fragmented arena" (a problem, in plain English) is left alone.
THE_ISSUE = re.compile(
    r"\b[Tt]he issue's\b|\b[Tt]he issue (?:reports|asks|asked|says|said|measured|wants|gives)\b|\(issue[:)]"
    r"|\b[Tt]he issue that started\b"
)
# The issue trackers of other projects, named before "issue": "memray issue #519", "keras-team/keras issue 123" (an
# owner/name without a dot: "docs/what-if.md issue 29" is this project's).
EXTERNAL = re.compile(
    r"(?:(?<![\w./-])[\w-]+/[\w-]+|\b(?:memray|tensorflow|TensorFlow|TF|keras|Keras|XLA|JAX|jax|PyTorch|pytorch|CPython|Python|"
    r"python|NumPy|numpy|Jupyter|jupyter|JupyterLab|jupyterlab|IPython|ipython|ipykernel|pytest|Sphinx|sphinx|MyST|"
    r"ruff|mypy|CUDA|cuDNN|NVIDIA|nvidia|Bazel|protobuf|glibc|jemalloc|tcmalloc|Horovod|horovod|upstream))(?:'s)?\s+$"
)
# "I" as a pronoun, with its contractions; not "I/O", a flag "-I", a path "/I", nor a roman numeral ("Part I", "I, II").
PRONOUN_I = re.compile(r"(?<![\w/.\-'’])I(?:['’](?:m|ve|d|ll))?(?![\w/\-])")
ROMAN_BEFORE = re.compile(
    r"\b(?:Part|Phase|Type|Step|Stage|Level|Class|Tier|Section|Chapter|Appendix|Table|Figure)\s+$"
)
ROMAN_LIST = re.compile(r"^\s*,\s*II\b")
MY = re.compile(r"(?<![\w/.\-])(?:[Mm]y|[Mm]yself)(?![\w/.\-])")

# (file, exact text of the line's hit) pairs that are not history; each with why. Keep this short.
ALLOWED: set[tuple[str, str]] = set()


def scanned() -> list[Path]:
    files = sorted((ROOT / "tfmem_magic").rglob("*.py"))
    files += sorted((ROOT / "benchmarks").glob("*.py"))
    files += [ROOT / "README.md"]
    files += sorted((ROOT / "docs").glob("*.md"))
    return files


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of the prose in a file: every line of a Markdown file; the comments and strings of Python."""
    text = path.read_text(encoding="utf-8")
    if path.suffix != ".py":
        return list(enumerate(text.splitlines(), start=1))
    prose_kinds = {tokenize.COMMENT, tokenize.STRING}
    prose_kinds |= {getattr(tokenize, name) for name in ("FSTRING_MIDDLE",) if hasattr(tokenize, name)}
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type in prose_kinds:
            for offset, line in enumerate(tok.string.splitlines()):
                out.append((tok.start[0] + offset, line))
    return out


def hits_in(line: str) -> list[str]:
    """The history a line of prose carries: each hit as the text that matched."""
    found = []
    for pattern in (MONTH_DATE, ISO_DATE, YEAR_IN_PARENTHESES):
        found += [m.group(0) for m in pattern.finditer(line)]
    for m in ISSUE.finditer(line):
        if not EXTERNAL.search(line[: m.start()]):
            found.append(m.group(0))
    found += [m.group(0) for m in BARE_NUMBER.finditer(line)]
    found += [m.group(0) for m in THE_ISSUE.finditer(line) if not EXTERNAL.search(line[: m.start()])]
    for m in PRONOUN_I.finditer(line):
        if m.group(0) == "I" and (ROMAN_LIST.match(line[m.end() :]) or ROMAN_BEFORE.search(line[: m.start()])):
            continue
        found.append(m.group(0))
    found += [m.group(0) for m in MY.finditer(line)]
    return found


def history(paths: list[Path]) -> list[str]:
    out = []
    for path in paths:
        name = str(path.relative_to(ROOT))
        for number, line in prose_lines(path):
            for hit in hits_in(line):
                if (name, hit) not in ALLOWED:
                    out.append(f"{name}:{number}: {hit!r} in {line.strip()[:140]!r}")
    return out


def test_the_patterns_catch_history_and_leave_facts():
    for diary in (
        "tried December 2026",
        "measured on December 5",
        "on 5 December",
        "run 2026-12-05",
        "a paper (2025)",
        "issue 29's step replay",
        "see issue #29",
        "Issue 29 asked for it",
        "issues 25 and 26",
        "the issue's target",
        "The issue reports 3 of 6",
        "Target (issue: huge traces)",
        "(#27)",
        "docs/what-if.md issue 29",
        "fixed (#25, #26)",
        "I checked the binary",
        "I did not produce it",
        "I'm not sure",
        "I've seen",
        "I'd expect",
        "I don't know",
        "in my runs",
        "My guess",
    ):
        assert hits_in(diary), diary
    for fact in (
        "memray issue #519",
        "tensorflow/tensorflow#37556",
        "keras-team/keras#123",
        "keras-team/keras issue 123",
        "TensorFlow issue 37556",
        "I/O bound",
        "the input pipeline's I/O",
        "Part I of the guide",
        "I, II and III",
        "gcc -I include",
        "arXiv 2510.21048 and commit 3f2a9c1",
        "TF 2.21, 2.20",
        "my_model.fit(x)",
        "cd my-project",
        "mypy strict",
        "the issue is a fragmented arena",
        "what causes the issue",
        "May be slower",
        "in colour #fff or a heading anchor (#heading)",
        "#8  tsl::profiler::SplitEventTracker, frame #8 above",
        "a `Needs(2048)` model",
        "the largest batch (2048)",
        "a tensor of 1024 bytes (2 x 512)",
    ):
        assert not hits_in(fact), fact


def test_no_dates_issue_numbers_or_first_person_in_code_readme_and_docs():
    found = history(scanned())
    assert found == [], f"{len(found)} hits; {HOW_TO_FIX}:\n" + "\n".join(found)

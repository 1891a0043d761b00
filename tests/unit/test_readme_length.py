"""The README is the user's guide, not the project's record: at most 400 lines.

What it holds: what tfmem_magic is, a screenshot, the two Quickstart commands, the `%%tfmem` options, the `%tfmem`
commands, the Python API and troubleshooting, each feature in a few lines with a link. Measurements, accuracy
tables and how a method works go to the docs page the README links to (docs/what-if.md, docs/preflight.md,
docs/guard.md, docs/measuring.md, ...), leaving a line or two and the link.
"""

from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
MAX_LINES = 400


def test_the_readme_has_at_most_400_lines():
    lines = len(README.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_LINES, (
        f"README.md has {lines} lines (at most {MAX_LINES}): move the details into the docs page that the section "
        "links to, and leave a one- or two-line summary with the link"
    )

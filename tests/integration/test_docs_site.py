"""The documentation site builds: Sphinx + MyST over docs/ (docs/conf.py), with warnings as errors.

A warning is a page left out of the toctree, a link to a page or heading that does not exist (the README's links to
docs/*.md included: docs/guide.md includes the README), a broken image or a Markdown construct MyST cannot read. The
build takes a few seconds; sphinx, myst-parser and the theme are in the `test` extra, so this runs in CI.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_docs_site_builds_without_warnings(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", "docs", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    assert (tmp_path / "index.html").is_file()
    # the README is the site's user's guide, and its links to docs/*.md became links between the site's pages
    guide = (tmp_path / "guide.html").read_text()
    assert "Quickstart" in guide
    assert 'href="what-if.html"' in guide and 'href="design.html"' in guide


def test_every_docs_page_is_in_the_toctree():
    """Sphinx warns about a page outside every toctree; this names it without a build."""
    index = (ROOT / "docs" / "index.md").read_text()
    listed = set(re.findall(r"^([\w-]+)$", index, re.MULTILINE))
    pages = {p.stem for p in (ROOT / "docs").glob("*.md")} - {"index"}
    assert pages <= listed, f"add to a toctree in docs/index.md: {sorted(pages - listed)}"

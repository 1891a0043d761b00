"""Sphinx configuration of tfmem_magic's documentation site: the Markdown pages of docs/ (MyST), and the README as
the user's guide (docs/guide.md includes it). Build: `python -m sphinx -W -b html docs build/docs`;
tests/integration/test_docs_site.py builds it with warnings as errors."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

project = "tfmem_magic"
author = "tfmem_magic contributors"
copyright = "tfmem_magic contributors"
_version = re.search(r'__version__\s*=\s*"([^"]+)"', (ROOT / "tfmem_magic" / "_version.py").read_text())
release = version = _version.group(1) if _version else ""

extensions = ["myst_parser"]
source_suffix = {".md": "markdown"}
root_doc = "index"
# the reproductions and their caches are scripts, not pages; build/ is where a local build goes
exclude_patterns = ["_build", "build", "repro/**", "**/__pycache__", "**/.ipynb_checkpoints"]

# GitHub-style anchors (#surviving-out-of-memory-the-guard) resolve in the site as they do on GitHub
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

html_theme = "pydata_sphinx_theme"
html_title = "tfmem_magic"
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
}
html_show_sourcelink = False

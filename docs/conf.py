"""Sphinx configuration of tfmem_magic's documentation site: the Markdown pages of docs/ (MyST), the README as
the user's guide (docs/guide.md includes it), and the API reference made from the docstrings (docs/api.md, autodoc).
Build: `python -m sphinx -W -b html docs build/docs`; tests/integration/test_docs_site.py builds it with warnings as
errors."""

import dataclasses
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# autodoc imports the package from the checkout (importing tfmem_magic imports neither TensorFlow nor IPython)
sys.path.insert(0, str(ROOT))

project = "tfmem_magic"
author = "tfmem_magic contributors"
copyright = "tfmem_magic contributors"
_version = re.search(r'__version__\s*=\s*"([^"]+)"', (ROOT / "tfmem_magic" / "_version.py").read_text())
release = version = _version.group(1) if _version else ""

extensions = ["myst_parser", "sphinx.ext.autodoc"]
source_suffix = {".md": "markdown"}
root_doc = "index"
# the reproductions and their caches are scripts, not pages; build/ is where a local build goes
exclude_patterns = ["_build", "build", "repro/**", "**/__pycache__", "**/.ipynb_checkpoints"]

# GitHub-style anchors (#surviving-out-of-memory-the-guard) resolve in the site as they do on GitHub
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

# docs/api.md: the docstrings are plain prose with `name` for code, not reStructuredText written for Sphinx (so no
# napoleon): a single-backticked name is code there too (default_role; the Markdown pages are MyST's, where it
# already is). Type hints go under the signature, a line for each parameter (a dataclass' signature is every field,
# and with its types it would run for a screen); references they cannot resolve are not warnings (nitpicky off: the
# hints name private and third-party types).
default_role = "code"
autodoc_typehints = "description"
# a dataclass without a docstring has its signature as one, with its annotations as strings: introspect instead
autodoc_docstring_signature = False
# one parameter a line once a signature is long
maximum_signature_line_length = 100
autodoc_member_order = "bysource"
autoclass_content = "class"
nitpicky = False

html_theme = "pydata_sphinx_theme"
html_title = "tfmem_magic"
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
}
html_show_sourcelink = False


def setup(app):
    """tfmem_magic.keras.MemoryMonitor is a Keras Callback: its module imports Keras, and Keras imports TensorFlow.
    Keras is mocked for the whole build (autodoc_mock_imports would mock it only while autodoc imports the module,
    and autodoc then imports the Callback's module for real to read its source), so the site builds in seconds and
    without TensorFlow installed. What docs/api.md shows of the monitor is its own docstring and the signature
    written there, none of it Keras'."""
    from sphinx.ext.autodoc.mock import mock

    app.connect("autodoc-process-docstring", _no_dataclass_signature_as_docstring)
    keras_mocked = mock(["keras", "tf_keras"])
    app.connect("builder-inited", lambda _app: keras_mocked.__enter__())
    app.connect("build-finished", lambda _app, _exc: keras_mocked.__exit__(None, None, None))


def _no_dataclass_signature_as_docstring(_app, what, _name, obj, _options, lines):
    """A dataclass without a docstring gets its signature as one ("RssInfo(baseline_bytes: 'int' = 0, ...)"): the
    signature above says it already."""
    if what == "class" and dataclasses.is_dataclass(obj) and (obj.__doc__ or "").startswith(f"{obj.__name__}("):
        lines.clear()

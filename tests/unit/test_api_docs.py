"""docs/api.md, the API reference that Sphinx's autodoc makes from the docstrings, covers the public API: every name
`tfmem_magic.__all__` exports, and every dataclass of the report. Sphinx warns about a name that does not exist, not
about one left out: this names it without a build (tests/integration/test_docs_site.py builds the page).

What the page writes by hand is checked against the code: `MemoryMonitor`'s signature (the build mocks Keras, whose
Callback would lend the class its own) and the values of `SCHEMA` and `MIME_TYPE`.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import tfmem_magic
from tfmem_magic.adapters.keras_callback import MemoryMonitorMixin
from tfmem_magic.core import report

ROOT = Path(__file__).resolve().parents[2]
PAGE = (ROOT / "docs" / "api.md").read_text()
DOCUMENTED = set(re.findall(r"^\.\. (?:auto\w+|py:\w+):: ([\w.]+)", PAGE, re.MULTILINE))


def test_every_exported_name_is_documented():
    exported = {f"tfmem_magic.{name}" for name in tfmem_magic.__all__ if name != "__version__"}
    report_classes = {
        f"tfmem_magic.core.report.{name}"
        for name, obj in vars(report).items()
        if dataclasses.is_dataclass(obj) and obj.__module__ == report.__name__ and name != "Report"
    }
    missing = sorted((exported | report_classes | {"tfmem_magic.keras.MemoryMonitor"}) - DOCUMENTED)
    assert missing == [], f"add to docs/api.md: {missing}"


def test_the_memory_monitors_signature_is_the_classes():
    written = re.search(r"^\.\. autoclass:: tfmem_magic\.keras\.MemoryMonitor\((.*)\)$", PAGE, re.MULTILINE)
    assert written, "docs/api.md: `.. autoclass:: tfmem_magic.keras.MemoryMonitor(...)` with its signature"
    page = [tuple(part.strip().split("=", 1)) for part in written.group(1).split(",")]
    params = list(inspect.signature(MemoryMonitorMixin.__init__).parameters.values())[1:]
    assert page == [(p.name, repr(p.default).replace("'", '"')) for p in params]


def test_the_constants_values_are_the_codes():
    for name in ("SCHEMA", "MIME_TYPE"):
        value = re.search(rf"^\.\. py:data:: tfmem_magic\.{name}\n   :value: (.*)$", PAGE, re.MULTILINE)
        assert value and value.group(1) == f'"{getattr(tfmem_magic, name)}"', name

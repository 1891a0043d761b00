"""A long session does not grow because of tfmem: what it leaves in the kernel after each profiled cell is bounded
(docs/session.md)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def test_ipythons_output_history_keeps_the_newest_reports_whole_and_the_older_as_text(shell):
    """IPython 9 keeps every displayed bundle for the kernel's life (history_manager.outputs): a report's JSON and
    HTML stay there only for the newest reports."""
    from tfmem_magic.core.report import MIME_TYPE
    from tfmem_magic.core.session import SESSION, WHOLE_REPORTS

    SESSION.reset()
    for i in range(WHOLE_REPORTS + 3):
        assert shell.run_cell(f"%%tfmem --quick --no-panel\nv = {i}").success
    shown = [out["data"] for out in shell.display_pub.outputs]  # the bundles, by reference, as IPython keeps them
    reports = [b for b in shown if "text/plain" in b and (MIME_TYPE in b or set(b) == {"text/plain"})]
    assert len(reports) == WHOLE_REPORTS + 3
    assert all(set(b) == {"text/plain"} and b["text/plain"] for b in reports[:3])
    assert all(MIME_TYPE in b and "text/html" in b for b in reports[3:])
    SESSION.reset()

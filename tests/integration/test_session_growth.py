"""A long session does not grow because of tfmem: profiled cells in a real kernel (the panel shown, each cell a new
one) against the same cells in a control kernel without tfmem, RSS counted after the first WARM cells
(benchmarks/session_growth.py measures 200 cells of each variant: docs/session.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import session_growth  # noqa: E402  the benchmark's kernels and cells

pytestmark = pytest.mark.slow
CELLS, WARM = 60, 20
MIB = 2**20
# generous: 40 cells of the default mode measured -0.3 MiB over the control (docs/session.md), and +19 MiB before
# the history's caps, the panels' closing and the slimmed display bundles
OVER_CONTROL = 10 * MIB


def test_forty_profiled_cells_with_their_panels_grow_the_kernel_no_more_than_without_tfmem():
    control = session_growth.run_variant("control", CELLS, WARM)
    profiled = session_growth.run_variant("trace", CELLS, WARM, holdings_too=True)
    over = profiled["growth_bytes"] - control["growth_bytes"]
    assert over < OVER_CONTROL, (over / MIB, profiled["readings"], control["readings"])
    held = profiled["holdings"]
    from tfmem_magic.core.session import HISTORY_BYTES, WHOLE_REPORTS

    assert held["history_bytes"] <= HISTORY_BYTES
    # the live panels are the newest reports', and only theirs keep widgets and comms (a panel is ~75 widgets)
    assert held["live_panels"] == WHOLE_REPORTS
    assert held["widgets"] <= 100 * WHOLE_REPORTS and held["comms"] <= 100 * WHOLE_REPORTS


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

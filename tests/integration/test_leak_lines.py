"""The line of the user's code that made what a leaking cell left live (docs/leaks.md, docs/lines.md), in a real
IPython shell: a `tf.function` helper whose 4 MiB result each run of a cell appends to a list."""

from __future__ import annotations

import gc
import re

import pytest

import tfmem_magic
from tfmem_magic.core.report import Report
from tfmem_magic.show.render import render_text

pytestmark = pytest.mark.slow

HELPER = """@tf.function
def noise():
    return tf.random.normal([1024, 1024])
"""
LEAKY = "%%tfmem --no-panel\nkept.append(noise())\n"


def test_leak_growth_names_the_line_of_the_helper_that_made_what_each_run_left(shell):
    for cell in (
        "import tensorflow as tf\nkept = []",
        HELPER,  # In [2]: its line 3 makes the 4 MiB tensor
        # the allocator's regions grown before the profiled cells: a jump of the process in a young trace segment can
        # make the tracer restart the segment around it (measure/tracer.py), and the tensor is then in no line
        "_ = tf.zeros([8, 1024, 1024]).numpy().sum(); del _",
    ):
        assert shell.run_cell(cell, store_history=True).success
    reports: list[Report] = []
    for _ in range(3):
        gc.collect()  # garbage collected during a run would free tensors and hide that run's growth
        assert shell.run_cell(LEAKY, store_history=True).success
        report = tfmem_magic.last_report()
        assert report is not None and report.trace is not None and report.trace.complete
        reports.append(report)
    # every run: what it left live at its end, by line, names the helper's line (the function traced in the first
    # run is the one the later runs ran)
    for report in reports:
        assert report.trace is not None
        line = next(
            (g for g in report.trace.held_at_end_by_line if g.kind == "line" and g.label == "In [2] line 3"), None
        )
        assert line is not None, [(g.label, g.kind, g.bytes) for g in report.trace.held_at_end_by_line]
        assert line.code == "return tf.random.normal([1024, 1024])" and line.bytes >= 4 * 2**20
        assert any(t.shape == "[1024,1024]" for t in line.tensors), line.tensors
    assert [any(f.id == "leak-growth" for f in r.findings) for r in reports] == [False, False, True]
    finding = next(f for f in reports[-1].findings if f.id == "leak-growth")
    # the line's size is what the trace saw still live at the end: the 4 MiB tensor, at times with more of the run
    code = re.escape("In [2] line 3 (`return tf.random.normal([1024, 1024])`)")
    said = re.compile(f"by the line of code that made it: {code} ([\\d.]+) MiB")
    found = said.search(finding.evidence)
    assert found and float(found.group(1)) >= 4 and "`kept`" in finding.evidence, finding.evidence
    assert said.search(render_text(reports[-1]))
    as_json = reports[-1].to_dict()["trace"]["held_at_end_by_line"]
    assert any(g["label"] == "In [2] line 3" for g in as_json)

"""What a kernel remembers between cells lives in one object, and one call forgets it."""

from pathlib import Path

import tfmem_magic
from tfmem_magic.core import session
from tfmem_magic.core.report import COMPACTED_NOTE, Report, footprint
from tfmem_magic.core.session import HISTORY_BYTES, HISTORY_SIZE, SESSION, WHOLE_REPORTS
from tfmem_magic.core.sizes import format_bytes
from tfmem_magic.show.panel import close_panel
from tfmem_magic.show.render import compare_text
from tfmem_magic.show.status import history_text, status_text


def test_reports_runs_and_numbers_live_in_the_session_and_reset_forgets_them():
    with tfmem_magic.profile(mode="quick", cell_key="cell:a") as first:
        pass
    with tfmem_magic.profile(mode="quick", cell_key="cell:a") as second:
        pass
    assert tfmem_magic.last_report() is second.report and SESSION.history[-1] is second.report
    assert second.report.number == first.report.number + 1 and second.report.run == first.report.run + 1
    assert len(SESSION.runs_of("cell:a")) >= 2
    SESSION.reset()
    assert tfmem_magic.last_report() is None and len(SESSION.history) == 0 and SESSION.runs == {}
    with tfmem_magic.profile(mode="quick", cell_key="cell:a") as again:
        pass
    assert again.report.number == 1 and again.report.run == 1  # numbering and the leak rule start afresh


def test_measurements_that_publish_nothing_leave_the_session_alone():
    before = (SESSION.published, len(SESSION.history))
    with tfmem_magic.profile(mode="quick", publish=False) as p:
        pass
    assert p.report.number == 0 and (SESSION.published, len(SESSION.history)) == before


RECORDED = Path(__file__).parent / "recorded" / "copy_made_while_untraced.json"


def _published(n: int) -> list[Report]:
    """`n` copies of a recorded trace report (a 2000-point timeline), published one after another."""
    reports = []
    for _ in range(n):
        report = Report.load(RECORDED)
        report.number = SESSION.next_number()
        SESSION.publish(report)
        reports.append(report)
    return reports


def test_older_reports_are_kept_without_their_time_series_and_the_newest_whole():
    SESSION.reset()
    reports = _published(WHOLE_REPORTS + 3)
    kept = list(SESSION.history)
    assert [r.number for r in kept] == [r.number for r in reports]
    assert all(k is r for k, r in zip(kept[-WHOLE_REPORTS:], reports[-WHOLE_REPORTS:], strict=True))
    for small, whole in zip(kept[:3], reports[:3], strict=True):
        assert small is not whole and COMPACTED_NOTE in small.notes
        assert small.trace.timeline == [] and small.rss.samples == [] and whole.trace.timeline  # the whole one stays
        # what %tfmem history, compare, --before and the what-if read is all there
        assert history_text([small]) == history_text([whole])
        assert compare_text(small, reports[-1]) == compare_text(whole, reports[-1])
        assert small.whatif_basis == whole.whatif_basis and small.findings == whole.findings
    assert footprint(kept[0]) < footprint(reports[0]) / 3
    # each one's footprint, as measured when it entered or was compacted (dicts may resize later: an estimate)
    assert all(abs(b - footprint(r)) < 0.02 * b for b, r in zip(SESSION.history_bytes, kept, strict=True))
    SESSION.reset()


def test_the_history_keeps_at_most_its_count_and_its_bytes(monkeypatch):
    SESSION.reset()
    _published(HISTORY_SIZE + 5)
    assert len(SESSION.history) == HISTORY_SIZE and SESSION.history[0].number == 6
    assert sum(SESSION.history_bytes) <= HISTORY_BYTES
    SESSION.reset()
    monkeypatch.setattr(session, "HISTORY_BYTES", 3 * footprint(Report.load(RECORDED)))
    _published(8)
    assert 1 < len(SESSION.history) < 8 and sum(SESSION.history_bytes) <= session.HISTORY_BYTES
    assert SESSION.history[-1].number == 8  # the oldest left first
    SESSION.reset()


def test_the_status_states_the_historys_caps_and_what_it_holds():
    SESSION.reset()
    _published(2)
    line = next(line for line in status_text().splitlines() if line.startswith("Reports"))
    assert f"2 of at most {HISTORY_SIZE}" in line and format_bytes(HISTORY_BYTES) in line
    assert format_bytes(sum(SESSION.history_bytes)) in line and f"newest {WHOLE_REPORTS}" in line
    SESSION.reset()


def test_older_panels_are_closed_and_their_widgets_released():
    import ipywidgets.widgets.widget as widget_module

    from tfmem_magic.show.panel import build_panel, keep_live

    SESSION.reset()
    before = len(widget_module._instances)
    panels = []
    for i, report in enumerate(_published(WHOLE_REPORTS + 2)):
        report.cell_key = f"cell:{i}"
        panel = build_panel(report, timeline=b"")
        keep_live(report, panel)
        panels.append(panel)
    per_panel = (len(widget_module._instances) - before) / (WHOLE_REPORTS)
    assert per_panel > 20  # layouts, styles, tabs and their contents: every one of them a widget with a comm
    assert [n for n in SESSION.panels] == [r.number for r in list(SESSION.history)[-WHOLE_REPORTS:]]
    assert panels[0].comm is None and panels[1].comm is None and panels[2].comm is not None
    # a cell that shows a new panel closes its own older one
    again = SESSION.history[-1]
    newer = build_panel(again, timeline=b"")
    keep_live(again, newer)
    assert panels[-1].comm is None and newer.comm is not None and len(SESSION.panels) == WHOLE_REPORTS
    for panel in list(SESSION.panels.values()):
        close_panel(panel[1])
    assert len(widget_module._instances) == before  # every widget of every panel was closed
    SESSION.reset()

"""What a kernel remembers between cells lives in one object, and one call forgets it."""

import tfmem_magic
from tfmem_magic.core.session import SESSION


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

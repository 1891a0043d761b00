"""Fallbacks leave a trace: a measurement that degrades logs what it caught (logger `tfmem_magic.*`, DEBUG) and is
counted, and `%tfmem status` says how many this kernel took; `%tfmem status --log` lists them."""

import logging

import pytest

from tfmem_magic.core import fallbacks
from tfmem_magic.measure import holders
from tfmem_magic.show.status import fallbacks_line, fallbacks_text


@pytest.fixture(autouse=True)
def no_earlier_fallbacks():
    fallbacks.forget()
    yield
    fallbacks.forget()


class Unreadable:
    @property
    def variables(self):
        raise RuntimeError("a variable on a device that is gone")


def test_a_degraded_measurement_is_logged_counted_and_listed(caplog):
    assert fallbacks_line() == "Fallbacks    none in this kernel"
    with caplog.at_level(logging.DEBUG, logger="tfmem_magic"):
        assert holders.optimizer_variables(Unreadable()) == []  # the fallback: no variables counted
    [record] = [r for r in caplog.records if r.name == "tfmem_magic.measure.holders"]
    assert record.levelno == logging.DEBUG and record.exc_info is not None
    assert "an optimizer's variables could not be read" in record.getMessage()
    assert fallbacks.counts() == {"tfmem_magic.measure.holders": 1}
    line = fallbacks_line()
    assert line.startswith("Fallbacks    1 in this kernel (measure.holders 1)") and "%tfmem status --log" in line
    text = fallbacks_text()
    assert "measure.holders: an optimizer's variables could not be read" in text
    assert "RuntimeError: a variable on a device that is gone" in text


def test_only_the_last_ones_are_kept_but_all_are_counted():
    log = logging.getLogger("tfmem_magic.test")
    for k in range(fallbacks.KEPT + 7):
        fallbacks.fallback(log, f"step {k}", ValueError(k))
    kept = fallbacks.recent()
    assert len(kept) == fallbacks.KEPT and kept[-1].what == f"step {fallbacks.KEPT + 6}"
    assert fallbacks.counts() == {"tfmem_magic.test": fallbacks.KEPT + 7}
    assert fallbacks_text().startswith(f"The last {fallbacks.KEPT} fallbacks (of {fallbacks.KEPT + 7})")

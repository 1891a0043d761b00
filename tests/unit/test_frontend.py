"""The fix button with a front end that never answers (VS Code, Colab, a headless kernel): after a short wait the
button says how to get the cell (`%tfmem fix`) and can be pressed again; nothing hangs. The comm is the collaborator
here (a stand-in that records and never replies); the widget and the waiting are real."""

from __future__ import annotations

import sys
import time
import types

import pytest
from test_fixes import report  # noqa: I001  (tests/unit is on sys.path for its own helpers)

from tfmem_magic.core.report import Fix
from tfmem_magic.show import frontend


class SilentComm:
    """A comm whose front end drops it: no ack, no close."""

    opened: list[dict] = []
    channels: list[SilentComm] = []

    def __init__(self, target_name: str, data: dict) -> None:
        SilentComm.opened.append({"target": target_name, **data})
        SilentComm.channels.append(self)

    def on_msg(self, callback) -> None:
        self.msg = callback

    def on_close(self, callback) -> None:
        self.close_cb = callback

    def close(self) -> None:
        pass


def silence(monkeypatch) -> type[SilentComm]:
    """From now on the front end drops the comms it is sent (widgets made before keep their own comms)."""
    SilentComm.opened, SilentComm.channels = [], []
    monkeypatch.setitem(sys.modules, "comm", types.SimpleNamespace(create_comm=SilentComm))
    monkeypatch.setattr(frontend, "ANSWER_WAIT_S", 0.2)
    return SilentComm


@pytest.fixture
def silent_front_end(monkeypatch):
    return silence(monkeypatch)


def wait_for(condition, seconds: float = 5.0) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def test_no_answer_is_reported_once_after_the_wait(silent_front_end):
    replies = []
    assert frontend.insert_cell("x = 1", "cell-1", "below", lambda state, data: replies.append(state))
    assert silent_front_end.opened == [
        {"target": "tfmem_insert", "code": "x = 1", "cell_id": "cell-1", "placement": "below"}
    ]
    assert wait_for(lambda: replies == ["no-answer"])
    time.sleep(0.3)
    assert replies == ["no-answer"]  # once


def test_a_late_ack_still_says_inserted(silent_front_end):
    replies = []
    frontend.insert_cell("x = 1", None, "below", lambda state, data: replies.append(state), wait_s=0.05)
    assert wait_for(lambda: replies == ["no-answer"])
    # the extension answered after all (a slow browser): the user is told the cell is there
    silent_front_end.channels[-1].msg({"content": {"data": {"status": "inserted"}}})
    assert replies == ["no-answer", "inserted"]


def test_the_button_names_the_command_and_can_be_pressed_again(monkeypatch):
    pytest.importorskip("ipywidgets")
    from tfmem_magic.show.panel import fix_widget

    rep = report()
    box = fix_widget(rep, 1, Fix("shrink-batch", "Shrink the batch", "why", "model.fit(x, y, batch_size=64)"), None)
    button, status = box.children[1].children
    silence(monkeypatch)
    button.click()
    assert button.disabled and "Sent to the notebook" in status.value
    assert wait_for(lambda: not button.disabled)
    assert "did not answer" in status.value and f"%tfmem fix 1 --report {rep.number}" in status.value

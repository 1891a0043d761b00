"""Talking to the notebook front end: insert a fix cell through the JupyterLab extension's comm target.

Adapter code (needs ipykernel's comm). The extension registers the target `tfmem_insert` on every notebook kernel;
it inserts the code below the cell whose id is sent (or at the top of the notebook), selects it, never runs it, and
acknowledges. A front end without the extension closes the comm at once ("no target"); a headless kernel (nbclient,
a plain console) or a front end that drops unknown comms answers nothing, so after ANSWER_WAIT_S the button is told
"no-answer". The button tells the user which of the three happened.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from tfmem_magic.core.fallbacks import fallback
from tfmem_magic.core.types import IPythonShell

_log = logging.getLogger(__name__)

TARGET = "tfmem_insert"
ANSWER_WAIT_S = 8.0  # JupyterLab acknowledges within a second; a front end that drops the comm never does


def current_cell_id(shell: IPythonShell) -> str | None:
    """The id of the cell being executed, which JupyterLab sends in each execute request's metadata. Read it when
    the panel is displayed: a button click's message (comm_msg) carries no cell id."""
    kernel = getattr(shell, "kernel", None)
    if kernel is None:
        return None
    try:
        cell_id: str | None = kernel.get_parent("shell").get("metadata", {}).get("cellId")  # ipykernel: untyped
        return cell_id
    except Exception as exc:  # noqa: BLE001 - an older ipykernel
        fallback(_log, "the cell id could not be read from the kernel", exc)
        return None


def insert_cell(
    code: str,
    cell_id: str | None,
    placement: str,
    on_reply: Callable[[str, dict[str, Any]], None],
    wait_s: float | None = None,
) -> bool:
    """Ask the front end to insert `code`; `on_reply("inserted", data)` on the extension's ack (also when it comes
    late), `on_reply("no-extension", {})` when the front end refused the comm, `on_reply("no-answer", {})` when
    nothing came back within `wait_s` (ANSWER_WAIT_S). False when there is no comm at all."""
    try:
        import comm  # at call time: ipykernel installs its create_comm when the kernel starts
    except ImportError:
        return False
    answered = {"done": False}

    def reply(msg: dict[str, Any]) -> None:
        answered["done"] = True
        data = msg.get("content", {}).get("data", {}) or {}
        on_reply(str(data.get("status", "inserted")), data)
        channel.close()

    def closed(msg: dict[str, Any]) -> None:
        if not answered["done"]:  # closed by the front end with no ack: it has no such target
            answered["done"] = True
            on_reply("no-extension", {})

    def silent() -> None:
        if not answered["done"]:
            answered["done"] = True
            on_reply("no-answer", {})

    channel = comm.create_comm(target_name=TARGET, data={"code": code, "cell_id": cell_id, "placement": placement})
    channel.on_msg(reply)
    channel.on_close(closed)
    _later(ANSWER_WAIT_S if wait_s is None else wait_s, silent)
    return True


def _later(seconds: float, callback: Callable[[], None]) -> None:
    """Run `callback` after `seconds` on a daemon timer: it only updates the button's widgets (ipywidgets' comm
    messages may be sent from any thread), and it ends by itself. The kernel's event loop is not used: a loop that
    is set but not running (seen under pytest after other tests) would never call it."""
    timer = threading.Timer(seconds, callback)
    timer.daemon = True
    timer.start()

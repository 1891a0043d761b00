"""Stop means stop: every press of the kernel's stop button during a measured cell is remembered, and a press that
something inside the cell swallowed is raised again at the next point tfmem controls, so the cell ends failed and
"Run All" / nbconvert stop there.

Two places upstream lose a press (docs/interrupts.md has both reproductions and the measurements):
- Keras 3 converts every log value at each batch begin and end inside a bare `try: ... except: pass`
  (`keras/src/utils/python_utils.py`, `pythonify_logs`): a KeyboardInterrupt that lands there is dropped and `fit`
  goes on with the next batch.
- IPython's `showtraceback` catches a KeyboardInterrupt that lands while it formats the cell's traceback and prints
  only "KeyboardInterrupt" as text: the execute reply still says error, but no error output appears.

The latch chains a SIGINT handler in front of the kernel's (Python's `default_int_handler` while a cell runs): a
press raises the KeyboardInterrupt as before, and the latch keeps it. A press inside a watched Keras call whose call
then reaches another batch end, or returns normally, was swallowed inside Keras: the latch raises it again there.
Outside such calls, the exception's traceback tells who caught it (its first entry is the frame that did): a library
(or C code, before any Python frame saw it) swallowed it, and it is raised again at the next optimizer step of a
custom loop or at the cell's end; the user's own code (`except KeyboardInterrupt:` to stop training early and go on)
made a choice, which is left alone, with a note. A SIGINT handler the user installed is called instead of raising:
it decides what stop means.

No IPython here: the adapter asks `swallowed()` at the cell's end and wraps its traceback display in `absorbing()`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import site
import sysconfig
import threading
import time
from collections.abc import Iterator
from types import FrameType
from typing import Any

# how long presses are absorbed while the cell's traceback is shown: long enough for a deep Keras traceback on a
# busy machine (seconds), short enough that a formatter that hangs can still be stopped by pressing again
ABSORB_SECONDS = 30.0


class StopLatch:
    """The stop presses of one measured cell. Arm in the cell's (main) thread; every method is called there."""

    def __init__(self) -> None:
        self.absorbed = 0  # presses that landed while the cell's traceback was shown (the cell already failed)
        self.reraised: list[str] = []  # where a swallowed press was raised again
        self.caught: list[float] = []  # presses whose KeyboardInterrupt the cell's Python code caught and went on
        self._t0 = time.perf_counter()
        self._previous: Any = None
        self._armed = False
        self._pending: KeyboardInterrupt | None = None  # raised by a press, not yet seen ending anything
        self._pending_call: int | None = None  # the watched call that was running when it was raised
        self._pending_at = 0.0
        self._calls: list[int] = []  # watched calls running now, outermost first (serials)
        self._serial = 0
        self._absorb_until = 0.0

    # ---- arming ---------------------------------------------------------------------------------------------
    def arm(self) -> bool:
        """Chain our handler in front of the current one. False (nothing armed) off the main thread, or when SIGINT
        is ignored or left to the OS there: this process does not turn a press into a KeyboardInterrupt."""
        if threading.current_thread() is not threading.main_thread():
            return False
        previous = signal.getsignal(signal.SIGINT)
        if not callable(previous):
            return False
        self._previous = previous
        signal.signal(signal.SIGINT, self._on_press)
        self._armed = True
        return True

    def disarm(self) -> None:
        """Give the handler back. One the cell's code installed over ours stays: it is the user's now."""
        if not self._armed:
            return
        self._armed = False
        if signal.getsignal(signal.SIGINT) == self._on_press:
            signal.signal(signal.SIGINT, self._previous)

    @property
    def armed(self) -> bool:
        return self._armed

    # ---- the press --------------------------------------------------------------------------------------------
    def _on_press(self, signum: int, frame: FrameType | None) -> None:
        now = time.perf_counter()
        if now < self._absorb_until:
            self.absorbed += 1  # the cell already failed and its traceback is being shown: let it finish
            return
        if self._previous is not signal.default_int_handler:
            self._previous(signum, frame)  # the user's own handler decides what a press means
            return
        exc = KeyboardInterrupt()
        self._pending, self._pending_at = exc, now
        self._pending_call = self._calls[-1] if self._calls else None
        raise exc

    # ---- what the instruments tell it -------------------------------------------------------------------------
    def enter_call(self) -> int:
        """A watched Keras call (fit/evaluate/predict...) starts; returns its token for exit_call()."""
        self._serial += 1
        self._calls.append(self._serial)
        return self._serial

    def exit_call(self, token: int) -> None:
        if token in self._calls:
            del self._calls[self._calls.index(token) :]

    def seen(self, exc: BaseException | None) -> None:
        """`exc` left a watched call or the cell: a KeyboardInterrupt did its work, nothing is pending any more."""
        if isinstance(exc, KeyboardInterrupt):
            self._pending = None

    def check(self, where: str) -> None:
        """At a point tfmem controls (a batch end, a watched call's normal return, an optimizer step of a custom
        loop): raise again a press the cell's code swallowed."""
        if self._pending is None:
            return
        if self._pending_call is not None and self._pending_call in self._calls:
            # the press landed inside this very call, and the call went on: Keras (or numpy under it) dropped it
            raise self._make_again(where, "inside the running call")
        elif not _caught_in_user_code(self._pending):
            raise self._make_again(where, "by library code")
        elif self._pending_call is None:
            self._note_caught()

    def swallowed(self) -> KeyboardInterrupt | None:
        """At the cell's end, when it ended without an error: the KeyboardInterrupt to end it with, if a press was
        swallowed before Python code could see it (None when Python code caught it: the user's choice)."""
        if self._pending is None:
            return None
        if self._pending_call is not None or not _caught_in_user_code(self._pending):
            return self._make_again("at the end of the cell", "")
        self._note_caught()
        return None

    @contextlib.contextmanager
    def absorbing(self, seconds: float = ABSORB_SECONDS) -> Iterator[None]:
        """While the cell's traceback is shown (the cell already failed): presses are counted, not raised, so that
        a second press cannot cut IPython's display short (it would print a bare "KeyboardInterrupt" instead)."""
        self._absorb_until = time.perf_counter() + seconds
        try:
            yield
        finally:
            self._absorb_until = 0.0

    def notes(self) -> list[str]:
        """What the report says about the presses, if anything happened beyond a plain interrupt."""
        out = []
        for where in self.reraised:
            out.append(
                f"Stop was pressed and the KeyboardInterrupt was swallowed by the code it landed in; tfmem "
                f"raised it again {where}, so the cell ends failed (docs/interrupts.md says where Keras and "
                "IPython lose a press)."
            )
        for at in self.caught:
            out.append(
                f"Stop was pressed at {at - self._t0:.1f} s and your code caught the KeyboardInterrupt and "
                "went on: tfmem did not stop the cell again."
            )
        if self.absorbed:
            out.append(
                f"{self.absorbed} more press(es) of stop arrived while the cell's traceback was shown; the "
                "cell had already stopped."
            )
        return out

    def _note_caught(self) -> None:
        self.caught.append(self._pending_at)
        self._pending = None

    def _make_again(self, where: str, how: str) -> KeyboardInterrupt:
        pressed = self._pending_at - self._t0
        self._pending = None
        self.reraised.append(where)
        detail = f" ({how})" if how else ""
        return KeyboardInterrupt(
            f"stop pressed at {pressed:.1f} s was swallowed{detail}; tfmem stopped the cell {where}"
        )


def _caught_in_user_code(exc: BaseException) -> bool:
    """Whether the user's own code caught the KeyboardInterrupt our handler raised. Each frame it unwinds through
    adds a traceback entry in front, so the first entry is the frame that caught it: the notebook's code (a cell, a
    function defined in it, the user's own module) or a library (Keras' bare `except:`, numpy's coercion under a
    library frame), or our handler's own frame when C code dropped it before any Python frame saw it."""
    tb = exc.__traceback__
    return tb is not None and not _library_file(tb.tb_frame.f_code.co_filename)


def _library_file(filename: str) -> bool:
    if filename.startswith("<frozen"):
        return True
    path = os.path.realpath(filename) if not filename.startswith("<") else filename
    return path.startswith(_library_dirs())


@functools.lru_cache(maxsize=1)
def _library_dirs() -> tuple[str, ...]:
    """The installed code's folders (the standard library, site-packages) and tfmem's own."""
    paths = sysconfig.get_paths()
    dirs = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if paths.get(k)}
    dirs.update(site.getsitepackages() + [site.getusersitepackages()])
    dirs.add(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tfmem_magic/
    return tuple(os.path.join(os.path.realpath(d), "") for d in dirs)

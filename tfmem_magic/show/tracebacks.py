"""Tracebacks that IPython's formatter can show."""

from __future__ import annotations

import types

from tfmem_magic.core.errors import exception_chain


def numbered_traceback(tb: types.TracebackType | None) -> types.TracebackType | None:
    """`tb`, with a line number on every entry. A Ctrl-C that lands on an instruction without a line (Python 3.11+)
    leaves `tb_lineno` None, and IPython's traceback formatter then fails on an assert: the user would see
    IPython's internal error instead of their KeyboardInterrupt, and the kernel would not report the cell failed."""
    entries = []
    while tb is not None:
        entries.append(tb)
        tb = tb.tb_next
    if all(isinstance(entry.tb_lineno, int) for entry in entries):
        return entries[0] if entries else None
    rebuilt = None
    for entry in reversed(entries):
        line = entry.tb_lineno
        if not isinstance(line, int):  # the frame's current line, else the function's first line
            line = (
                entry.tb_frame.f_lineno
                if isinstance(entry.tb_frame.f_lineno, int)
                else entry.tb_frame.f_code.co_firstlineno
            )
        rebuilt = types.TracebackType(rebuilt, entry.tb_frame, entry.tb_lasti, line)
    return rebuilt


def number_chained(exc: BaseException | None) -> None:
    """Give the tracebacks of the exceptions chained to `exc` (its cause and context, theirs, ...) a line number on
    every entry, in place: IPython formats them too, and one entry without a line (an exception that landed on an
    instruction without one, as the guard's watchdog's can while TensorFlow raises its own) fails its formatter."""
    for chained in exception_chain(exc):
        if chained is exc:  # its own traceback is the caller's to repair (it may be shown with another)
            continue
        shown = numbered_traceback(chained.__traceback__)
        if shown is not chained.__traceback__:
            chained.__traceback__ = shown

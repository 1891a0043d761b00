"""Tracebacks that IPython's formatter can show."""

from __future__ import annotations

import types


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

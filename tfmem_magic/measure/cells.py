"""Notebook cells as the measurements see them: the key that ties the re-runs of one cell together (leak
detection across runs), and which cells watch mode measures, under what label. No IPython: the adapter passes the
cell's source and the id the front end sent."""

from __future__ import annotations

import hashlib

from tfmem_magic.core.session import SESSION


def cell_key(source: str, cell_id: str | None = None) -> str:
    """The same cell across re-runs: Jupyter's cell id when the front end sent one, else the source's hash."""
    return f"cell:{cell_id}" if cell_id else "source:" + hashlib.sha1(source.encode()).hexdigest()[:16]


def watched(source: str) -> bool:
    """Whether watch mode measures this cell: not a %%tfmem cell (it reports itself), not the cell that turns watch
    mode on or off, and not a cell run inside a measurement (the magic's own run of its body)."""
    code = source.lstrip()
    return not (code.startswith("%%tfmem") or code.startswith("%tfmem watch") or SESSION.measuring)


def cell_label(source: str) -> str:
    """A watched cell's label: its first line that is not blank, cut to 40 characters."""
    return next((line.strip() for line in source.splitlines() if line.strip()), "")[:40]

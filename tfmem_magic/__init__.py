"""tfmem_magic: where a TensorFlow notebook's memory goes, cell by cell.

In Jupyter: `%load_ext tfmem_magic`, then `%%tfmem` on a cell. In a script:

    import tfmem_magic
    tfmem_magic.prepare()            # before the first TF op: every allocation becomes visible
    with tfmem_magic.profile() as p:
        model.fit(x, y)
    print(tfmem_magic.render_text(p.report))
    tfmem_magic.predict(p.report, batch_size=256).peak_bytes   # what-if, without running it
    tfmem_magic.to_tensorboard(p.report, "logs", p.xspaces)    # with profile(keep_xspaces=True): the trace too
    tfmem_magic.analyze_xplane("host.xplane.pb")               # a trace recorded elsewhere (a GPU machine)

Importing this package imports neither IPython nor TensorFlow.
"""

from __future__ import annotations

from typing import Any

from tfmem_magic._version import __version__
from tfmem_magic.advise.prediction import WhatIf, predict
from tfmem_magic.core.errors import (MemoryGrowthWarning, MemoryLimitExceeded, PreflightRefused, TfmemError,
                                    TfmemUsageError)
from tfmem_magic.core.report import MIME_TYPE, SCHEMA, Report
from tfmem_magic.core.sizes import format_bytes, parse_size
from tfmem_magic.measure.environment import AllocatorSetup
from tfmem_magic.measure.environment import prepare_allocator as prepare
from tfmem_magic.measure.remote import serve
from tfmem_magic.measure.release import free
from tfmem_magic.pipeline import Options, Profiler, analyze_xplane, capture, last_report, profile
from tfmem_magic.show.render import mime_bundle, render_html, render_text
from tfmem_magic.show.tensorboard import write as to_tensorboard

__all__ = [
    "__version__", "AllocatorSetup", "MIME_TYPE", "MemoryGrowthWarning", "MemoryLimitExceeded", "Options",
    "PreflightRefused", "Profiler", "Report", "SCHEMA", "analyze_xplane", "capture", "serve",
    "TfmemError", "TfmemUsageError", "format_bytes", "free", "last_report", "load_ipython_extension", "mime_bundle",
    "parse_size", "WhatIf", "predict", "prepare", "profile", "render_html", "render_text", "to_tensorboard",
    "unload_ipython_extension",
]


def _jupyter_labextension_paths() -> list[dict[str, str]]:
    """Where JupyterLab finds the prebuilt extension (fix-cell insertion, report renderer)."""
    return [{"src": "labextension", "dest": "tfmem_magic"}]


def load_ipython_extension(ipython: Any) -> None:
    """`%load_ext tfmem_magic`: register the magics and switch TF's CPU allocator to BFC while still possible."""
    from tfmem_magic.adapters.magics import load

    load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    """Nothing stays installed between cells, so there is nothing to undo beyond what IPython does itself."""

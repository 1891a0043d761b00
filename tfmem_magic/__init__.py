"""tfmem_magic: where a TensorFlow notebook's memory goes, cell by cell.

In Jupyter: `%load_ext tfmem_magic`, then `%%tfmem` on a cell. In a script:

    import tfmem_magic
    tfmem_magic.prepare()            # before the first TF op: every allocation becomes visible
    with tfmem_magic.profile() as p:
        model.fit(x, y)
    print(tfmem_magic.render_text(p.report))
    tfmem_magic.predict(p.report, batch_size=256).peak_bytes   # what-if, without running it
    tfmem_magic.largest_batch(p.report, budget="16GB")          # the largest batch predicted to fit
    tfmem_magic.to_tensorboard(p.report, "logs", p.xspaces)    # with profile(keep_xspaces=True): the trace too
    tfmem_magic.analyze_xplane("host.xplane.pb")               # a trace recorded elsewhere (a GPU machine)

Importing this package imports neither IPython nor TensorFlow.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tfmem_magic._version import __version__
from tfmem_magic.advise.gpu_target import GpuTarget
from tfmem_magic.advise.prediction import WhatIf, WhatIfKnobs
from tfmem_magic.core.errors import (
    MemoryGrowthWarning,
    MemoryLimitExceeded,
    PreflightRefused,
    TfmemError,
    TfmemUsageError,
)
from tfmem_magic.core.report import MIME_TYPE, SCHEMA, Report
from tfmem_magic.core.sizes import format_bytes, parse_size
from tfmem_magic.core.types import IPythonShell
from tfmem_magic.measure.environment import AllocatorSetup
from tfmem_magic.measure.environment import prepare_allocator as prepare
from tfmem_magic.measure.release import free
from tfmem_magic.measure.remote import serve
from tfmem_magic.pipeline import Options, Profiler, analyze_xplane, capture, last_report, profile
from tfmem_magic.show.render import mime_bundle, render_html, render_text
from tfmem_magic.show.tensorboard import write as to_tensorboard

if TYPE_CHECKING:  # typing.Unpack is Python 3.11's; annotations are not evaluated at run time
    from typing import Unpack

__all__ = [
    "__version__",
    "AllocatorSetup",
    "GpuTarget",
    "MIME_TYPE",
    "MemoryGrowthWarning",
    "MemoryLimitExceeded",
    "Options",
    "PreflightRefused",
    "Profiler",
    "Report",
    "SCHEMA",
    "analyze_xplane",
    "capture",
    "serve",
    "TfmemError",
    "TfmemUsageError",
    "format_bytes",
    "free",
    "last_report",
    "load_ipython_extension",
    "mime_bundle",
    "parse_size",
    "WhatIf",
    "largest_batch",
    "predict",
    "prepare",
    "profile",
    "render_html",
    "render_text",
    "to_tensorboard",
    "unload_ipython_extension",
]


def largest_batch(
    report: Report,
    budget: int | str | None = None,
    calibrate: bool = False,
    gpu: int | str | GpuTarget | None = None,
    **knobs: Unpack[WhatIfKnobs],
) -> int | None:
    """The largest batch (as people type it: 152, not 159) whose predicted peak, upper end of its error band
    included, fits `budget`: the memory the cell may use in all, in bytes or as "16GB" / "1.5GiB" (the process's on
    a CPU, less what the cell grew by besides TensorFlow's allocator, a peak above the cell's judged with +40%; the
    GPU's memory for TensorFlow, as its allocator's limit says, on a GPU). By default the report's own
    budget (available RAM, the container's limit or your --limit). Other knobs as `predict` takes them (precision,
    optimizer, accumulation_steps...); `calibrate=True` measures the slope first. None when not even the smallest
    batch fits. `predict(report, batch_size=n)` gives the prediction at that batch, with its band (the margin).
    `gpu="16GB"` (or a GpuTarget): for that GPU, from a report measured on a CPU (see `predict`)."""
    from tfmem_magic.advise.prediction import largest_fitting_batch

    if calibrate:
        _calibrate(report)
    if gpu is not None:
        if budget is not None:
            raise TfmemUsageError("largest_batch: give budget= or gpu=, not both (a GPU's budget is its memory)")
        return predict(report, gpu=gpu, **knobs).largest_batch
    total = parse_size(budget) if isinstance(budget, str) else budget
    return largest_fitting_batch(report, total, **knobs)


def predict(
    report: Report,
    batch_size: int | None = None,
    policy: str | None = None,
    optimizer: str | None = None,
    accumulation_steps: int = 1,
    input_scale: float = 1.0,
    calibrate: bool = False,
    replicas: int | None = None,
    gpu: int | str | GpuTarget | None = None,
) -> WhatIf:
    """The TF peak over the cell's baseline had the cell run with these knobs, without running it: `peak_bytes`, its
    `basis`, `error_band` (the band's low side: `below`), `split` by part, whether it `fits` the report's budget and
    the `largest_batch` that does. `batch_size` is the batch the model learns from (the global one with
    `replicas=n`, a data-parallel strategy: the answer is one replica's); `accumulation_steps=k` runs batch_size / k
    samples per step; `input_scale=2` twice the input elements per sample. `calibrate=True` first trains a clone of
    the model at three batch sizes in a fresh process (seconds, once per report: the measured basis is saved with
    it). `gpu="16GB"` (the card's memory, or a `GpuTarget` with its compute capability and cuDNN's workspace cap):
    the step on that GPU, modelled from a report measured on a CPU; `fits` is None where only the GPU's autotuner
    could tell (docs/gpu.md, "From a CPU run to a GPU")."""
    from tfmem_magic.advise import prediction

    if calibrate:
        _calibrate(report)
    knobs: WhatIfKnobs = {
        "batch_size": batch_size,
        "policy": policy,
        "optimizer": optimizer,
        "accumulation_steps": accumulation_steps,
        "input_scale": input_scale,
        "replicas": replicas,
    }
    if gpu is not None:
        from tfmem_magic.advise.gpu_target import predict_on_gpu

        return predict_on_gpu(report, gpu, **knobs)
    return prediction.predict(report, **knobs)


def _calibrate(report: Report) -> None:
    from tfmem_magic.advise.calibration import calibrate_asked  # probes in a fresh process; imported when asked

    calibrate_asked(report)


def _jupyter_labextension_paths() -> list[dict[str, str]]:
    """Where JupyterLab finds the prebuilt extension (fix-cell insertion, report renderer)."""
    return [{"src": "labextension", "dest": "tfmem_magic"}]


def load_ipython_extension(ipython: IPythonShell) -> None:
    """`%load_ext tfmem_magic`: register the magics and switch TF's CPU allocator to BFC while still possible."""
    from tfmem_magic.adapters.magics import load

    load(ipython)


def unload_ipython_extension(ipython: IPythonShell) -> None:
    """Between cells only the note of each Keras layer's creation line stays installed (measure/code_sites.py): it
    stops; IPython itself does the rest."""
    from tfmem_magic.measure import code_sites

    code_sites.release(code_sites.EXTENSION)

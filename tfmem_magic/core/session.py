"""What a kernel remembers between cells, in one object: `SESSION`.

Everything else tfmem holds lives only as long as one cell's measurement. Tests start from a clean slate with
`SESSION.reset()`. The layers that fill a field own its meaning; this module only holds it (the core imports
nothing of the layers above it, so the fields they own are typed `Any`, with the class each holds named beside it).
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, Literal, TypeAlias

from tfmem_magic.core.report import Report
from tfmem_magic.core.types import KerasModel

HISTORY_SIZE = 100  # reports kept for %tfmem history / compare
# %tfmem calibrate's modes (CALIBRATE_MODES below says what each calibrates)
CalibrateMode: TypeAlias = Literal["auto", "on", "off"]
MAX_CELLS, RUNS_PER_CELL = 500, 20  # the leak rule's memory: cells, and runs per cell


class Session:
    def __init__(self) -> None:
        # how tfmem set up TensorFlow's allocator (measure.environment.AllocatorSetup): environment variables that
        # TensorFlow reads once, so a reset keeps it
        self.allocator_setup: Any = None
        self.reset()

    def reset(self) -> None:
        """Forget every cell: history, numbering, leak runs, remembered models, the session limit, watch mode.
        (Environment variables tfmem set before TensorFlow started stay: TensorFlow has read them.)"""
        self.history: deque[Report] = deque(maxlen=HISTORY_SIZE)  # published Reports, oldest first
        self.last: Report | None = None  # the last published Report
        self.published = 0  # reports published so far: each gets the next number
        self.runs: dict[str, deque[Any]] = {}  # cell key -> what each run left behind (diagnose.RunSummary)
        # report id -> (report ref, model ref, what a batch held, what its fixes were written from): the models
        # calibration may clone, and the context it writes the report's fixes again with (advise.calibration)
        self.models: dict[int, tuple[weakref.ref[Report], weakref.ref[KerasModel], dict[str, Any] | None, Any]] = {}
        self.seen_models: weakref.WeakSet[KerasModel] = weakref.WeakSet()  # every Keras model a profiled cell has used
        self.limit: Any = None  # the %tfmem limit (measure.guard.SessionLimit)
        # %tfmem calibrate on|off|auto: which profiled blocks calibrate their what-if as they end (pipeline.py);
        # "auto": those whose report names the largest batch that fits, which then stands on the step replay
        self.calibrate: CalibrateMode = "auto"
        self.onednn_off_by_us = False  # TF_ENABLE_ONEDNN_OPTS=0 was set by %tfmem limit, not by the user
        self.watcher: Any = None  # watch mode's hooks (adapters.magics.Watcher), while on
        self.measuring: list[Any] = []  # the measurements running now, outermost first (sampling.AllocatorStats)
        # finish() of measurements a Keras callback started and whose call raised before it could finish them (an
        # OOM in a traced step): the next measurement finishes them first, so no profiler session, sampler thread
        # or nesting slot of theirs outlives the error
        self.abandoned: list[Callable[[], object]] = []
        # a refused call's step replay per model and inputs (advise.preflight.KeptReplay): the next call at a batch it
        # covers is judged from it, without new probes
        self.preflight_replays: dict[Any, Any] = {}
        # device -> the highest TF allocator peak seen in this kernel (each cell resets TF's counter): the regions
        # BFC holds still, which a step fills before the process grows (the pre-flight's `tf_held`)
        self.tf_peak_most: dict[str, int] = {}
        # id(layer) -> (weakref to the Keras layer, file, line): the line of the user's code that made each layer
        # while tfmem was loaded (measure.code_sites), for the report's by-line view
        self.layer_sites: dict[int, tuple[weakref.ref[Any], str, int]] = {}
        # a `%%tfmem` body's file -> (the number of the cell it is in, lines above it): IPython compiles the body the
        # magic runs as a cell of the next number, one line short of the cell the notebook shows (analyze.lines)
        self.cell_bodies: dict[str, tuple[int, int]] = {}

    def publish(self, report: Report) -> None:
        self.last = report
        self.history.append(report)

    def next_number(self) -> int:
        self.published += 1
        return self.published

    def runs_of(self, key: str) -> list[Any]:
        """The remembered runs of the cell `key`, oldest first."""
        return list(self.runs.get(key, ()))

    def add_run(self, key: str, summary: object) -> None:
        if key not in self.runs and len(self.runs) >= MAX_CELLS:
            self.runs.pop(next(iter(self.runs)))
        self.runs.setdefault(key, deque(maxlen=RUNS_PER_CELL)).append(summary)


# %tfmem calibrate's modes, and which profiled blocks each calibrates as they end (pipeline.Profiler._calibrate)
CALIBRATE_MODES: dict[CalibrateMode, str] = {
    "auto": "a cell whose report names the largest batch that fits",
    "on": "every cell that runs a Keras model",
    "off": "none, until --calibrate or the Calibrate button",
}

SESSION = Session()

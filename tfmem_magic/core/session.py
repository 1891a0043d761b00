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

from tfmem_magic.core.report import Report, compacted, footprint
from tfmem_magic.core.types import KerasModel

# The history's caps (docs/session.md): at most HISTORY_SIZE reports for %tfmem history / compare, and at most
# HISTORY_BYTES of the kernel's memory (each report's footprint, measured as it enters and as it is compacted): the
# oldest go first. The newest WHOLE_REPORTS keep their time series and their live panels; older ones are kept
# compacted (report.compacted), and their panels are closed (show.panel.keep_live: ipywidgets keeps every widget and
# its comm until it is closed), as is a cell's panel once the cell shows a new one
HISTORY_SIZE = 100
HISTORY_BYTES = 8 * 2**20
WHOLE_REPORTS = 10
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
        self.history: deque[Report] = deque()  # published Reports, oldest first (the caps above: publish)
        self.history_bytes: deque[int] = deque()  # each one's footprint, in the same order
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
        # report number -> (its cell key, its live panel: an ipywidgets VBox), oldest first (show.panel.keep_live)
        self.panels: dict[int, tuple[str | None, Any]] = {}
        # the MIME bundles of the newest static reports displayed, oldest first: IPython keeps every displayed
        # bundle, so older ones are slimmed to their text (adapters.magics._slim_older)
        self.shown: deque[dict[str, Any]] = deque()
        # a `%%tfmem` body's file -> (the number of the cell it is in, lines above it): IPython compiles the body the
        # magic runs as a cell of the next number, one line short of the cell the notebook shows (analyze.lines)
        self.cell_bodies: dict[str, tuple[int, int]] = {}

    def publish(self, report: Report) -> None:
        """`report` becomes the last and joins the history; the report that is now older than the newest
        WHOLE_REPORTS is compacted, and the oldest leave while the history is over either cap."""
        self.last = report
        self.history.append(report)
        self.history_bytes.append(footprint(report))
        older = len(self.history) - WHOLE_REPORTS - 1
        if older >= 0:
            self._compact(older)
        while len(self.history) > 1 and (len(self.history) > HISTORY_SIZE or sum(self.history_bytes) > HISTORY_BYTES):
            self.history.popleft()
            self.history_bytes.popleft()

    def _compact(self, index: int) -> None:
        whole = self.history[index]
        small = compacted(whole)
        self.history[index] = small
        self.history_bytes[index] = footprint(small)
        entry = self.models.get(id(whole))
        if entry is not None and entry[0]() is whole:  # the compacted copy calibrates as the whole one did
            self.models[id(small)] = (weakref.ref(small), *entry[1:])

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

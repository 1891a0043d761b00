"""The line of the user's code that ran each eager op while the trace records (trace mode only).

An eager op's allocation carries its op type alone in the trace: no node path, no stack. So while a traced cell
runs, a TensorFlow op callback (`op_callbacks.add_op_callback`, what tfdbg2 uses) notes each eager op the cell's
thread runs while a trace segment records, with an output of MIN_NOTED_BYTES or more: its type, its outputs'
shapes and dtypes, the time, and the user's frame that ran it. analyze/lines.py `match_eager` then pairs the trace's
eager allocations with these records by op type, bytes and order (docs/lines.md, "Eager ops").

The user's frame is the innermost frame outside TensorFlow, Keras, tf_keras, tfmem, the standard library and
site-packages (code_sites.is_user_file), found by walking `sys._getframe()` outwards, each code object classified
once: no stack is formatted. A Keras `fit`/`evaluate`/`predict` frame passed on the way marks the op as Keras' own
(as the by-line view marks a graph op whose only user frame calls them).

TensorFlow keeps op callbacks per thread: the callback is added on the thread that arms the measurement (the
cell's) and removed from it when the measurement unwinds, on any exit. It never raises into the user's code: a
failure is a fallback, and the records stop.
"""

from __future__ import annotations

import logging
import sys
import time
from types import CodeType, FrameType
from typing import NamedTuple

from tfmem_magic.core.fallbacks import fallback
from tfmem_magic.core.types import TFGraph, TFTensor
from tfmem_magic.measure import code_sites
from tfmem_magic.measure.tracer import Tracer

_log = logging.getLogger(__name__)

MAX_OPS = 200_000  # eager ops recorded per cell (~150 bytes each); past it, the rest of the trace is not matched
MAX_CODES = 10_000  # code objects classified per cell
# an op whose outputs are all smaller is not noted: the frame walk is most of the callback's cost, and the by-line
# view is for what holds memory (docs/lines.md, "Cost": the eager loop's overhead with and without it)
MIN_NOTED_BYTES = 256 << 10
_LIBRARY, _USER, _ENTRY = 0, 1, 2
# TensorFlow's DataType enum -> bytes per element, for the types whose tensors' bytes follow from their shapes
DTYPE_BYTES = {1: 4, 2: 8, 3: 4, 4: 1, 5: 2, 6: 1, 8: 8, 9: 8, 10: 1, 14: 2, 17: 2, 18: 16, 19: 2, 22: 4, 23: 8}


class EagerOp(NamedTuple):
    """One eager op the cell's thread ran while a trace segment recorded."""

    segment: int  # the trace segment's index (Tracer.windows)
    op: str  # the op type
    file: str | None  # the user's frame that ran it (None: no frame of the user's on the stack)
    line: int
    keras: bool  # a frame of Keras' fit/evaluate/predict between the op and the user's frame
    t: float  # perf_counter after it ran
    outputs: tuple[tuple[tuple[int, ...] | None, int], ...]  # (shape, DataType enum) of each output


def output_bytes(shape: tuple[int, ...] | None, dtype: int) -> int | None:
    """What an output's buffer asks the allocator for; None where its shape or type does not say (strings,
    resources, variants, an unknown shape)."""
    size = DTYPE_BYTES.get(dtype)
    if size is None or shape is None:
        return None
    for dim in shape:
        if dim is None or dim < 0:
            return None
        size *= dim
    return size


class EagerOps:
    """The op callback of one traced cell, recording while one of `tracer`'s segments records."""

    def __init__(self, tracer: Tracer) -> None:
        self._tracer = tracer
        self.t0 = tracer._t0  # the perf_counter time the trace's clock starts at
        self.ops: list[EagerOp] = []
        self.full_from: int | None = None  # the segment in which MAX_OPS was reached: not matched from there on
        self.failed: str | None = None  # why the records stopped (a fallback), if they did
        self._kinds: dict[CodeType, int] = {}
        self._added = False
        self._off = False
        self._callbacks: list[object] = []

    # ---- arming -----------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Add the callback on this thread (the cell's)."""
        from tensorflow.python.eager import context
        from tensorflow.python.framework import op_callbacks

        op_callbacks.add_op_callback(self._callback)
        self._added = True
        self._callbacks = context.context().op_callbacks  # this thread's list, changed in place by TensorFlow

    def stop(self) -> None:
        """Remove the callback (the measurement's undo step, on the thread that added it). Safe to run again after
        an interrupt cut it short."""
        self._off = True  # notes nothing from now on, wherever it is still registered
        if not self._added:
            return
        from tensorflow.python.framework import op_callbacks

        try:
            op_callbacks.remove_op_callback(self._callback)
        except KeyError:  # removed already: a run of this step that an interrupt cut short after the removal
            pass
        self._added = False
        self._kinds.clear()

    # ---- the callback -------------------------------------------------------------------------------------------
    def _callback(
        self,
        op_type: str | bytes,
        inputs: tuple[TFTensor, ...],
        attrs: tuple[object, ...],
        outputs: tuple[TFTensor, ...] | None,
        op_name: str | None = None,
        graph: TFGraph | None = None,
    ) -> list[TFTensor] | None:
        """Called by TensorFlow after each eager op and for each op a graph is built with: notes an eager op while
        a segment records. The op's outputs stand: None, or in a graph, where another callback came before this
        one, the outputs as that one left them (TensorFlow hands each callback what the one before returned, and
        None would undo theirs)."""
        try:
            if graph is not None:  # an op added to a graph (a tf.function being traced): its stack is in the graph
                return None if len(self._callbacks) < 2 or outputs is None else list(outputs)
            if self._off:
                return None
            segment = self._tracer.recording
            if segment < 0:
                return None  # the trace is paused
            # TensorFlow's generated op wrappers name the op in bytes on their slow path (`execute(b"MatMul", ...)`)
            name = op_type.decode() if isinstance(op_type, bytes) else str(op_type)
            if not name.startswith("__"):  # a tf.function ran: its ops are named from its graph
                self._note(segment, name, outputs)
        except Exception as exc:  # noqa: BLE001 - never the user's failed op: the records stop, the trace stands
            self.failed, self._off = f"{type(exc).__name__}: {exc}", True
            fallback(_log, "an eager op's line could not be noted: eager ops are not named from here on", exc)
        return None

    def _note(self, segment: int, op_type: str, outputs: tuple[TFTensor, ...] | None) -> None:
        if len(self.ops) >= MAX_OPS:
            if self.full_from is None:
                self.full_from = segment
            return
        shapes = tuple((o._shape_tuple(), o._datatype_enum()) for o in outputs) if outputs else ()
        if all((output_bytes(shape, dtype) or 0) < MIN_NOTED_BYTES for shape, dtype in shapes):
            return
        t = time.perf_counter()
        kinds = self._kinds
        frame: FrameType | None = sys._getframe(2)  # the frame that ran the op (most often an op wrapper)
        keras = False
        while frame is not None:
            code = frame.f_code
            kind = kinds.get(code)
            if kind is None:
                kind = self._classify(code)
            if kind == _USER:
                break
            if kind == _ENTRY:
                keras = True
            frame = frame.f_back
        if frame is None:
            self.ops.append(EagerOp(segment, op_type, None, 0, keras, t, shapes))
        else:
            self.ops.append(EagerOp(segment, op_type, frame.f_code.co_filename, frame.f_lineno, keras, t, shapes))

    def _classify(self, code: CodeType) -> int:
        file = code.co_filename
        if code_sites.is_user_file(file):
            kind = _USER
        elif code_sites.is_keras_entry(file, code.co_name):
            kind = _ENTRY
        else:
            kind = _LIBRARY
        if len(self._kinds) < MAX_CODES:
            self._kinds[code] = kind
        return kind

"""From memory events to what a person wants to know: the timeline, the peak, and what was live at the peak.

Attribution of one allocation, in order of trust:
1. its `tf_op` node path (graph code: `fit`, `tf.function`): the deepest path part that is a known layer name
   (minus Keras' `_<n>` scope suffix) gives the layer; `gradient_tape` → backward, an optimizer scope → optimizer;
2. our own trace spans on the same thread (eager code records only the op type): `layer/<name>` →
   forward of that layer, `weights/<name>` → weight creation, `phase/<phase>` → backward or optimizer;
3. what is known of the op type: iterator and tf.data ops → input; an untagged allocation whose size equals an
   array handed to `fit` → the input copy.
Everything live before the trace began is "pre-existing" (weights and slots of earlier cells, earlier tensors).
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

from .report import LiveGroup, TraceInfo
from .xplane import DATA_TYPES, MemoryEvents, Span, Trace

PS = 1e12
MAX_TIMELINE_POINTS = 2000
TOP_GROUPS = 25

PHASES = ("forward", "backward", "optimizer", "input", "weights", "pre-existing", "other")
_SUFFIX = re.compile(r"_\d+$")
_INPUT_OPS = {"MakeIterator", "IteratorGetNext", "OptionalHasValue", "OptionalGetValue", "optional",
              "IteratorV2", "AnonymousIteratorV3", "GatherV2", "GatherV2_1", "TensorSliceDataset"}
_OPTIMIZER_SCOPES = {"adam", "adamw", "sgd", "rmsprop", "adagrad", "adadelta", "adamax", "nadam", "ftrl", "lion",
                     "lamb", "loss_scale_optimizer", "optimizer"}
_RUNTIME_SCOPES = {"StatefulPartitionedCall", "PartitionedCall", "while", "cond", "body"}


@dataclass
class Context:
    """What the instrumentation learnt during the cell, used to name things in the trace."""

    layer_names: set[str] = field(default_factory=set)
    optimizer_scopes: set[str] = field(default_factory=lambda: set(_OPTIMIZER_SCOPES))
    input_array_bytes: set[int] = field(default_factory=set)  # nbytes of numpy arrays handed to fit/predict/...
    start_offset_s: float = 0.0


@dataclass
class Attribution:
    op: str
    layer: str | None
    phase: str


def attribute_path(path: str, ctx: Context) -> Attribution:
    """Op type, layer and phase of a `tf_op` value (a node path such as `.../cnn_1/conv_a_1/Relu`)."""
    parts = path.split("/")
    op = _SUFFIX.sub("", parts[-1]) or parts[-1]
    if path.startswith("__inference_"):
        if "initialize_variables" in path:
            return Attribution("initialize variables", None, "weights")
        return Attribution("function runtime", None, "other")
    scopes = [_SUFFIX.sub("", p) for p in parts[:-1]]
    layer = next((s for s in reversed(scopes) if s in ctx.layer_names), None)
    if layer is None and ctx.layer_names == set() and len(scopes) >= 2 and scopes[-1] not in _RUNTIME_SCOPES:
        layer = scopes[-1]  # nothing known about the model: the enclosing scope is the best guess of a layer
    if "gradient_tape" in scopes or any(p.startswith("gradients") for p in parts[:-1]):
        phase = "backward"
    elif any(s.lower() in ctx.optimizer_scopes for s in scopes):
        phase, layer = "optimizer", None
    elif op in _INPUT_OPS or parts[-1] in _INPUT_OPS:
        phase = "input"
    elif layer is not None or "compile_loss" in scopes:
        phase = "forward"
    else:
        phase = "other"
    return Attribution(op, layer, phase)


# ---- matching allocations and frees -----------------------------------------------------------------------------

def match_frees(ev: MemoryEvents) -> tuple[np.ndarray, np.ndarray]:
    """For each event: index of the free that ends it (allocs; n if never freed in the trace), and whether a free
    ends an allocation made before the trace (pre-existing).

    Sorting by (address, time) puts each allocation right before the free of the same address, so the matching
    is done without a Python loop.
    """
    n = len(ev)
    freed_at = np.full(n, n, dtype=np.int64)
    order = np.lexsort((np.arange(n), ev.addr))
    a, b = order[:-1], order[1:]
    pair = (ev.addr[a] == ev.addr[b]) & ev.is_alloc[a] & ~ev.is_alloc[b] & (ev.addr[a] >= 0)
    freed_at[a[pair]] = b[pair]
    matched_free = np.zeros(n, dtype=bool)
    matched_free[b[pair]] = True
    preexisting_free = ~ev.is_alloc & ~matched_free
    return freed_at, preexisting_free


# ---- attribution of every allocation ----------------------------------------------------------------------------

def _innermost_spans(ev: MemoryEvents, spans: list[Span], prefix: str) -> np.ndarray:
    """Index into `spans` of the innermost span named `prefix...` that contains each event on its thread; -1 none."""
    result = np.full(len(ev), -1, dtype=np.int64)
    original = np.array([i for i, s in enumerate(spans) if s.name.startswith(prefix)], dtype=np.int64)
    chosen = [spans[i] for i in original]
    if not chosen:
        return result
    by_thread: dict[str, list[int]] = defaultdict(list)
    for i, s in enumerate(chosen):
        by_thread[s.thread].append(i)
    thread_index = {name: k for k, name in enumerate(ev.threads)}
    for thread, members in by_thread.items():
        k = thread_index.get(thread)
        if k is None:
            continue
        members.sort(key=lambda i: (chosen[i].start_ps, -chosen[i].end_ps))
        starts = np.array([chosen[i].start_ps for i in members], dtype=np.int64)
        ends = np.array([chosen[i].end_ps for i in members], dtype=np.int64)
        parent = _parents(starts, ends)
        on_thread = np.nonzero(ev.thread == k)[0]
        t = ev.t_ps[on_thread]
        idx = np.searchsorted(starts, t, side="right") - 1
        # the last span that started before t is the innermost unless it already ended: then climb to its parents
        for _ in range(64):
            bad = (idx >= 0) & (ends[np.maximum(idx, 0)] < t)
            if not bad.any():
                break
            idx[bad] = parent[idx[bad]]
        members_arr = np.array(members, dtype=np.int64)
        hit = idx >= 0
        result[on_thread[hit]] = members_arr[idx[hit]]
    # map back to indices into the original spans list
    mapped = np.full(len(ev), -1, dtype=np.int64)
    mapped[result >= 0] = original[result[result >= 0]]
    return mapped


def _parents(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    parent = np.full(len(starts), -1, dtype=np.int64)
    stack: list[int] = []
    for i in range(len(starts)):
        while stack and ends[stack[-1]] < starts[i]:
            stack.pop()
        parent[i] = stack[-1] if stack else -1
        stack.append(i)
    return parent


def attribute_events(trace: Trace, ctx: Context) -> tuple[list[str], list[str | None], list[str]]:
    """Per-event op, layer and phase (only meaningful for allocations)."""
    ev, spans = trace.events, trace.spans
    ctx = Context(ctx.layer_names | {s.name.split("/", 1)[1] for s in spans if s.name.startswith("layer/")},
                  ctx.optimizer_scopes, ctx.input_array_bytes, ctx.start_offset_s)
    by_path: dict[int, Attribution] = {}
    layer_span = _innermost_spans(ev, spans, "layer/")
    weight_span = _innermost_spans(ev, spans, "weights/")
    phase_span = _innermost_spans(ev, spans, "phase/")
    data_threads = {k for k, name in enumerate(ev.threads) if name.startswith("tf_data")}
    ops: list[str] = []
    layers: list[str | None] = []
    phases: list[str] = []
    for i in range(len(ev)):
        op_index = int(ev.op[i])
        if op_index >= 0:
            att = by_path.get(op_index)
            if att is None:
                att = by_path[op_index] = attribute_path(ev.strings[op_index], ctx)
            op, layer, phase = att.op, att.layer, att.phase
            eager = "/" not in ev.strings[op_index]
        else:
            op, layer, phase, eager = "(untagged)", None, "other", True
        if eager:  # eager code: our spans know more than the op type
            if weight_span[i] >= 0:
                layer, phase = spans[weight_span[i]].name.split("/", 1)[1], "weights"
                if layer == "optimizer":
                    layer, phase = None, "optimizer"
            elif phase_span[i] >= 0:
                phase = spans[phase_span[i]].name.split("/", 1)[1]
                if layer_span[i] >= 0:
                    layer = spans[layer_span[i]].name.split("/", 1)[1]
            elif layer_span[i] >= 0:
                layer, phase = spans[layer_span[i]].name.split("/", 1)[1], "forward"
        if op_index < 0 and layer is None and phase == "other":
            if int(ev.thread[i]) in data_threads:
                phase = "input"
            elif int(ev.requested[i]) in ctx.input_array_bytes:
                op, phase = "input copy (numpy → tensor)", "input"
        if int(ev.thread[i]) in data_threads and phase == "other":
            phase = "input"
        ops.append(op)
        layers.append(layer)
        phases.append(phase)
    return ops, layers, phases


# ---- the summary --------------------------------------------------------------------------------------------

def downsample(t: np.ndarray, y: np.ndarray, max_points: int = MAX_TIMELINE_POINTS) -> list[list[float]]:
    """At most max_points [t, y] pairs that keep each bucket's minimum and maximum (so the peak survives)."""
    n = len(t)
    if n <= max_points:
        keep = np.arange(n)
    else:
        buckets = max_points // 2
        edges = np.linspace(0, n, buckets + 1).astype(np.int64)
        starts = edges[:-1][edges[:-1] < edges[1:]]
        hi = np.maximum.reduceat(y, starts)
        lo = np.minimum.reduceat(y, starts)
        keep_list = []
        for s, e, h, l in zip(starts, list(starts[1:]) + [n], hi, lo):
            seg = y[s:e]
            keep_list.append(s + int(np.argmax(seg == h)))
            keep_list.append(s + int(np.argmax(seg == l)))
        keep = np.unique(np.array(keep_list, dtype=np.int64))
    return [[round(float(t[i]), 6), int(y[i])] for i in keep]


def _groups(rows: Iterable[tuple[tuple, int, int]], keys: tuple[str, ...], top: int) -> list[LiveGroup]:
    totals: dict[tuple, list[int]] = {}
    for key, chunk, requested in rows:
        acc = totals.setdefault(key, [0, 0, 0])
        acc[0] += chunk
        acc[1] += requested
        acc[2] += 1
    ordered = sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]
    return [LiveGroup(**dict(zip(keys, key)), bytes=b, requested_bytes=r, count=c) for key, (b, r, c) in ordered]


def summarize(trace: Trace, ctx: Context, top: int = TOP_GROUPS) -> TraceInfo:
    """The trace part of a report: timeline, peak, and the live set at the peak broken down several ways."""
    ev = trace.events
    n = len(ev)
    info = TraceInfo(events=n, allocator=ev.allocator)
    if n == 0:
        return info
    t_s = ev.t_ps / PS + ctx.start_offset_s
    signed = np.where(ev.is_alloc, ev.chunk, -ev.chunk)
    info.preexisting_bytes = int(ev.live[0] - signed[0])
    peak = int(np.argmax(ev.live))
    info.peak_live_bytes = int(ev.live[peak])
    info.peak_time_s = round(float(t_s[peak]), 6)
    info.timeline = downsample(t_s, ev.live)
    info.covered_s = round(float(t_s[-1] - t_s[0]), 6)

    freed_at, _ = match_frees(ev)
    own_alloc = ev.is_alloc
    # requested-bytes running total of the cell's own allocations (frees of pre-existing ones do not count)
    delta = np.zeros(n, dtype=np.int64)
    delta[own_alloc] = ev.requested[own_alloc]
    ended = own_alloc & (freed_at < n)
    np.subtract.at(delta, freed_at[ended], ev.requested[ended])
    info.peak_requested_bytes = int(max(np.cumsum(delta).max(), 0))

    live_at_peak = own_alloc & (np.arange(n) <= peak) & (freed_at > peak)
    idx = np.nonzero(live_at_peak)[0]
    info.allocated_at_peak_bytes = int(ev.chunk[idx].sum())
    info.requested_at_peak_bytes = int(ev.requested[idx].sum())
    preexisting_at_peak = info.peak_live_bytes - info.allocated_at_peak_bytes

    ops, layers, phases = attribute_events(trace, ctx)
    rows = []
    for i in idx:
        dtype = DATA_TYPES.get(int(ev.dtype[i])) if ev.dtype[i] > 0 else None
        rows.append((ops[i], layers[i], phases[i], dtype, ev.string(int(ev.shape[i])), int(ev.chunk[i]),
                     int(ev.requested[i])))
    pre = [(("(allocated before the trace)", None, "pre-existing", None, None), preexisting_at_peak,
            preexisting_at_peak)] if preexisting_at_peak > 0 else []
    info.at_peak = _groups([((r[0], r[1], r[2], r[3], r[4]), r[5], r[6]) for r in rows] + pre,
                           ("op", "layer", "phase", "dtype", "shape"), top)
    info.by_layer = _groups([((r[1] or "(no layer)",), r[5], r[6]) for r in rows], ("layer",), top)
    info.by_op = _groups([((r[0],), r[5], r[6]) for r in rows], ("op",), top)
    phase_rows = [((r[2],), r[5], r[6]) for r in rows]
    if preexisting_at_peak > 0:
        phase_rows.append((("pre-existing",), preexisting_at_peak, preexisting_at_peak))
    info.by_phase = _groups(phase_rows, ("phase",), len(PHASES))
    return info

"""From memory events to what a person wants to know: the timeline, the peak, and what was live at the peak.

Attribution of one allocation, in order of trust:
1. its `tf_op` node path (graph code: `fit`, `tf.function`): the deepest path part that is a known layer name
   (minus Keras' `_<n>` scope suffix) gives the layer; `gradient_tape` → backward, an optimizer scope → optimizer;
2. our own trace spans on the same thread (eager code records only the op type): `layer/<name>` →
   forward of that layer, `weights/<name>` → weight creation, `phase/<phase>` → backward or optimizer;
3. what is known of the op type: iterator and tf.data ops → input; an untagged allocation whose size equals an
   array handed to `fit` → the input copy.
An allocation made inside an XLA run (on its thread), or tagged with the name of a function that ran as an XLA
module, is the XLA computation's (op "XLA computation", no layer, phase "other"): XLA allocates its buffers itself,
untagged or tagged with the launching op only, whatever its rules above would say.
On a GPU, a 1-D uint8 temp tensor of a convolution or matrix product is that kernel's cuDNN or cuBLAS workspace
(phase "workspace", its op and layer kept; docs/gpu.md, "Workspaces").
Everything live before the trace began is "pre-existing" (weights and slots of earlier cells, earlier tensors);
what the cell allocated while the trace was paused and still held at the peak is "untraced".
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import numpy as np

from tfmem_magic.analyze import lines
from tfmem_magic.analyze.bfc import LiveAllocation
from tfmem_magic.analyze.step_replay import shape_at
from tfmem_magic.core.report import AllocatorUse, InputCopy, LineGroup, LiveGroup, TraceInfo
from tfmem_magic.core.types import KerasModel, TFFunction
from tfmem_magic.measure.eager_ops import EagerOps
from tfmem_magic.measure.xplane import (
    DATA_TYPES,
    FUNCTION_SPAN,
    XLA_SPAN,
    MemoryEvents,
    Span,
    Trace,
    allocator_device,
    xla_function,
)

PS = 1e12
MAX_TIMELINE_POINTS = 2000
TOP_GROUPS = 25

WORKSPACE = "workspace"  # a GPU kernel's scratch space from cuDNN or cuBLAS (docs/gpu.md, "Workspaces")
PHASES = ("forward", "backward", "optimizer", WORKSPACE, "input", "weights", "pre-existing", "untraced", "other")
_SUFFIX = re.compile(r"_\d+$")
_INPUT_OPS = {
    "MakeIterator",
    "IteratorGetNext",
    "OptionalHasValue",
    "OptionalGetValue",
    "optional",
    "IteratorV2",
    "AnonymousIteratorV3",
    "GatherV2",
    "GatherV2_1",
    "TensorSliceDataset",
}
_OPTIMIZER_SCOPES = {
    "adam",
    "adamw",
    "sgd",
    "rmsprop",
    "adagrad",
    "adadelta",
    "adamax",
    "nadam",
    "ftrl",
    "lion",
    "lamb",
    "loss_scale_optimizer",
    "optimizer",
}
# the ops whose GPU kernels take scratch space through a ScratchAllocator: cuDNN's convolutions (DnnScratchAllocator,
# capped by TF_CUDNN_WORKSPACE_LIMIT_IN_MB) and recurrent layers, cuBLAS's matrix products (BlasScratchAllocator). Each
# asks TensorFlow for `allocate_temp(DT_UINT8, TensorShape({bytes}))`: a 1-D uint8 temp tensor of the op itself.
_WORKSPACE_OPS = re.compile(r"^_?(?:Fused)?(?:Conv[23]D|DepthwiseConv2dNative|MatMul|BatchMatMul|CudnnRNN)")
CUBLAS_OPS = re.compile(r"^_?(?:Fused)?(?:Batch)?MatMul")  # of those, cuBLAS's: no cap on their workspace
# grappler's remapper names a fused kernel (_FusedConv2D, _FusedMatMul) after the last node it fuses: the activation,
# else the BiasAdd or FusedBatchNorm (docs/gpu.md, "Workspaces"); a trace names such a kernel's workspace so
_FUSED_LAST = re.compile(
    r"^(?:BiasAdd|Relu6?|Elu|LeakyRelu|Selu|Sigmoid|Tanh|Gelu|Softplus|Swish|Mish|FusedBatchNorm(?:V[23])?)(?:_\d+)?$"
)
_CONV_SCOPE = re.compile(r"conv", re.IGNORECASE)


def is_cudnn_workspace(op: str | None, layer: str | None) -> bool:
    """A workspace (phase "workspace") that cuDNN's convolution autotuner sized, under TF_CUDNN_WORKSPACE_LIMIT_IN_MB:
    a convolution's own op, or a fused kernel's named after its activation or BiasAdd in a scope whose name holds
    "conv" (Keras' default names; a convolution in a scope named otherwise is not told from a matrix product).
    cuBLAS's (a matrix product's) and batch normalisation's have no cap."""
    name = op or ""
    if _WORKSPACE_OPS.match(name):
        return not CUBLAS_OPS.match(name)
    if name.startswith("FusedBatchNorm"):  # cuDNN's batch norm's own workspace (or a fused one's): no cap on it
        return False
    return _FUSED_LAST.match(name) is not None and _CONV_SCOPE.search(layer or "") is not None


_ONE_DIMENSION = re.compile(r"^\[\d+\]$")
_UINT8 = 4  # TF's DataType enum: DT_UINT8
_RUNTIME_SCOPES = {"StatefulPartitionedCall", "PartitionedCall", "while", "cond", "body"}
XLA_OP = "XLA computation"
INPUT_COPY_OP = "input copy (numpy → tensor)"  # fit's copy of the arrays: the data, not one batch of it
# phases whose tensors never carry the batch: what `_batch_bytes` and `_batch_carrying` leave out
_NOT_BATCH_PHASES = ("weights", "optimizer", "pre-existing", "untraced")


@dataclass
class TraceContext:
    """What the instrumentation learnt during the cell, used to name things in the trace."""

    layer_names: set[str] = field(default_factory=set)
    optimizer_scopes: set[str] = field(default_factory=lambda: set(_OPTIMIZER_SCOPES))
    input_array_bytes: set[int] = field(default_factory=set)  # bytes of the tensor copies Keras makes of arrays
    copy_roles: dict[int, str] = field(default_factory=dict)  # copy bytes -> "training" | "validation"
    windows: list[tuple[float, float]] = field(default_factory=list)  # traced (start, end) seconds: the gaps between
    # them hide frees
    batch_size: int | None = None  # the batch the cell's model ran (to find the tensors that grow with it)
    weight_shapes: set[str] = field(default_factory=set)  # "[a,b]" shapes of the model's variables
    # the steps of the model's sequence outputs ((None, T, D) layers): a Dense on [B, T, D] multiplies [B*T, D], so
    # a matrix whose first dimension is the batch times one of these carries the batch
    step_dims: set[int] = field(default_factory=set)
    # the Keras models the cell used, whose layers name the lines that made them: given, the trace's peak is grouped
    # by the line of code that made each tensor too (lines.py); None (a saved trace): no by-line view
    models: list[KerasModel] | None = None
    traced_functions: list[TFFunction] = field(default_factory=list)  # the concrete functions the cell traced
    eager_ops: EagerOps | None = None  # the eager ops run while the trace recorded, with their lines (eager_ops.py)
    # layers whose name scope is their name as it is (tf_keras' `dense_1` is the layer dense_1, where Keras 3's
    # `dense_1` is the layer dense made unique): `bare_scope_layers`
    bare_layers: set[str] = field(default_factory=set)


@dataclass
class Attribution:
    op: str
    layer: str | None
    phase: str


def attribute_path(path: str, ctx: TraceContext) -> Attribution:
    """Op type, layer and phase of a `tf_op` value (a node path such as `.../cnn_1/conv_a_1/Relu`)."""
    parts = path.split("/")
    op = _SUFFIX.sub("", parts[-1]) or parts[-1]
    if path.startswith("__inference_"):
        if "initialize_variables" in path:
            return Attribution("initialize variables", None, "weights")
        return Attribution("function runtime", None, "other")
    # a scope grappler gave the nodes it made (`.../conv2d/ArithmeticOptimizer/AddOpsRewrite_add`) is no layer
    raw = [p for p in parts[:-1] if not p.endswith(lines.GRAPPLER_SCOPES)]
    scopes = [_SUFFIX.sub("", p) for p in raw]
    layer = next(
        (
            r if r in ctx.bare_layers else s
            for r, s in zip(reversed(raw), reversed(scopes), strict=True)
            if r in ctx.bare_layers or s in ctx.layer_names
        ),
        None,
    )
    if layer is None and ctx.layer_names == set():
        # nothing known about the model (a saved or captured trace): the enclosing scope is the best guess of a
        # layer, once the scopes of the op itself are dropped: a gradient's path names its forward op as a scope
        # (`gradient_tape/.../wide_1/MatMul/MatMul_1`, `.../head_1/BiasAdd/BiasAddGrad`)
        named = list(scopes)
        while len(named) >= 2 and op.startswith(named[-1]):
            named.pop()
        if len(named) >= 2 and named[-1] not in _RUNTIME_SCOPES:
            layer = named[-1]
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


def bare_scope_layers(models: Iterable[KerasModel]) -> set[str]:
    """The names of the models' layers that tf_keras made (`lines.LayerRecord.bare_scope`): its graph names a
    layer's scope by the layer's name as it is (`dense_1`), where Keras 3 makes the scope of `dense` unique as
    `dense_1`. On tf_keras a model of `dense`, `dense_1` and `dense_2` had all its tensors put on `dense` before this
    was told apart."""
    return _bare(lines.layer_table(models))


def _bare(layers: dict[str, lines.LayerRecord]) -> set[str]:
    return {name for name, record in layers.items() if record.bare_scope}


# ---- matching allocations and frees -----------------------------------------------------------------------------


def match_frees(ev: MemoryEvents) -> tuple[np.ndarray, np.ndarray]:
    """For each event: index of the free that ends it (allocs; n if never freed in the trace), and whether a free
    ends an allocation made before the trace (pre-existing).

    Sorting by (address, time) puts each allocation right before the free of the same address, so the matching
    is done without a Python loop. An allocation followed by another allocation at its address was freed while the
    trace was paused (the free is missing): it counts as freed by then, or the requested-bytes totals would only grow.
    An unknown address (-1: the event had no addr stat) or a null one pairs with nothing.
    """
    n = len(ev)
    freed_at = np.full(n, n, dtype=np.int64)
    order = np.lexsort((np.arange(n), ev.addr))
    a, b = order[:-1], order[1:]
    same = (ev.addr[a] == ev.addr[b]) & ev.is_alloc[a] & (ev.addr[a] > 0)
    pair = same & ~ev.is_alloc[b]
    freed_at[a[same]] = b[same]
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


@dataclass
class Attributed:
    """Per-event attribution as indices into small tables (only meaningful for allocations)."""

    op: np.ndarray  # index into ops
    layer: np.ndarray  # index into layers, -1 = none
    phase: np.ndarray  # index into PHASES
    ops: list[str]
    layers: list[str]

    def op_name(self, i: int | np.integer) -> str:
        return self.ops[int(self.op[i])]

    def layer_name(self, i: int | np.integer) -> str | None:
        k = int(self.layer[i])
        return None if k < 0 else self.layers[k]

    def phase_name(self, i: int | np.integer) -> str:
        return PHASES[int(self.phase[i])]


def attribute_events(trace: Trace, ctx: TraceContext) -> Attributed:
    """Op, layer and phase of every event, computed once per distinct op string and broadcast with numpy."""
    ev, spans = trace.events, trace.spans
    span_layers = {s.name.split("/", 1)[1] for s in spans if s.name.startswith("layer/")}
    ctx = replace(ctx, layer_names=ctx.layer_names | span_layers)
    ops: list[str] = ["(untagged)", INPUT_COPY_OP, XLA_OP]
    layers: list[str] = []
    op_index = {name: i for i, name in enumerate(ops)}
    layer_index: dict[str, int] = {}

    def intern(table: list[str], index: dict[str, int], name: str) -> int:
        if name not in index:
            index[name] = len(table)
            table.append(name)
        return index[name]

    phase_of = {name: i for i, name in enumerate(PHASES)}
    # one attribution per distinct tf_op string
    distinct = np.unique(ev.op[ev.op >= 0])
    lut_op = np.zeros(len(ev.strings) + 1, dtype=np.int64)
    lut_layer = np.full(len(ev.strings) + 1, -1, dtype=np.int64)
    lut_phase = np.full(len(ev.strings) + 1, phase_of["other"], dtype=np.int64)
    lut_eager = np.ones(len(ev.strings) + 1, dtype=bool)  # the last slot stands for "no tf_op"
    lut_workspace = np.zeros(len(ev.strings) + 1, dtype=bool)  # an op that takes cuDNN's or cuBLAS's scratch space
    for k in distinct:
        path = ev.strings[int(k)]
        att = attribute_path(path, ctx)
        lut_op[k] = intern(ops, op_index, att.op)
        lut_layer[k] = -1 if att.layer is None else intern(layers, layer_index, att.layer)
        lut_phase[k] = phase_of[att.phase]
        lut_eager[k] = "/" not in path
        lut_workspace[k] = _WORKSPACE_OPS.match(att.op) is not None or _FUSED_LAST.match(att.op) is not None
    key = np.where(ev.op >= 0, ev.op, len(ev.strings))
    op, layer, phase, eager = lut_op[key].copy(), lut_layer[key].copy(), lut_phase[key].copy(), lut_eager[key]

    # eager code records only op types: our spans on the same thread know the layer and the phase
    def span_layer(i: int) -> int:
        return intern(layers, layer_index, spans[i].name.split("/", 1)[1])

    for prefix in ("layer/", "phase/", "weights/"):  # later rules win: weights > phase > layer
        inner = _innermost_spans(ev, spans, prefix)
        hit = np.nonzero(eager & (inner >= 0))[0]
        if not hit.size:
            continue
        for span_i in np.unique(inner[hit]):
            rows = hit[inner[hit] == span_i]
            name = spans[int(span_i)].name.split("/", 1)[1]
            if prefix == "layer/":
                layer[rows], phase[rows] = span_layer(int(span_i)), phase_of["forward"]
            elif prefix == "phase/":
                phase[rows] = phase_of.get(name, phase_of["other"])
            elif name == "optimizer":
                layer[rows], phase[rows] = -1, phase_of["optimizer"]
            else:
                layer[rows], phase[rows] = span_layer(int(span_i)), phase_of["weights"]

    phase[workspaces(ev, lut_workspace[key])] = phase_of[WORKSPACE]

    # input data: tf.data threads, and untagged allocations the size of an array handed to fit
    data_threads = np.array([name.startswith("tf_data") for name in ev.threads] + [False], dtype=bool)
    on_data_thread = data_threads[np.where(ev.thread >= 0, ev.thread, len(ev.threads))]
    phase[on_data_thread & (phase == phase_of["other"])] = phase_of["input"]
    untagged = (ev.op < 0) & (layer < 0) & (phase == phase_of["other"])
    if ctx.input_array_bytes:
        copy = untagged & np.isin(ev.requested, list(ctx.input_array_bytes))
        op[copy], phase[copy] = op_index[INPUT_COPY_OP], phase_of["input"]

    xla = _innermost_spans(ev, spans, XLA_SPAN) >= 0
    functions = {f for f in map(xla_function, trace.xla_modules) if f}
    if functions:
        tagged = np.array([text in functions for text in ev.strings] + [False], dtype=bool)
        xla |= tagged[np.where(ev.op >= 0, ev.op, len(ev.strings))]
    op[xla], layer[xla], phase[xla] = op_index[XLA_OP], -1, phase_of["other"]
    return Attributed(op, layer, phase, ops, layers)


def workspaces(ev: MemoryEvents, workspace_op: np.ndarray) -> np.ndarray:
    """The allocations that are a GPU kernel's cuDNN or cuBLAS workspace: on a GPU's allocator, made by an op whose
    kernel takes scratch space (`workspace_op`, per event), uint8 and 1-D, a temp (or of no recorded region). The rule
    and its sources: docs/gpu.md, "Workspaces". A CPU's oneDNN scratch buffers are not matched: no GPU allocator."""
    device = allocator_device(ev.allocator) if ev.allocator else None
    if device is None or not device.startswith("GPU:"):
        return np.zeros(len(ev), dtype=bool)
    one_dimension = np.array([_ONE_DIMENSION.match(s) is not None for s in ev.strings] + [False], dtype=bool)
    temp = np.array([s == "temp" for s in ev.strings] + [True], dtype=bool)  # no region recorded: not ruled out
    last = len(ev.strings)
    found: np.ndarray = (
        ev.is_alloc
        & workspace_op
        & (ev.dtype == _UINT8)
        & one_dimension[np.where(ev.shape >= 0, ev.shape, last)]
        & temp[np.where(ev.region >= 0, ev.region, last)]
    )
    return found


def xla_runs(spans: list[Span]) -> int:
    """XLA runs in the trace: its XLA spans, counting each nest (a launch op around the executable's run) once."""
    runs = 0
    by_thread: dict[str, list[Span]] = defaultdict(list)
    for s in spans:
        if s.name.startswith(XLA_SPAN):
            by_thread[s.thread].append(s)
    for mine in by_thread.values():
        end = None
        for s in sorted(mine, key=lambda s: (s.start_ps, -s.end_ps)):
            if end is None or s.start_ps > end:
                runs += 1
                end = s.end_ps
            else:
                end = max(end, s.end_ps)
    return runs


# ---- the summary --------------------------------------------------------------------------------------------


def downsample(t: np.ndarray, y: np.ndarray, max_points: int = MAX_TIMELINE_POINTS) -> list[list[float]]:
    """At most max_points [t, y] pairs that keep each bucket's minimum and maximum (so the peak survives)."""
    n = len(t)
    if n <= max_points:
        keep = np.arange(n)
    else:
        buckets = max_points // 2
        bucket = (np.arange(n) * buckets) // n  # sorted bucket id of each point
        starts = np.flatnonzero(np.r_[True, bucket[1:] != bucket[:-1]])
        hi = np.repeat(np.maximum.reduceat(y, starts), np.diff(np.r_[starts, n]))
        lo = np.repeat(np.minimum.reduceat(y, starts), np.diff(np.r_[starts, n]))
        # the first point reaching each bucket's max and min
        first_hi = np.unique(bucket[y == hi], return_index=True)[1]
        first_lo = np.unique(bucket[y == lo], return_index=True)[1]
        keep = np.union1d(np.flatnonzero(y == hi)[first_hi], np.flatnonzero(y == lo)[first_lo])
    return [[round(float(a), 6), int(b)] for a, b in zip(t[keep], y[keep], strict=True)]


class LiveTensor(NamedTuple):
    """One allocation live at the peak, named the ways the report groups it."""

    op: str
    layer: str | None
    phase: str
    dtype: str | None
    shape: str | None
    chunk: int  # bytes the allocator gave
    requested: int  # bytes the op asked for


def _groups(
    rows: Iterable[tuple[tuple[str | None, ...], int, int]], keys: tuple[str, ...], top: int
) -> list[LiveGroup]:
    """(key, chunk, requested) rows summed per key; the `top` largest as LiveGroups with `keys` as field names."""
    totals: dict[tuple[str | None, ...], list[int]] = {}
    for key, chunk, requested in rows:
        acc = totals.setdefault(key, [0, 0, 0])
        acc[0] += chunk
        acc[1] += requested
        acc[2] += 1
    ordered = sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]
    return [
        LiveGroup(**dict(zip(keys, key, strict=True)), bytes=b, requested_bytes=r, count=c)
        for key, (b, r, c) in ordered
    ]


def _drop_freed_in_gaps(
    live: np.ndarray, ev: MemoryEvents, t_s: np.ndarray, peak: int, preexisting: int, windows: list[tuple[float, float]]
) -> None:
    """Between two trace segments the frees are not recorded: an allocation made before a gap and freed in it looks
    live at a later peak. The allocator's own total at the peak (exact) says how much is too much; the excess is
    taken, in place, from what was allocated before the gap that precedes the peak, latest first (the temporaries of
    the step that was running; weights made at the start stay)."""
    starts = [a for a, _ in windows if a <= t_s[peak]]
    if len(starts) < 2:
        return
    window_start = max(starts)
    excess = int(ev.chunk[live].sum()) - (int(ev.live[peak]) - max(preexisting, 0))
    if excess <= 0:
        return
    before = np.nonzero(live & (t_s < window_start))[0][::-1]  # latest first
    for i in before:
        if excess <= 0:
            break
        live[i] = False
        excess -= int(ev.chunk[i])


def batch_dimension(shape: str | None, batch: int, step_dims: set[int] | frozenset[int] = frozenset()) -> bool:
    """The tensor has the batch as its first or second dimension ([B, ...]; time-major RNN states [T, B, ...]), or
    the batch folded with a layer's steps ([B*T, D]: a Dense or attention projection on a sequence)."""
    if not shape or not shape.startswith("["):
        return False
    dims = [d.strip() for d in shape.strip("[]").split(",")]
    if str(batch) in dims[:2]:
        return True
    first = dims[0]
    return (
        len(dims) == 2
        and first.isdigit()
        and int(first) % batch == 0  # a matrix, as a Dense makes it
        and int(first) // batch in step_dims
    )


def _batch_bytes(rows: list[LiveTensor], ctx: TraceContext) -> int | None:
    """Requested bytes live at the peak in tensors that carry the batch dimension: what grows with the batch,
    measured (activations, their gradients, the states a recurrent layer keeps per time step, attention scores,
    the batches in the input pipeline). None without a batch large enough to tell from other dimensions."""
    batch = ctx.batch_size
    if batch is None or batch < 3:
        return None
    return sum(
        r.requested
        for r in rows
        if r.phase not in _NOT_BATCH_PHASES
        and r.op != INPUT_COPY_OP
        and r.shape not in ctx.weight_shapes
        and batch_dimension(r.shape, batch, ctx.step_dims)
    )


def _running(sizes: np.ndarray, counted: np.ndarray, freed_at: np.ndarray) -> np.ndarray:
    """Bytes live after each event in the allocations `counted`, each holding its `sizes` from its event until the
    event `freed_at` names (len: never freed)."""
    n = len(sizes)
    delta = np.where(counted, sizes, 0).astype(np.int64)
    freed = counted & (freed_at < n)
    np.subtract.at(delta, freed_at[freed], sizes[freed])
    return np.cumsum(delta)


def _batch_carrying(ev: MemoryEvents, att: Attributed, ctx: TraceContext) -> np.ndarray | None:
    """The allocations in tensors that carry the batch dimension (those `_batch_bytes` counts at the peak); None
    without a batch large enough to tell. A step can peak at a moment that holds few of them (a GRU's, in half the
    runs at batch 32: the peak came while its step's tensors were small, 20 KB per sample where another moment held
    71 KB): the moment that holds most of them grows fastest with the batch, and its allocator total is where its
    own line starts."""
    batch = ctx.batch_size
    if batch is None or batch < 3:
        return None
    skip = [PHASES.index(p) for p in _NOT_BATCH_PHASES]
    copy = att.ops.index(INPUT_COPY_OP)
    shapes = np.unique(ev.shape[ev.is_alloc])
    carrying_shapes = [
        k
        for k in shapes.tolist()
        if ev.string(k) not in ctx.weight_shapes and batch_dimension(ev.string(k), batch, ctx.step_dims)
    ]
    carrying: np.ndarray = (
        ev.is_alloc & np.isin(ev.shape, carrying_shapes) & ~np.isin(att.phase, skip) & (att.op != copy)
    )
    return carrying


def _window_ends(t_s: np.ndarray, windows: list[tuple[float, float]]) -> np.ndarray:
    """For each event, the index of the first event past the end of the trace segment it belongs to (len: none),
    and never the event itself or earlier (an event stamped after its segment's end: the profiler stops a moment
    after the segment's end is read)."""
    n = len(t_s)
    if len(windows) < 2:
        return np.full(n, n, dtype=np.int64)
    starts = np.array([w[0] for w in windows])
    ends = np.array([w[1] for w in windows])
    segment = np.clip(np.searchsorted(starts, t_s, side="right") - 1, 0, len(windows) - 1)
    found = np.searchsorted(t_s, ends[segment], side="right").astype(np.int64)
    return np.maximum(found, np.arange(n, dtype=np.int64) + 1)


def _segment_freed(
    ev: MemoryEvents, freed_at: np.ndarray, live_at_peak: np.ndarray, window_ends: np.ndarray, peak: int
) -> np.ndarray:
    """When each allocation ended, a free lost in a pause taken as coming when its trace segment ended: an
    allocation with no free in the trace, or whose address was allocated again before any free (`match_frees`
    takes that allocation as its end), is live until the end of its segment, not to the end of the trace or to
    some later segment's reuse. A segment that stopped inside a step leaves that step's tensors unfreed, and the
    allocator's total there holds them. What is live at the peak is live through it (the peak's own accounting)."""
    n = len(ev)
    lost = ev.is_alloc & ((freed_at >= n) | ev.is_alloc[np.minimum(freed_at, n - 1)])
    ended = np.where(lost, np.minimum(freed_at, window_ends), freed_at)
    return np.where(lost & live_at_peak, np.maximum(ended, peak + 1), ended)


# how far (a share of the cell's own bytes at the peak) the bytes a moment holds unseen by the trace may differ from
# the peak's for the moment to count (_accounted)
ACCOUNTED = 0.05
# smaller batches, as fractions of the cell's, at which `_moments_below` looks for the moment that would be the peak
BELOW_RATIOS = (1 / 16, 1 / 8, 1 / 4, 1 / 2, 3 / 4)


def _accounted(
    ev: MemoryEvents, freed_at: np.ndarray, preexisting_free: np.ndarray, preexisting: int, peak: int
) -> np.ndarray:
    """The events where the trace accounts for the allocator's total as well as it does at the peak: the bytes
    live there that are neither the trace's own allocations (ended as `freed_at` says) nor what was live before it
    (less the frees `preexisting_free` marks) differ from the peak's by at most ACCOUNTED of the cell's own bytes
    at the peak. Elsewhere what a moment holds is not known well enough to split it into what shrinks with the
    batch and what does not."""
    preexisting_left = preexisting - np.cumsum(np.where(preexisting_free, ev.chunk, 0))
    unknown = ev.live - _running(ev.chunk, ev.is_alloc, freed_at) - preexisting_left
    own_at_peak = max(int(ev.live[peak]) - preexisting, 1)
    accounted: np.ndarray = np.abs(unknown - unknown[peak]) <= ACCOUNTED * own_at_peak
    return accounted


def _moments_below(
    running: np.ndarray, live: np.ndarray, peak: int, chunks: float, accounted: np.ndarray | None = None
) -> list[list[int]]:
    """The moments of the step that would be its peak at a smaller batch, each as [requested bytes live in tensors
    with the batch dimension, allocator bytes in use]: at a fraction r of the batch a moment holds about
    live - (1 - r) x its batch bytes (in chunks), and the highest such moment is the peak there. A GRU's peak at
    batch 32 is in its forward pass, mostly batch tensors; at batch 8 it is in its backward pass, in gradients of
    the recurrent kernel's shape that do not shrink (docs/what-if.md, "Below the cell's batch"): a line through the
    peak alone fell 29-38% short there. The peak itself is left out (it is the basis' own line), and so are the
    moments outside `accounted` (a transformer's cell found a moment, held by tensors its trace never saw allocated,
    that predicted twice the real peak at a quarter of the batch)."""
    found: list[list[int]] = []
    for ratio in BELOW_RATIOS:
        height = live - (1 - ratio) * chunks * np.maximum(running, 0)
        if accounted is not None:
            height = np.where(accounted, height, -np.inf)
        at = int(np.argmax(height))
        line = [int(max(running[at], 0)), int(live[at])]
        if at != peak and line not in found:
            found.append(line)
    return found


def summarize(trace: Trace, ctx: TraceContext, top: int = TOP_GROUPS) -> TraceInfo:
    """The trace part of a report: timeline, peak, and the live set at the peak broken down several ways."""
    ev = trace.events
    n = len(ev)
    info = TraceInfo(
        events=n,
        allocator=ev.allocator,
        allocators=[
            AllocatorUse(
                a.name, a.device, a.events, a.peak_bytes, a.limit_bytes, [] if i == 0 else a.timeline
            )  # the first is the main timeline
            for i, a in enumerate(trace.allocators)
        ],
    )
    info.xla_runs = xla_runs(trace.spans)
    if n == 0:
        return info
    t_s = ev.t_ps / PS  # segment offsets already put every event on the cell's clock
    signed = np.where(ev.is_alloc, ev.chunk, -ev.chunk)
    info.preexisting_bytes = int(ev.live[0] - signed[0])
    peak = int(np.argmax(ev.live))
    info.peak_live_bytes = int(ev.live[peak])
    info.peak_time_s = round(float(t_s[peak]), 6)
    info.timeline = downsample(t_s, ev.live)
    info.covered_s = round(float(t_s[-1] - t_s[0]), 6)

    freed_at, preexisting_free = match_frees(ev)
    own_alloc = ev.is_alloc
    # requested-bytes running total of the cell's own allocations (frees of pre-existing ones do not count)
    info.peak_requested_bytes = int(max(_running(ev.requested, own_alloc, freed_at).max(), 0))

    live_at_peak = own_alloc & (np.arange(n) <= peak) & (freed_at > peak)
    _drop_freed_in_gaps(live_at_peak, ev, t_s, peak, info.preexisting_bytes, ctx.windows)
    idx = np.nonzero(live_at_peak)[0]
    info.allocated_at_peak_bytes = int(ev.chunk[idx].sum())
    info.requested_at_peak_bytes = int(ev.requested[idx].sum())
    untracked_at_peak = info.peak_live_bytes - info.allocated_at_peak_bytes
    pre_frees = preexisting_free.copy()
    if len(ctx.windows) > 1:
        # a free whose allocation the trace never saw is a pre-existing tensor's only in the first segment: later,
        # it is as likely a tensor allocated in the gap between two segments
        pre_frees &= t_s < ctx.windows[0][1]
    freed_before_peak = int(ev.chunk[: peak + 1][pre_frees[: peak + 1]].sum())
    preexisting_at_peak = max(min(untracked_at_peak, info.preexisting_bytes - freed_before_peak), 0)
    untraced_at_peak = untracked_at_peak - preexisting_at_peak

    att = attribute_events(trace, ctx)
    copies = np.nonzero(own_alloc & (att.op == att.ops.index(INPUT_COPY_OP)))[0]
    info.input_copies = [
        InputCopy(
            int(ev.chunk[i]),
            int(ev.requested[i]),
            round(float(t_s[i]), 6),
            round(float(t_s[freed_at[i]]), 6) if freed_at[i] < n else None,
            bool(live_at_peak[i]),
            ctx.copy_roles.get(int(ev.requested[i]), "training"),
        )
        for i in copies
    ]
    rows = _live_tensors(ev, att, idx)
    info.batch_bytes_at_peak = _batch_bytes(rows, ctx)
    info.replica_batch_size = ctx.batch_size if info.batch_bytes_at_peak is not None else None
    if info.batch_bytes_at_peak is not None:
        carrying = _batch_carrying(ev, att, ctx)
        if carrying is not None:
            # the moment holding the most batch-carrying bytes, each live until its (maybe lost) free: counted to the
            # trace's end, a step's tensors whose frees a pause lost stayed live in the next step, and an LSTM's
            # busiest moment held 1.4x its step's tensors (docs/what-if.md, "A free lost in a pause")
            ended = _segment_freed(ev, freed_at, live_at_peak, _window_ends(t_s, ctx.windows), peak)
            segments = _running(ev.requested, carrying, ended)
            most = int(np.argmax(segments))
            info.batch_bytes_most = int(max(segments[most], 0))
            info.live_at_batch_most_bytes = int(ev.live[most])
            chunks = info.allocated_at_peak_bytes / max(info.requested_at_peak_bytes, 1)
            accounted = _accounted(ev, ended, pre_frees, info.preexisting_bytes, peak)
            info.moments_below = _moments_below(segments, ev.live, peak, max(1.0, chunks), accounted)
    # what the trace could not see, as rows of their own: live before it started, or allocated while it was paused
    rows += [
        LiveTensor(op, None, phase, None, None, size, size)
        for op, phase, size in (
            ("(allocated before the trace)", "pre-existing", preexisting_at_peak),
            ("(allocated while the trace was paused)", "untraced", untraced_at_peak),
        )
        if size > 0
    ]
    traced = [r for r in rows if r.phase not in ("pre-existing", "untraced")]
    info.at_peak = _groups(
        [((r.op, r.layer, r.phase, r.dtype, r.shape), r.chunk, r.requested) for r in rows],
        ("op", "layer", "phase", "dtype", "shape"),
        top,
    )
    info.by_layer = _groups([((r.layer or "(no layer)",), r.chunk, r.requested) for r in traced], ("layer",), top)
    info.by_op = _groups([((r.op,), r.chunk, r.requested) for r in traced], ("op",), top)
    info.by_phase = _groups([((r.phase,), r.chunk, r.requested) for r in rows], ("phase",), len(PHASES))
    info.xla_at_peak_bytes = sum(r.chunk for r in rows if r.op == XLA_OP)
    held, held_rows = _held_at_end(info, ev, att, freed_at, t_s, ctx, top, int(ev.chunk[pre_frees].sum()))
    if ctx.models is not None:
        found = _lines_of(trace, att, idx, rows[: len(idx)], ctx, top, eager=True)
        if found is not None:
            info.by_line, info.by_line_named_bytes, info.by_line_note = found.groups, found.named_bytes, found.note
        # what the leak findings name: eager ops' tensors there are not paired with the op callback's lines
        found = _lines_of(trace, att, held, held_rows, ctx, top, eager=False) if len(held) else None
        if found is not None:
            info.held_at_end_by_line = found.groups
    return info


def _live_tensors(ev: MemoryEvents, att: Attributed, idx: np.ndarray) -> list[LiveTensor]:
    """The allocations at `idx`, named the ways the report groups them."""
    return [
        LiveTensor(
            att.op_name(i),
            att.layer_name(i),
            att.phase_name(i),
            DATA_TYPES.get(int(ev.dtype[i])) if ev.dtype[i] > 0 else None,
            ev.string(int(ev.shape[i])),
            int(ev.chunk[i]),
            int(ev.requested[i]),
        )
        for i in idx
    ]


def _lines_of(
    trace: Trace,
    att: Attributed,
    idx: np.ndarray,
    live: Sequence[LiveTensor],
    ctx: TraceContext,
    top: int,
    eager: bool,
) -> lines.ByLine | None:
    """The cell's own allocations at `idx` (named as `live` names them) by the line of code that made them
    (lines.py): those live at the peak, or those still live when the trace ended. `eager`: pair eager ops' tensors
    with the lines their op callback noted (`_eager_lines`)."""
    ev = trace.events
    hints = [_hint(att, i, tensor.phase) for i, tensor in zip(idx, live, strict=True)]
    made = _eager_lines(trace, att, idx, hints, ctx) if eager else {}
    rows = [
        lines.TracedTensor(ev.string(int(ev.op[i])), *tensor, int(ev.t_ps[i]), hint, made.get(int(i)))
        for i, tensor, hint in zip(idx, live, hints, strict=True)
    ]
    return lines.resolve_cell(rows, trace.spans, ctx.models or [], top, ctx.traced_functions)


def _hint(att: Attributed, i: int | np.integer, phase: str) -> str | None:
    """What the analysis knows a row is before any line is looked for: XLA's, the input's (lines.TracedTensor.hint)."""
    if att.op[i] == att.ops.index(XLA_OP):
        return lines.HINT_XLA
    if att.op[i] == att.ops.index(INPUT_COPY_OP) or phase == "input":
        return lines.HINT_INPUT
    return None


def _eager_lines(
    trace: Trace, att: Attributed, idx: np.ndarray, hints: Sequence[str | None], ctx: TraceContext
) -> dict[int, lines.EagerMade | str]:
    """The line of each eager op's allocation live at the peak (by event index), matched to the ops the op
    callback recorded (lines.match_eager), or why it has none. Eager here: an op type alone (no node path), not
    the input pipeline's or XLA's, outside every run of a tf.function, in a trace segment."""
    ev, recorded = trace.events, ctx.eager_ops
    if recorded is None or not len(idx):
        return {}
    names = {int(k): name for k in np.unique(ev.op[idx]) if (name := ev.string(int(k))) is not None}
    eager_ops = [k for k, name in names.items() if "/" not in name and not name.startswith("__")]
    peak = [int(i) for i, hint in zip(idx, hints, strict=True) if hint is None and int(ev.op[i]) in eager_ops]
    if not peak:
        return {}
    # every allocation of those op types, in time order: the order pairs them with the recorded ops
    pick = np.nonzero(ev.is_alloc & np.isin(ev.op, eager_ops) & np.isin(ev.requested, ev.requested[peak]))[0]
    copy, xla = att.ops.index(INPUT_COPY_OP), att.ops.index(XLA_OP)
    pick = pick[(att.op[pick] != copy) & (att.op[pick] != xla)]
    t = ev.t_ps[pick]
    runs = sorted((s.start_ps, s.end_ps) for s in trace.spans if s.name.startswith(FUNCTION_SPAN))
    if runs:  # outside every function run (the runs merged, then each time looked up)
        merged: list[list[int]] = []
        for start, end in runs:
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        inside = _interval_of(merged, t) >= 0
        pick, t = pick[~inside], t[~inside]
    if not ctx.windows:
        return {}
    window = _interval_of([(int(a * PS), int(b * PS)) for a, b in ctx.windows], t)
    allocations = [
        lines.EagerAllocation(int(i), int(w), lines.eager_op_type(names[int(ev.op[i])]), int(ev.requested[i]), int(ti))
        for i, w, ti in zip(pick, window, t, strict=True)
        if w >= 0
    ]
    found = lines.match_eager(peak, allocations, recorded)
    return {i: found.get(i, lines.IN_FUNCTION) for i in peak}


def _interval_of(intervals: Sequence[Sequence[int]], t: np.ndarray) -> np.ndarray:
    """For each time in `t`, the index of the interval ([start, end], sorted and disjoint) that holds it; -1 where
    none does."""
    starts = np.array([a for a, _ in intervals], dtype=np.int64)
    ends = np.array([b for _, b in intervals], dtype=np.int64)
    at = np.searchsorted(starts, t, side="right") - 1
    at[(at >= 0) & (t > ends[np.maximum(at, 0)])] = -1
    return at


def _held_at_end(
    info: TraceInfo,
    ev: MemoryEvents,
    att: Attributed,
    freed_at: np.ndarray,
    t_s: np.ndarray,
    ctx: TraceContext,
    top: int,
    preexisting_freed: int,
) -> tuple[np.ndarray, list[LiveTensor]]:
    """The cell's own allocations that no free in the trace ended, grouped as the peak is: what the cell had live
    when the trace stopped (the weights it built, a model's slots, tensors a name keeps; a trace that covered only
    the first steps also ends with that step's temporaries). A free lost in a gap between trace segments is taken
    back against the allocator's own count at the last event, as at the peak, net of the pre-existing tensors the
    cell freed. Returns their indices and their rows (the leak findings' lines are resolved from them)."""
    n = len(ev)
    held = ev.is_alloc & (freed_at >= n)
    _drop_freed_in_gaps(held, ev, t_s, n - 1, info.preexisting_bytes - preexisting_freed, ctx.windows)
    idx = np.nonzero(held)[0]
    info.held_at_end_bytes = int(ev.chunk[idx].sum())
    rows = _live_tensors(ev, att, idx)
    info.held_at_end = _groups(
        [((r.op, r.layer, r.phase, r.dtype, r.shape), r.chunk, r.requested) for r in rows],
        ("op", "layer", "phase", "dtype", "shape"),
        top,
    )
    return idx, rows


def replayed_by_line(
    events: MemoryEvents,
    live: Iterable[LiveAllocation],
    probe: int,
    batch: int,
    grows: np.ndarray,
    layers: dict[str, lines.LayerRecord],
    keras_step: bool = True,
    top: int = TOP_GROUPS,
    cells: dict[str, int] | None = None,
) -> list[LineGroup]:
    """The tensors a step replay held at its peak (`live`: the replay's `live_at_peak`, each the index of its
    allocation in the probe's `events`), grouped by the line of code that made them (docs/lines.md, "The lines of a
    refusal"): each allocation attributed as a trace's is (`attribute_events`: its op path's layer and phase), a
    layer's tensors named by the line that made the layer (`layers`: the kernel model's, `lines.layer_table`; the
    probes' clone keeps its layer names), the rest by what they are (`lines.made_line`). Bytes are the replay's
    chunks at `batch`; a shape is the probe's, its batch dimension (`probe`) written for `batch` where the allocation
    grows with the batch (`grows`, per event: its line's slope is above 0)."""
    att = attribute_events(Trace(events), TraceContext(layer_names=set(layers), bare_layers=_bare(layers)))
    rows = []
    for a in live:
        i = a.index
        if not 0 <= i < len(events) or not events.is_alloc[i]:  # live before the probe's trace: nothing known
            rows.append(lines.TracedTensor(None, "(untagged)", None, "other", None, None, a.chunk, a.requested, 0))
            continue
        tensor = _live_tensors(events, att, np.array([i]))[0]
        shape = shape_at(tensor.shape, probe, batch) if grows[i] > 0 else tensor.shape
        rows.append(
            lines.TracedTensor(
                events.string(int(events.op[i])),
                tensor.op,
                tensor.layer,
                tensor.phase,
                tensor.dtype,
                shape,
                a.chunk,
                a.requested,
                int(events.t_ps[i]),
                _hint(att, i, tensor.phase),
            )
        )
    resolver = lines.Resolver(layers, cells)
    found = lines.by_line(rows, [], resolver, top, resolve=lambda row: lines.made_line(row, resolver, keras_step))
    return found.groups

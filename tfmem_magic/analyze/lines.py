"""Which line of the user's code made what was live at the peak: the report's by-line view (`TraceInfo.by_line`).

The method (docs/lines.md):

- The trace names the tf.functions that ran (kept as spans by measure/xplane.py, FUNCTION_SPAN) and, for each
  allocation, its op's node path (`StatefulPartitionedCall/sequential_1/dense_1/MatMul`). The path is walked down
  the concrete function that was running when the allocation was made: a call node's `f`, a `While` node's `body`
  or `cond` (`while/body/_24/...`), an `If` node's branches (`cond/then/_0/...`). A function traced in an earlier
  cell is the one that ran: its stacks are those of its first trace, the lines of the cells its code is in.
- TensorFlow keeps the Python stack of every op it traced: the op's own (`op.traceback`) where Python holds the
  function's graph (a concrete function of the cell's models, or one the cell traced), else the function's
  `context.get_graph_debug_info(function)` (what its own "defined at" errors print; 50-60 ms for a Keras step). The
  user's frame is the innermost one outside TensorFlow, Keras, tfmem, the standard library and site-packages
  (measure/code_sites.is_user_file); a notebook cell's file is named `In [n]`: the cell the code is in, not the cell
  being run.
- A built-in layer's ops have no user frame inside the layer (their stack ends at `fit(...)`): they are named by
  the line that made the layer (measure/code_sites.py notes it while tfmem is loaded). A custom layer's ops are named
  by the line in its `call`, with the line that made the layer beside it (`made_by`).
- A gradient is named by its forward op's line: `gradient_tape/<forward op>/<grad op>` (GradientTape), and
  `.../gradients/<forward op>_grad/...` (inside a while loop's gradient). A node the graph optimizer made, which no
  function's def holds, is named by the one line of the name scope it was made in, where the scope has one.
- An eager op's allocation carries its op type alone. While the trace records, an op callback notes the line that
  ran each eager op, with its outputs' sizes (measure/eager_ops.py); `match_eager` pairs the trace's eager
  allocations with those ops by op type, size and order within each trace segment, and names them by that line.
- Bytes no line made are grouped under what they are, never under a guessed line: Keras' own step (loss, metrics
  and optimizer of fit's step), tf.data and the input pipeline, eager ops not matched one to one to a recorded op
  (the note says why), XLA buffers (no op names), a function's own runtime allocations (tagged with its name, no
  node), graph ops not found in a function that ran (its function is gone).

It runs at the cell's end, for the tensors live at the peak and for those still live when the trace ended (what the
leak findings name), and after a pre-flight's refusal for what its step replay held at its peak (`made_line`: the
probes' functions are in another process, so a layer's tensors are named by the line that made the layer). Each
function's nodes and stacks are read once and kept (TensorFlow gives every concrete function a name of its own in a
process).
"""

from __future__ import annotations

import bisect
import linecache
import logging
import os
import re
import sys
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, NamedTuple

from tfmem_magic.core.fallbacks import fallback
from tfmem_magic.core.report import ErrorSite, LineGroup, LineTensor
from tfmem_magic.core.session import SESSION
from tfmem_magic.core.sizes import format_bytes
from tfmem_magic.core.types import KerasModel, ProtoMessage, TFFunction, TFGraph
from tfmem_magic.measure import code_sites, eager_ops, kerases
from tfmem_magic.measure.eager_ops import EagerOps
from tfmem_magic.measure.instrument import all_layers
from tfmem_magic.measure.xplane import FUNCTION_SPAN, Span

_log = logging.getLogger(__name__)

LINE, LAYER, KERAS, INPUT, EAGER, XLA, FUNCTION, UNRESOLVED, UNTAGGED = (
    "line",
    "layer",
    "keras",
    "tf.data",
    "eager",
    "xla",
    "function",
    "unresolved",
    "untagged",
)
LABELS = {
    KERAS: "Keras internals (loss, metrics, optimizer of Keras' own step)",
    INPUT: "tf.data and the input pipeline",
    EAGER: "eager ops",
    XLA: "XLA buffers",
    FUNCTION: "tf.function runtime (its folded constants and arguments)",
    UNRESOLVED: "graph ops of functions no longer found",
    UNTAGGED: "allocations with no op name",
}
# what the analysis already knows a row is, before any line is looked for (TracedTensor.hint)
HINT_INPUT, HINT_XLA = "input", "xla"
PS_PER_S = 10**12
# how far an eager allocation's time in the trace may fall after its op's callback ran and still be its op's: the
# profiler's clock and time.perf_counter drift apart within a trace segment (measured in docs/lines.md)
EAGER_SLACK_PS = 10**9
MAX_FUNCTIONS = 64  # functions whose nodes and stacks are kept between cells
MAX_TENSORS = 3  # tensors listed per line
MAX_CODE = 160  # characters of a line's text
# the name scopes grappler's optimizers give the nodes they make, matched by their end (ArithmeticOptimizer,
# DependencyOptimizer, LoopOptimizer, `...-LayoutOptimizer`, ConstantFolding, ConstantFoldingCtrl, ...): never the
# user's own, never a layer (docs/gpu.md, "Grappler's scopes")
GRAPPLER_SCOPES = ("Optimizer", "ConstantFolding", "ConstantFoldingCtrl", "Remapper", "AutoMixedPrecision")
# why an eager op's allocation is not named (match_eager), as the note says it
NO_CALLBACK = "no op callback noted their lines"
NOT_NOTED = "no op output of their type and size was noted (a variant or string output, another thread's op)"
NOT_ONE_TO_ONE = "as many in the trace as noted outputs of their type and size is needed, or fewer of one line"
OUT_OF_ORDER = "the trace's order differs from the order the ops ran in"
NO_USER_FRAME = "run by no frame of your code"
TOO_SMALL = f"smaller than {format_bytes(eager_ops.MIN_NOTED_BYTES)}: the op callback notes larger outputs only"
IN_FUNCTION = "made while a tf.function ran, or outside the trace's segments"
MAX_SCOPE_NODES = 256  # nodes of one name scope read to find its one line (Resolver.scope_line)
# the path part after a control-flow node's name -> the attributes naming its functions
_BRANCHES = {"body": ("body",), "cond": ("cond",), "then": ("then_branch",), "else": ("else_branch",)}
_BRANCH_INDEX = re.compile(r"^_\d+$")
# the attributes that name the functions a node runs: a call's, a while loop's, an if's or a case's
_CALL_ATTRS = ("f", "body", "cond", "then_branch", "else_branch", "branches")
_INPUT_CELL = re.compile(r"^<ipython-input-(\d+)-[0-9a-f]+>$")
_SCOPE_SUFFIX = re.compile(r"_\d+$")  # a layer's name scope in a graph: its name, made unique (`wide_1`)


# an eager op's line as its op callback noted it (measure/eager_ops.py): (file, line, whether a frame of Keras' fit,
# evaluate or predict was between the op and the user's frame); a str: why the allocation was not matched to an op
EagerMade = tuple[str, int, bool]


class TracedTensor(NamedTuple):
    """One allocation live at the peak, as the analysis attributed it."""

    path: str | None  # its `tf_op` (a node path in graph code, the op type in eager code); None: untagged
    op: str  # the op type
    layer: str | None
    phase: str
    dtype: str | None
    shape: str | None
    chunk: int
    requested: int
    t_ps: int  # when it was allocated
    hint: str | None = None  # HINT_INPUT (tf.data, the data adapter, fit's copy), HINT_XLA: no line to look for
    eager: EagerMade | str | None = None  # an eager op's: its recorded line (match_eager), or why it has none


@dataclass(frozen=True)
class Site:
    """A line of code: where it is, how the report names it, its text."""

    file: str
    line: int
    label: str
    code: str


@dataclass(frozen=True)
class LayerRecord:
    made_at: tuple[str, int] | None  # (file, line) that made it (None: made before tfmem was loaded)
    builtin: bool  # a class of Keras' own (its ops have no line of the user's inside the layer)
    bare_scope: bool = False  # tf_keras': its ops' scope is its name as it is (analysis.TraceContext.bare_layers)


@dataclass(frozen=True)
class LineOf:
    kind: str
    site: Site | None = None
    made_by: Site | None = None
    layer: str | None = None


# ---- the functions that ran -------------------------------------------------------------------------------------


class Function:
    """One concrete function's nodes: the functions each call node runs, and (read on first need) each node's stack."""

    def __init__(self, name: str, fdef: ProtoMessage, debug_info: Callable[[], ProtoMessage | None]) -> None:
        self.name = name
        self.nodes: set[str] = set()
        self.calls: dict[str, dict[str, list[str]]] = {}  # node -> attribute -> function names
        for node in fdef.node_def:
            self.nodes.add(node.name)
            attrs = node.attr
            targets = {}
            for key in _CALL_ATTRS:
                if key not in attrs:
                    continue
                value = attrs[key]
                if value.HasField("func"):
                    targets[key] = [value.func.name]
                elif value.HasField("list") and len(value.list.func):
                    targets[key] = [f.name for f in value.list.func]
            if targets:
                self.calls[node.name] = targets
        self._debug_info = debug_info
        self._info: ProtoMessage | None = None
        self._read = False
        self._user_files: list[bool] = []  # per file of the debug info: the user's (code_sites.is_user_file)
        self._frames: dict[object, tuple[tuple[str, int] | None, bool]] = {}  # stack's key -> (user frame, entry)
        # the function's graph while Python holds it (a ConcreteFunction of the cell's models or traced in it): an
        # op's own stack costs ~0.1 ms; the GraphDebugInfo of a whole Keras step costs TensorFlow 50-60 ms
        self.graph: weakref.ref[TFGraph] | None = None
        self.scopes: dict[str, LineOf | None] = {}  # a gradient scope's one forward line (Resolver.gradient_line)
        self._tree: dict[str, Function] | None = None

    def user_frame(self, node: str) -> tuple[tuple[str, int] | None, bool]:
        """The node's innermost user frame (file, line), and whether that frame called Keras' fit, evaluate or
        predict (the op was made by Keras' own step, or by a built-in layer that step called): from the op's own
        stack where the function's graph is at hand, else from the function's GraphDebugInfo (files, frames,
        stacks as lists of frame ids, outermost first). Once per node."""
        graph = self.graph() if self.graph is not None else None
        if graph is not None:
            known = self._frames.get(node)
            if known is None:
                known = self._frames[node] = _op_user_frame(graph, node)
            return known
        if not self._read:
            self._read, self._info = True, self._debug_info()
            if self._info is not None:
                self._user_files = [code_sites.is_user_file(f) for f in self._info.files]
        info = self._info
        trace_id = info.name_to_trace_id.get(node) if info is not None else None
        if info is None or trace_id is None:
            return None, False
        known = self._frames.get(trace_id)
        if known is None:
            trace = info.traces_by_id.get(trace_id)
            frames = (
                list(trace.file_line_cols)
                if trace is not None and len(trace.file_line_cols)
                else [info.frames_by_id[i] for i in trace.frame_id if i in info.frames_by_id]
                if trace is not None
                else []
            )
            files = info.files
            known = self._frames[trace_id] = _classify(
                (files[f.file_index], f.line, f.func) for f in frames if 0 <= f.file_index < len(files)
            )
        return known


def _op_user_frame(graph: TFGraph, node: str) -> tuple[tuple[str, int] | None, bool]:
    """`_classify` of the stack TensorFlow recorded when the node's op was made, read from its innermost frame out
    and only to the first user frame (a frame costs ~1 µs; a notebook's stacks run 50-200 frames deep)."""
    try:
        stack = graph.get_operation_by_name(node).traceback
    except (KeyError, ValueError):  # no such op
        return None, False
    entry = False
    for i in range(len(stack) - 1, -1, -1):
        frame = stack[i]
        file = frame.filename
        if code_sites.is_user_file(file):
            return (file, frame.lineno), entry
        if not entry and code_sites.is_keras_entry(file, frame.name):
            entry = True
    return None, False


def _classify(frames: Iterable[tuple[str, int, str]]) -> tuple[tuple[str, int] | None, bool]:
    """(the innermost user frame, whether a frame after it is Keras' fit, evaluate or predict)."""
    user: tuple[str, int] | None = None
    entry = False
    for file, line, func in frames:
        if code_sites.is_user_file(file):
            user, entry = (file, line), False
        elif user is not None and code_sites.is_keras_entry(file, func):
            entry = True
    return user, entry


_FUNCTIONS: OrderedDict[str, Function | None] = OrderedDict()


_GRAPHS: dict[str, weakref.ref[TFGraph]] = {}  # function name -> its graph, for the cell being resolved


def function(name: str) -> Function | None:
    """The concrete function `name` as the eager context holds it (None: gone, or not a function), kept."""
    if name in _FUNCTIONS:
        _FUNCTIONS.move_to_end(name)
        kept = _FUNCTIONS[name]
        if kept is not None and name in _GRAPHS:
            kept.graph = _GRAPHS[name]
        return kept
    from tensorflow.python.eager import context

    ctx = context.context()
    try:
        fdef = ctx.get_function_def(name)
    except Exception:  # noqa: BLE001 - NotFoundError and kin: the function was garbage collected
        found = None
    else:

        def debug_info() -> ProtoMessage | None:
            try:
                return ctx.get_graph_debug_info(name)
            except Exception as exc:  # noqa: BLE001 - no stacks: every node of it is unresolved, not an error
                fallback(_log, f"the stacks of {name} could not be read", exc)
                return None

        found = Function(name, fdef, debug_info)
        found.graph = _GRAPHS.get(name)
    _FUNCTIONS[name] = found
    while len(_FUNCTIONS) > MAX_FUNCTIONS:
        _FUNCTIONS.popitem(last=False)
    return found


def walk(
    top: Function, path: str, reached: list[tuple[int, Function, str]] | None = None
) -> tuple[Function, str] | None:
    """The function and node a `tf_op` path names, starting in `top` (the function that ran). `reached` collects
    (depth, function, the rest of the path) of each function the walk entered: where no node is found, the deepest
    tells in which function and name scope the missing node was (a node the graph optimizer made)."""
    return _walk(top, path.split("/"), 0, reached)


def _walk(
    fn: Function, parts: list[str], depth: int, reached: list[tuple[int, Function, str]] | None = None
) -> tuple[Function, str] | None:
    if depth > 32:
        return None
    if reached is not None:
        reached.append((depth, fn, "/".join(parts)))
    for k in range(len(parts), 0, -1):  # node names hold "/": the longest that is a node
        name = "/".join(parts[:k])
        if name not in fn.nodes:
            continue
        if k == len(parts):
            return fn, name
        targets = fn.calls.get(name)
        if not targets:
            continue
        rest = parts[k:]
        keys: tuple[str, ...] = ("f",)
        if len(rest) > 2 and rest[0] in _BRANCHES and _BRANCH_INDEX.match(rest[1]):
            keys, rest = _BRANCHES[rest[0]], rest[2:]
        for key in (*keys, *(k for k in targets if k not in keys)):
            for sub in targets.get(key, ()):
                inner = function(sub)
                found = _walk(inner, rest, depth + 1, reached) if inner is not None else None
                if found is not None:
                    return found
    return None


def tree(top: Function) -> dict[str, Function]:
    """Every node of `top` and of the functions it calls, to the function that holds it (a while loop's gradient
    names forward ops of the loop's body, another function)."""
    if top._tree is None:
        nodes: dict[str, Function] = {}
        seen, todo = {top.name}, [top]
        while todo:
            fn = todo.pop()
            for node in fn.nodes:
                nodes.setdefault(node, fn)
            for targets in fn.calls.values():
                for names in targets.values():
                    for name in names:
                        if name not in seen and len(seen) < 256:
                            seen.add(name)
                            inner = function(name)
                            if inner is not None:
                                todo.append(inner)
        top._tree = nodes
    return top._tree


def forward_of(fn: Function, node: str, top: Function) -> tuple[Function, str] | None:
    """The forward op a gradient op was made for: `.../gradients/<X>_grad/...` names X (TensorFlow's symbolic
    gradients, inside a while loop's gradient), `gradient_tape/<X>/<grad op>` names X (GradientTape, which makes a
    gradient under the forward op's name scope; the longest such node)."""
    parts = node.split("/")
    for i in range(len(parts) - 1, 0, -1):
        if parts[i].endswith("_grad") and len(parts[i]) > 5:
            start = max((j + 1 for j in range(i) if parts[j] == "gradients"), default=0)
            name = "/".join([*parts[start:i], parts[i][:-5]])
            holder = tree(top).get(name)
            if holder is not None:
                return holder, name
    if parts[0] == "gradient_tape":
        rest = parts[1:]
        for k in range(len(rest) - 1, 0, -1):
            name = "/".join(rest[:k])
            if name in fn.nodes:
                return fn, name
    return None


# ---- lines of code ------------------------------------------------------------------------------------------


def note_cell_body(before: set[str], number: int | None) -> None:
    """The files IPython compiled for a `%%tfmem` body since `before` (cell_numbers' keys) are the cell `number`'s,
    below its magic's line: IPython numbers the body as the next cell (it runs it as a cell of its own)."""
    if number is None:
        return
    for file in set(cell_numbers()) - before:
        SESSION.cell_bodies[file] = (number, 1)
    while len(SESSION.cell_bodies) > 1000:
        SESSION.cell_bodies.pop(next(iter(SESSION.cell_bodies)))


def cell_numbers() -> dict[str, int]:
    """IPython's map of each cell's file to its execution count (`shell.compile._filename_map`, private: without
    it a cell is named by its file), read from a running shell only: nothing is imported."""
    ipython = sys.modules.get("IPython")
    get = getattr(ipython, "get_ipython", None)
    shell = get() if callable(get) else None
    found = getattr(getattr(shell, "compile", None), "_filename_map", None)
    return found if isinstance(found, dict) else {}


class Resolver:
    """One cell's lines: the layers of its models, its cells' numbers, what each node resolved to."""

    def __init__(self, layers: dict[str, LayerRecord], cells: dict[str, int] | None = None) -> None:
        self.layers = layers
        self.cells = cell_numbers() if cells is None else cells
        self._sites: dict[tuple[str, int], Site] = {}

    def site(self, file: str, line: int) -> Site:
        key = (file, line)
        found = self._sites.get(key)
        if found is None:
            body = SESSION.cell_bodies.get(file)
            number = self.cells.get(file) if body is None else body[0]
            match = _INPUT_CELL.match(file) if number is None else None
            if match:
                number = int(match.group(1))
            shown = line + (body[1] if body is not None else 0)  # a `%%tfmem` body's line, as the cell shows it
            label = f"In [{number}] line {shown}" if number is not None else f"{os.path.basename(file)}:{line}"
            code = " ".join(linecache.getline(file, line).split())
            found = self._sites[key] = Site(file, line, label, code[:MAX_CODE])
        return found

    def _layer(self, layer_name: str | None) -> tuple[LayerRecord | None, Site | None]:
        """The layer of that name, and the line that made it where it was noted."""
        layer = self.layers.get(layer_name) if layer_name is not None else None
        return layer, self.site(*layer.made_at) if layer is not None and layer.made_at is not None else None

    def line_of(self, fn: Function, node: str, layer_name: str | None) -> LineOf:
        """What made the node's tensors (see the module's docstring)."""
        layer, made_by = self._layer(layer_name)
        if layer is not None and layer.builtin and made_by is not None:
            return LineOf(LINE, made_by, made_by, layer_name)  # whatever its stack: no line of the user's inside
        user, entry = fn.user_frame(node)
        if layer_name is not None and (entry or user is None or (layer is not None and layer.builtin)):
            # a layer's ops with no line of the user's inside the layer: the line that made it
            if made_by is not None:
                return LineOf(LINE, made_by, made_by, layer_name)
            return LineOf(LAYER, None, None, layer_name)
        if user is None or entry:
            return LineOf(KERAS)
        return LineOf(LINE, self.site(*user), made_by, layer_name)

    def eager_line(self, file: str, line: int, layer_name: str | None) -> LineOf:
        """An eager op's line, as its op callback recorded the user's frame that ran it; inside a layer's eager
        call, the line that made the layer beside it."""
        _, made_by = self._layer(layer_name)
        return LineOf(LINE, self.site(file, line), made_by, layer_name)

    def layer_only(self, layer_name: str) -> LineOf:
        """A layer's tensor whose op was not found: a built-in layer's is named by the line that made the layer
        (as when it is found), a custom layer's only by its layer."""
        layer, made_by = self._layer(layer_name)
        if layer is not None and layer.builtin and made_by is not None:
            return LineOf(LINE, made_by, made_by, layer_name)
        return LineOf(LAYER, None, made_by, layer_name)

    def layer_line(self, layer_name: str) -> LineOf:
        """A layer's tensor by the line that made the layer, built-in or custom (where its op's own line cannot be
        read: `made_line`); a layer whose line was not noted is named by the layer alone."""
        _, made_by = self._layer(layer_name)
        if made_by is not None:
            return LineOf(LINE, made_by, made_by, layer_name)
        return LineOf(LAYER, None, None, layer_name)

    def gradient_line(self, fn: Function, node: str, layer_name: str | None, top: Function) -> LineOf:
        """A gradient op's line: its forward op's; else the one line of the forward ops in its scope; else its own
        (the `tape.gradient` line of a custom step)."""
        forward = forward_of(fn, node, top)
        if forward is not None:
            return self.line_of(*forward, layer_name)
        one = self.scope_line(fn, node, layer_name) if node.startswith("gradient_tape/") else None
        return one if one is not None else self.line_of(fn, node, layer_name)

    def scope_line(self, fn: Function, node: str, layer_name: str | None) -> LineOf | None:
        """The one line of the (forward) nodes in the node's name scope, where they have one: for a node the graph
        optimizer made, which no function's def holds (`square_1/ReplaceMulWithSquare_mul`, a rewrite of
        `square_1/mul`; a fused op named anew), and for a gradient made under its forward op's scope. None where the
        scope holds several lines, or no node."""
        # grappler puts what it makes in a scope of its own inside the original's: `.../ArithmeticOptimizer/...`
        parts = [p for p in node.split("/") if not p.endswith(GRAPPLER_SCOPES)]
        if parts and parts[0] == "gradient_tape":
            parts = parts[1:]
        if len(parts) < 2:
            return None
        scope = "/".join(parts[:-1]) + "/"
        if scope not in fn.scopes:
            members = [n for n in fn.nodes if n.startswith(scope)][:MAX_SCOPE_NODES]
            found = {self.line_of(fn, n, layer_name) for n in members}
            fn.scopes[scope] = found.pop() if len(found) == 1 else None
        return fn.scopes[scope]


def layer_table(models: Iterable[KerasModel]) -> dict[str, LayerRecord]:
    """Layer name -> the line that made it and whether Keras defines its class, for every layer of `models`."""
    table: dict[str, LayerRecord] = {}
    for model in models:
        try:
            layers = all_layers(model, include_self=True)
        except Exception as exc:  # noqa: BLE001 - a model mid-construction: its layers go unnamed
            fallback(_log, "a model's layers could not be walked for their lines", exc)
            continue
        for layer in layers:
            name = getattr(layer, "name", None)
            if not isinstance(name, str) or name in table:
                continue
            module = (getattr(type(layer), "__module__", "") or "").split(".")[0]
            bare = kerases.flavour_of(layer) == kerases.TF_KERAS
            table[name] = LayerRecord(code_sites.site_of(layer), module in ("keras", "tf_keras"), bare)
    return table


# ---- grouping ---------------------------------------------------------------------------------------------------


@dataclass
class _Group:
    of: LineOf
    bytes: int = 0
    requested: int = 0
    forward: int = 0
    backward: int = 0
    count: int = 0
    layers: list[str] = field(default_factory=list)
    tensors: list[LineTensor] = field(default_factory=list)


@dataclass
class ByLine:
    groups: list[LineGroup]
    named_bytes: int
    note: str | None


class _Runs:
    """The function runs of the trace, to tell which function was running when an allocation was made."""

    def __init__(self, spans: Iterable[Span], others: Sequence[str] = ()) -> None:
        runs = sorted(
            (s.start_ps, s.end_ps, s.name[len(FUNCTION_SPAN) :]) for s in spans if s.name.startswith(FUNCTION_SPAN)
        )
        self.starts = [r[0] for r in runs]
        self.runs = runs
        # where to look for an op outside every run: the functions that ran, latest first, then the others
        self.names = list(dict.fromkeys([*(r[2] for r in reversed(runs)), *others]))

    def running(self, t_ps: int) -> list[str]:
        """The functions whose run holds time t (the innermost last started first)."""
        i = bisect.bisect_right(self.starts, t_ps)
        found = [name for start, end, name in self.runs[max(0, i - 64) : i] if start <= t_ps <= end]
        return list(dict.fromkeys(reversed(found)))


class EagerAllocation(NamedTuple):
    """An allocation of the trace made by an eager op (an op type alone, outside every function run)."""

    event: int  # the event's index in the trace
    window: int  # the trace segment it is in (Tracer.windows)
    op: str
    requested: int
    t_ps: int


_ONEDNN_PREFIX = re.compile(r"^_Mkl(?:Native)?(?=[A-Z])")


def eager_op_type(name: str) -> str:
    """The op type an eager allocation's op ran as, as its op callback saw it: oneDNN's layout pass runs an eager
    `MatMul` as `_MklMatMul` (or `_MklNative...`), the name the trace keeps."""
    return _ONEDNN_PREFIX.sub("", name)


def match_eager(
    peak: Iterable[int], allocations: Sequence[EagerAllocation], ops: EagerOps
) -> dict[int, EagerMade | str]:
    """The line of each of the peak's eager allocations (`peak`: their event indices), from the ops the op
    callback recorded while the trace recorded (measure/eager_ops.py), or why it has none.

    Within one trace segment, the trace's allocations of one op type and size (`allocations`, in time order) are
    paired with the recorded outputs of that op type and size, in the order they ran, where they are as many: the
    k-th allocation is the k-th output. Where the trace holds fewer (an output that reused its input's buffer) and
    every recorded one is of one line, that line. Else none is named: never a line that only might be it. A pair
    whose allocation the trace places after the op's callback ran (beyond the clocks' slack) says the order is off:
    none of that op type and size is named."""
    wanted = set(peak)
    keys: dict[int, tuple[int, str, int]] = {a.event: (a.window, a.op, a.requested) for a in allocations}
    want_keys = {keys[i] for i in wanted if i in keys}
    found: dict[tuple[int, str, int], list[EagerAllocation]] = {}
    for a in allocations:
        key = (a.window, a.op, a.requested)
        if key in want_keys:
            found.setdefault(key, []).append(a)
    recorded: dict[tuple[int, str, int], list[tuple[int, EagerMade | None]]] = {}
    op_types = {k[1] for k in want_keys}
    for op in ops.ops:
        if op.op not in op_types:
            continue
        made = (op.file, op.line, op.keras) if op.file is not None else None
        t_ps = int((op.t - ops.t0) * PS_PER_S)
        for shape, dtype in op.outputs:
            size = eager_ops.output_bytes(shape, dtype)
            key = (op.segment, op.op, size or 0)
            if size and key in want_keys:
                recorded.setdefault(key, []).append((t_ps, made))
    out: dict[int, EagerMade | str] = {}
    for key in want_keys:
        window, op_type, size = key
        allocated, ran = found.get(key, []), recorded.get(key, [])
        if size < eager_ops.MIN_NOTED_BYTES:
            why: str | None = TOO_SMALL
        elif ops.full_from is not None and window >= ops.full_from:
            why = f"more than {eager_ops.MAX_OPS:,} eager ops ran while the trace recorded"
        elif ops.failed is not None:
            why = f"the op callback failed ({ops.failed})"
        elif not ran:
            why = NOT_NOTED
        elif len(ran) == len(allocated):
            late = any(a.t_ps > t + EAGER_SLACK_PS for a, (t, _) in zip(allocated, ran, strict=True))
            why = OUT_OF_ORDER if late else None
        elif len(allocated) < len(ran) and len({m for _, m in ran}) == 1:
            why, ran = None, [ran[0]] * len(allocated)
        else:
            why = NOT_ONE_TO_ONE
        for a, (_, made) in zip(allocated, ran if why is None else [(0, None)] * len(allocated), strict=True):
            if a.event in wanted:
                out[a.event] = why or (made if made is not None else NO_USER_FRAME)
    return out


def by_line(
    rows: Sequence[TracedTensor],
    spans: Iterable[Span],
    resolver: Resolver,
    top: int,
    others: Sequence[str] = (),
    resolve: Callable[[TracedTensor], LineOf] | None = None,
) -> ByLine:
    """The rows grouped by what made them (see the module's docstring): the `top` largest groups. `others`: the
    functions to look in (after those the trace saw run) for an op outside every run the trace kept. `resolve`: what
    made a row where its functions are not in this process (a pre-flight probe's step: `made_line`)."""
    runs = _Runs(spans, others)
    resolved: dict[tuple[str | None, str | None, str | None, tuple[str, ...], EagerMade | str | None], LineOf] = {}
    groups: dict[tuple[object, ...], _Group] = {}
    unmatched: dict[str, tuple[int, list[str]]] = {}  # why eager ops were not named -> their bytes, op types
    for row in rows:
        running = tuple(runs.running(row.t_ps)) if row.path is not None else ()
        key = (row.path, row.layer, row.hint, running, row.eager)
        of = resolved.get(key)
        if of is None:
            of = resolved[key] = resolve(row) if resolve is not None else _resolve(row, running, runs, resolver)
        if of.kind == LINE and of.site is not None:
            made = of.made_by
            gkey: tuple[object, ...] = (
                LINE,
                of.site.file,
                of.site.line,
                made.file if made else None,
                made.line if made else None,
            )
        else:
            gkey = (of.kind, of.layer if of.kind == LAYER else None)
        if of.kind == EAGER:
            why = row.eager if isinstance(row.eager, str) else NO_CALLBACK
            size, names = unmatched.setdefault(why, (0, []))
            unmatched[why] = (size + row.chunk, names if row.op in names else [*names, row.op])
        group = groups.setdefault(gkey, _Group(of))
        group.bytes += row.chunk
        group.requested += row.requested
        group.count += 1
        if row.phase == "forward":
            group.forward += row.chunk
        elif row.phase == "backward":
            group.backward += row.chunk
        if of.layer is not None and of.layer not in group.layers:
            group.layers.append(of.layer)
        group.tensors.append(LineTensor(row.chunk, row.shape, row.dtype, row.op, row.phase))
        if len(group.tensors) > 4 * MAX_TENSORS:
            group.tensors = sorted(group.tensors, key=lambda t: -t.bytes)[:MAX_TENSORS]
    ordered = sorted(groups.values(), key=lambda g: -g.bytes)
    out = [_line_group(g) for g in ordered[:top]]
    named = sum(g.bytes for g in groups.values() if g.of.kind == LINE)
    return ByLine(out, named, _note(groups.values(), named, unmatched))


def _what_it_is(row: TracedTensor) -> LineOf | None:
    """What a tensor is where no function can name it: XLA's, the input pipeline's, untagged, a function's own
    runtime allocation; None for an op's tensor (a node path, or an op type alone)."""
    if row.hint == HINT_XLA:
        return LineOf(XLA)
    if row.hint == HINT_INPUT:
        return LineOf(INPUT)
    if row.path is None:
        return LineOf(UNTAGGED)
    if row.path.startswith("__inference_"):
        # tagged with a function's own name, no node: what the runtime allocates for the function as a whole (a
        # constant grappler folded, measured: a `tf.ones` of a train step), not one of its ops
        return LineOf(FUNCTION)
    return None


def _resolve(row: TracedTensor, running: tuple[str, ...], runs: _Runs, resolver: Resolver) -> LineOf:
    known = _what_it_is(row)
    if known is not None:
        return known
    assert row.path is not None  # an untagged tensor is known as one
    # the function running at the time; a node path outside every run (the trace's segments start and stop
    # inside steps, and a run's event is kept only by the segment it ends in) is looked for in the functions that
    # ran, latest first, then in those the cell traced and its models hold. An op type with no path outside every
    # run is an eager op's, unless no eager op of its type and size ran (the op callback noted none): then it is a
    # function's node of that name whose run the trace lost (tf_keras' train function has top-level nodes such as
    # `Tile`: docs/lines.md, "tf_keras' graph names")
    candidates = list(running)
    if not candidates and ("/" in row.path or row.eager == NOT_NOTED):
        candidates = runs.names
    deepest: tuple[int, Function, str] | None = None  # where the path's node would be, had the function one
    for name in candidates:
        top = function(name)
        if top is None:
            continue
        reached: list[tuple[int, Function, str]] = []
        found = walk(top, row.path, reached)
        if found is None:
            # the function that holds the longest matched part of the path, in the first candidate that has one
            inner = max(reached, key=lambda r: (r[0], -len(r[2])))
            if deepest is None and inner[2] != row.path:
                deepest = inner
            continue
        fn, node = found
        if row.phase == "backward" or (row.phase == "workspace" and node.startswith("gradient_tape/")):
            return resolver.gradient_line(fn, node, row.layer, top)
        return resolver.line_of(fn, node, row.layer)
    if "/" not in row.path:  # an op type alone, found in no function that was running: an eager op's
        if isinstance(row.eager, tuple):  # matched to the op its callback recorded (match_eager)
            file, line, under_keras = row.eager
            return LineOf(KERAS) if under_keras else resolver.eager_line(file, line, row.layer)
        return LineOf(EAGER)
    if deepest is not None:
        one = resolver.scope_line(deepest[1], deepest[2], row.layer)
        if one is not None:
            return one
    # a graph op whose function is gone (the initializers of variables, a first trace's function): what its path
    # says it is, still never a line it cannot show
    if row.phase == "optimizer":
        return LineOf(KERAS)
    if row.layer is not None:
        return resolver.layer_only(row.layer)
    return LineOf(UNRESOLVED)


def made_line(row: TracedTensor, resolver: Resolver, keras_step: bool) -> LineOf:
    """What made a tensor of a step that ran in another process (the pre-flight's probes: their functions and
    stacks are not here), from its attribution alone: a layer's tensor by the line that made the layer (a custom
    layer's too: the line in its `call` is not known), the rest by what it is, never a guessed line. `keras_step`:
    the probes ran Keras' own step (a clone's fit), where a graph op outside every layer is Keras' (its loss,
    metrics, optimizer); in a step of the model's own such an op may be the user's code, and is `unresolved`."""
    known = _what_it_is(row)
    if known is not None:
        return known
    assert row.path is not None  # an untagged tensor is known as one
    if "/" not in row.path:  # an op type alone: an eager op of the probe's (the weights and slots it built)
        return LineOf(EAGER)
    if row.layer is not None:
        return resolver.layer_line(row.layer)
    return LineOf(KERAS) if keras_step or row.phase == "optimizer" else LineOf(UNRESOLVED)


def _line_group(g: _Group) -> LineGroup:
    of = g.of
    site, made = of.site, of.made_by
    if of.kind == LINE and site is not None:
        label, code, file, line = site.label, site.code or None, site.file, site.line
    elif of.kind == LAYER:
        label, code, file, line = f"layer {of.layer}", None, None, None
    else:
        label, code, file, line = LABELS.get(of.kind, of.kind), None, None, None
    names = g.layers[:3] + ([f"+{len(g.layers) - 3} more"] if len(g.layers) > 3 else [])
    return LineGroup(
        label=label,
        kind=of.kind,
        code=code,
        file=file,
        line=line,
        bytes=g.bytes,
        requested_bytes=g.requested,
        forward_bytes=g.forward,
        backward_bytes=g.backward,
        count=g.count,
        layer=", ".join(names) or None,
        made_by=made.label if made is not None else None,
        made_by_code=(made.code or None) if made is not None else None,
        tensors=sorted(g.tensors, key=lambda t: -t.bytes)[:MAX_TENSORS],
    )


def _note(
    groups: Iterable[_Group], named: int, unmatched: dict[str, tuple[int, list[str]]] | None = None
) -> str | None:
    """What the view could not name, in bytes: the kinds that have no line yet, and why (`unmatched`: why eager
    ops were not matched to a noted op, with their bytes and op types)."""
    by_kind: dict[str, int] = {}
    for g in groups:
        by_kind[g.of.kind] = by_kind.get(g.of.kind, 0) + g.bytes
    total = sum(by_kind.values())
    if not total:
        return None
    said = f"{format_bytes(named)} of the {format_bytes(total)} traced at the peak named by a line of code"
    reasons = sorted((unmatched or {}).items(), key=lambda kv: -kv[1][0])
    eager_why = "; ".join(
        f"{', '.join(names[:3])}{', ...' if len(names) > 3 else ''}: {reason}" for reason, (_, names) in reasons[:2]
    ) + ("; ..." if len(reasons) > 2 else "")
    why = {
        EAGER: eager_why or NO_CALLBACK,
        XLA: "XLA allocates its buffers without op names",
        UNRESOLVED: "their function no longer exists",
        LAYER: "made before tfmem was loaded, or a custom layer's op not found",
    }
    rest = [
        f"{LABELS.get(kind, 'layers without a line')} {format_bytes(by_kind[kind])}"
        + (f" ({why[kind]})" if kind in why else "")
        for kind in (KERAS, INPUT, EAGER, XLA, FUNCTION, LAYER, UNRESOLVED, UNTAGGED)
        if by_kind.get(kind)
    ]
    return said + (f"; not by a line: {', '.join(rest)}" if rest else "") + "."


def concrete_functions(models: Iterable[KerasModel]) -> list[TFFunction]:
    """The concrete functions the models' train, test and predict functions hold (Keras 3 keeps tf.functions in the
    closure of a plain function; tf_keras' is a tf.function). Read from the functions' caches (private: listing them
    must never trace)."""
    found: list[TFFunction] = []
    for model in models:
        for attribute in ("train_function", "test_function", "predict_function"):
            todo, seen = [getattr(model, attribute, None)], 0
            while todo and seen < 16:
                value = todo.pop()
                seen += 1
                cache = getattr(value, "_function_cache", None)
                if cache is not None and hasattr(cache, "values"):
                    found.extend(list(cache.values()))
                    continue
                for cell in getattr(value, "__closure__", None) or ():
                    try:
                        contents = cell.cell_contents
                    except ValueError:  # an empty cell
                        continue
                    if callable(contents):
                        todo.append(contents)
    return found


def graphs_of(functions: Iterable[TFFunction]) -> dict[str, weakref.ref[TFGraph]]:
    """Each concrete function's op name -> its graph (weakly: the view never keeps a graph alive)."""
    out: dict[str, weakref.ref[TFGraph]] = {}
    for concrete in functions:
        try:
            name, graph = concrete.name, concrete.graph
            out[name.decode() if isinstance(name, bytes) else str(name)] = weakref.ref(graph)
        except (AttributeError, TypeError):  # not a ConcreteFunction, or its graph is gone
            continue
    return out


def resolve_cell(
    rows: Sequence[TracedTensor],
    spans: Iterable[Span],
    models: Sequence[KerasModel],
    top: int,
    traced: Sequence[TFFunction] = (),
) -> ByLine | None:
    """The by-line view of one cell's peak, or None where TensorFlow's stacks cannot be read (capabilities.py) or
    the resolution failed (a fallback: the rest of the report stands). `traced`: the concrete functions the cell
    traced (still alive), latest last."""
    if "tensorflow" not in sys.modules:
        return None
    from tfmem_magic.measure import capabilities

    if not capabilities.check().get("lines of code", False):
        return None
    try:
        graphs = graphs_of(reversed(traced))  # the latest first, then the models' own
        graphs.update((k, v) for k, v in graphs_of(concrete_functions(models)).items() if k not in graphs)
        _GRAPHS.clear()
        _GRAPHS.update(graphs)
        return by_line(rows, spans, Resolver(layer_table(models)), top, list(graphs))
    except Exception as exc:  # noqa: BLE001 - the by-line view is one view of the peak: the others stand without it
        fallback(_log, "the by-line view could not be made", exc)
        return None
    finally:
        _GRAPHS.clear()


# ---- the line of an OOM's failing request ---------------------------------------------------------------------


def error_site(
    exc: BaseException, request: dict[str, Any] | None, models: Sequence[KerasModel] = ()
) -> ErrorSite | None:
    """The line of the user's code that made an OOM's failing request (ErrorInfo.site, docs/lines.md): a graph op's
    from the stack TensorFlow kept for its node (the node path the error names, looked for in the function the
    error names and the functions it calls), as the by-line view names a tensor's; else (an eager op, a node not
    found) the innermost frame of the user's code in the error's traceback. None where neither is the user's, or a
    fallback."""
    try:
        resolver = Resolver(layer_table(models))
        found = _node_site(request, resolver, models) if request else None
        if found is not None:
            return found
        frame = traceback_frame(exc.__traceback__)
        if frame is None:
            return None
        site = resolver.site(*frame)
        return ErrorSite(site.label, site.code or None, site.file, site.line, via="traceback")
    except Exception as exc2:  # noqa: BLE001 - the line is one detail of the error: the report stands without it
        fallback(_log, "the line of the failing request could not be found", exc2)
        return None


def traceback_frame(tb: TracebackType | None) -> tuple[str, int] | None:
    """(file, line) of the innermost frame of the user's code in a traceback (code_sites.is_user_file)."""
    found = None
    while tb is not None:
        file = tb.tb_frame.f_code.co_filename
        if code_sites.is_user_file(file):
            found = (file, tb.tb_lineno)
        tb = tb.tb_next
    return found


def _node_site(request: dict[str, Any], resolver: Resolver, models: Sequence[KerasModel]) -> ErrorSite | None:
    """The failing graph node's line: the node is found in the function the error names (`request["function"]`,
    parsed by measure/guard.parse_oom) or in a function it calls (the error names a node of the innermost one)."""
    name, node = request.get("function"), request.get("op")
    if not name or not node or "tensorflow" not in sys.modules:
        return None
    from tfmem_magic.measure import capabilities

    if not capabilities.check().get("lines of code", False):
        return None
    _GRAPHS.clear()
    _GRAPHS.update(graphs_of(concrete_functions(models)))
    try:
        top = function(str(name))
        if top is None:
            return None
        found = walk(top, str(node))
        if found is None:
            holder = tree(top).get(str(node))
            found = (holder, str(node)) if holder is not None else None
        if found is None:
            return None
        fn, op = found
        layer_name = next(
            (
                name
                for scope in reversed(op.split("/")[:-1])
                for name in (scope, _SCOPE_SUFFIX.sub("", scope))
                if name in resolver.layers
            ),
            None,
        )
        backward = op.startswith("gradient_tape/") or "/gradients/" in f"/{op}"
        of = resolver.gradient_line(fn, op, layer_name, top) if backward else resolver.line_of(fn, op, layer_name)
    finally:
        _GRAPHS.clear()
    if of.kind != LINE or of.site is None:
        return None
    made = of.made_by
    return ErrorSite(
        of.site.label,
        of.site.code or None,
        of.site.file,
        of.site.line,
        via="graph node",
        layer=of.layer,
        made_by=made.label if made is not None else None,
    )

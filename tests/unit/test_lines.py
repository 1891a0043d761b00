"""The by-line view's resolution (analyze/lines.py) on functions made by hand: node paths walked down calls, while
bodies and branches; the user's frame; built-in and custom layers; gradients; what no line made. No TensorFlow:
the functions stand in for what the eager context returns (a FunctionDef's nodes, a GraphDebugInfo's stacks)."""

from __future__ import annotations

import linecache
from collections import OrderedDict
from types import SimpleNamespace

import pytest

from tfmem_magic.analyze import lines
from tfmem_magic.core.report import LineGroup, TraceInfo
from tfmem_magic.core.sizes import format_bytes
from tfmem_magic.measure import code_sites
from tfmem_magic.measure.xplane import FUNCTION_SPAN, Span
from tfmem_magic.show.render import by_line_text

CELL_CLASS = "/tmp/ipykernel_7/1111.py"  # In [2]: a custom layer's class and a custom train step
CELL_MODEL = "/tmp/ipykernel_7/2222.py"  # In [3]: the model
CELL_FIT = "/tmp/ipykernel_7/3333.py"  # In [4]: the fit
KERAS = "/venv/lib/python3.11/site-packages/keras/src/"
SOURCES = {
    CELL_CLASS: [
        "class Wide(keras.layers.Layer):",
        "    def call(self, x):",
        "        return keras.ops.matmul(x, self.w)",
        "def train_step(self, data):",
        "    scratch = tf.tile(big, [16, 1])",
    ],
    CELL_MODEL: ["model = keras.Sequential([", "    Wide(),", "    keras.layers.Dense(4096),", "])"],
    CELL_FIT: ["model.fit(x, y, batch_size=256)"],
}
CELLS = {CELL_CLASS: 2, CELL_MODEL: 3, CELL_FIT: 4}


class Attr:
    def __init__(self, *functions: str) -> None:
        self.func = SimpleNamespace(name=functions[0]) if len(functions) == 1 else None
        self.list = SimpleNamespace(func=[SimpleNamespace(name=f) for f in functions] if len(functions) > 1 else [])

    def HasField(self, name: str) -> bool:  # noqa: N802 - the protobuf method it stands in for
        return (name == "func" and self.func is not None) or (name == "list" and bool(self.list.func))


def make_function(name: str, nodes: dict[str, dict[str, Attr]], stacks: dict[str, list[tuple[str, int, str]]]):
    """A lines.Function over nodes (name -> call attributes) and stacks (name -> frames, outermost first)."""
    fdef = SimpleNamespace(node_def=[SimpleNamespace(name=n, attr=a) for n, a in nodes.items()])
    files = sorted({f for frames in stacks.values() for f, _, _ in frames})
    frames_by_id, traces_by_id, name_to_trace_id = {}, {}, {}
    for trace_id, (node, frames) in enumerate(stacks.items()):
        ids = []
        for file, line, func in frames:
            frame_id = len(frames_by_id)
            frames_by_id[frame_id] = SimpleNamespace(file_index=files.index(file), line=line, func=func)
            ids.append(frame_id)
        traces_by_id[trace_id] = SimpleNamespace(file_line_cols=[], frame_id=ids)
        name_to_trace_id[node] = trace_id
    info = SimpleNamespace(
        files=files, frames_by_id=frames_by_id, traces_by_id=traces_by_id, name_to_trace_id=name_to_trace_id
    )
    return lines.Function(name, fdef, lambda: info)


FIT_FRAMES = [(CELL_FIT, 1, "<module>"), (KERAS + "backend/tensorflow/trainer.py", 399, "fit")]
LAYER_CALL = (KERAS + "layers/layer.py", 1002, "__call__")


@pytest.fixture
def functions(monkeypatch):
    """The outer step (multi_step) calls the inner one (one_step), which holds a while loop; every stack starts
    at the fit line of In [4]."""
    inner_nodes = {
        "sequential_1/wide_1/MatMul": {},
        "sequential_1/dense_1/MatMul": {},
        "sequential_1/dense_1/BiasAdd": {},
        "gradient_tape/sequential_1/wide_1/MatMul/MatMul": {},
        "gradient_tape/sequential_1/dense_1/MatMul/MatMul_1": {},
        "Tile": {},
        "sgd/Mul": {},
        "loop/while": {"body": Attr("body_fn"), "cond": Attr("cond_fn")},
    }
    inner_stacks = {
        "sequential_1/wide_1/MatMul": [
            *FIT_FRAMES,
            LAYER_CALL,
            (CELL_CLASS, 3, "call"),
            (KERAS + "ops/numpy.py", 5114, "matmul"),
        ],
        "sequential_1/dense_1/MatMul": [*FIT_FRAMES, LAYER_CALL, (KERAS + "layers/core/dense.py", 222, "call")],
        "sequential_1/dense_1/BiasAdd": [*FIT_FRAMES, LAYER_CALL, (KERAS + "layers/core/dense.py", 230, "call")],
        "gradient_tape/sequential_1/wide_1/MatMul/MatMul": [*FIT_FRAMES],
        "gradient_tape/sequential_1/dense_1/MatMul/MatMul_1": [*FIT_FRAMES],
        "Tile": [*FIT_FRAMES, (KERAS + "trainers/trainer.py", 50, "train_step"), (CELL_CLASS, 5, "train_step")],
        "sgd/Mul": [*FIT_FRAMES, (KERAS + "optimizers/sgd.py", 70, "update_step")],
    }
    body_nodes = {"loop/while/Tile": {}}
    body_stacks = {"loop/while/Tile": [*FIT_FRAMES, (CELL_CLASS, 5, "train_step")]}
    made = {
        "outer": make_function("outer", {"StatefulPartitionedCall": {"f": Attr("inner")}, "Identity": {}}, {}),
        "inner": make_function("inner", inner_nodes, inner_stacks),
        "body_fn": make_function("body_fn", body_nodes, body_stacks),
        "cond_fn": make_function("cond_fn", {"Less": {}}, {}),
    }
    cache: OrderedDict[str, lines.Function | None] = OrderedDict(made)
    monkeypatch.setattr(lines, "_FUNCTIONS", cache)  # a name missing from it would be asked of TensorFlow
    for file, text in SOURCES.items():
        monkeypatch.setitem(linecache.cache, file, (1, None, [t + "\n" for t in text], file))
    return cache


@pytest.fixture
def resolver():
    layers = {
        "wide": lines.LayerRecord((CELL_MODEL, 2), builtin=False),
        "dense": lines.LayerRecord((CELL_MODEL, 3), builtin=True),
        "dense_old": lines.LayerRecord(None, builtin=True),  # made before tfmem was loaded
    }
    return lines.Resolver(layers, cells=CELLS)


def test_a_node_path_is_walked_down_calls_and_a_while_loops_body(functions):
    outer = functions["outer"]
    fn, node = lines.walk(outer, "StatefulPartitionedCall/sequential_1/wide_1/MatMul")
    assert fn.name == "inner" and node == "sequential_1/wide_1/MatMul"
    fn, node = lines.walk(outer, "StatefulPartitionedCall/loop/while/body/_12/loop/while/Tile")
    assert fn.name == "body_fn" and node == "loop/while/Tile"
    assert lines.walk(outer, "StatefulPartitionedCall/loop/while/cond/_11/Less")[0].name == "cond_fn"
    assert lines.walk(outer, "StatefulPartitionedCall/no/such/node") is None
    assert lines.walk(outer, "Identity") == (outer, "Identity")


def test_the_user_frame_is_the_innermost_outside_the_libraries(functions):
    inner = functions["inner"]
    assert inner.user_frame("sequential_1/wide_1/MatMul") == ((CELL_CLASS, 3), False)
    # a built-in layer's op: its innermost user frame is the fit line, which called Keras' fit
    assert inner.user_frame("sequential_1/dense_1/MatMul") == ((CELL_FIT, 1), True)
    assert inner.user_frame("no such node") == (None, False)
    assert code_sites.is_user_file(CELL_CLASS) and not code_sites.is_user_file(KERAS + "layers/layer.py")
    assert code_sites.is_user_file("<ipython-input-3-abc>") and not code_sites.is_user_file("<frozen runpy>")


def test_gradients_map_to_their_forward_op(functions):
    inner, outer = functions["inner"], functions["outer"]
    assert lines.forward_of(inner, "gradient_tape/sequential_1/wide_1/MatMul/MatMul", outer) == (
        inner,
        "sequential_1/wide_1/MatMul",
    )
    # a while loop's gradient (symbolic gradients): X_grad names a forward op of another function, the loop's body
    grad = (
        "gradient_tape/loop/while/loop/while_grad/body/_5/gradient_tape/loop/while/gradients/loop/while/Tile_grad/Sum"
    )
    assert lines.forward_of(inner, grad.split("body/_5/")[1], outer) == (functions["body_fn"], "loop/while/Tile")


def row(path, layer=None, phase="forward", chunk=1000, shape="[256,8192]", hint=None, t_ps=50):
    return lines.TracedTensor(
        path, (path or "?").rsplit("/", 1)[-1], layer, phase, "float32", shape, chunk, chunk, t_ps, hint
    )


RUN = [Span(FUNCTION_SPAN + "outer", 0, 100, "main")]


def by_kind(groups: list[LineGroup]) -> dict[str, list[LineGroup]]:
    out: dict[str, list[LineGroup]] = {}
    for g in groups:
        out.setdefault(g.kind, []).append(g)
    return out


def test_each_tensor_is_named_by_its_line_or_by_what_it_is(functions, resolver):
    p = "StatefulPartitionedCall/"
    rows = [
        row(p + "sequential_1/wide_1/MatMul", "wide", chunk=8 << 20),  # a custom layer's call line
        row(p + "gradient_tape/sequential_1/wide_1/MatMul/MatMul", "wide", "backward", 2 << 20),
        row(p + "sequential_1/dense_1/MatMul", "dense", chunk=4 << 20),  # a built-in layer: the line that made it
        row(p + "gradient_tape/sequential_1/dense_1/MatMul/MatMul_1", "dense", "backward", 1 << 20),
        row(p + "Tile", chunk=64 << 20, shape="[16384,1024]"),  # a custom train step's line
        row(p + "loop/while/body/_3/loop/while/Tile", chunk=3 << 20),
        row(p + "sgd/Mul", phase="optimizer", chunk=5 << 20),  # Keras' own step
        row("GatherV2", phase="input", hint=lines.HINT_INPUT, chunk=7000),
        row("RandomStandardNormal", chunk=6 << 20, t_ps=500),  # an eager op: no run holds it
        row(None, chunk=256, t_ps=500),
        row("__inference_one_step_on_data_12", chunk=4 << 10),  # the function's own: a folded constant
        row("XLA computation", chunk=9 << 20, hint=lines.HINT_XLA),
        row(p + "sequential_1/gone_1/MatMul", chunk=4096, t_ps=500),  # outside every run, in no function
        row(p + "sequential_1/dense_old_1/MatMul", "dense_old", chunk=2048, t_ps=500),
    ]
    result = lines.by_line(rows, RUN, resolver, top=25)
    kinds = by_kind(result.groups)
    named = {g.label: g for g in kinds["line"]}
    wide = named["In [2] line 3"]
    assert wide.code == "return keras.ops.matmul(x, self.w)" and wide.made_by == "In [3] line 2"
    assert wide.made_by_code == "Wide()," and wide.layer == "wide"
    assert (wide.bytes, wide.forward_bytes, wide.backward_bytes, wide.count) == (10 << 20, 8 << 20, 2 << 20, 2)
    dense = named["In [3] line 3"]
    assert dense.code == dense.made_by_code == "keras.layers.Dense(4096)," and dense.made_by == dense.label
    assert dense.bytes == 5 << 20 and dense.backward_bytes == 1 << 20
    assert named["In [2] line 5"].bytes == (64 + 3) << 20 and named["In [2] line 5"].code.startswith("scratch =")
    assert kinds["keras"][0].bytes == 5 << 20 and kinds["tf.data"][0].bytes == 7000
    assert kinds["eager"][0].bytes == 6 << 20 and kinds["untagged"][0].bytes == 256
    assert kinds["xla"][0].bytes == 9 << 20 and kinds["unresolved"][0].bytes == 4096
    assert kinds["function"][0].bytes == 4 << 10 and kinds["function"][0].label.startswith("tf.function runtime")
    assert kinds["layer"][0].label == "layer dense_old" and kinds["layer"][0].made_by is None
    assert result.named_bytes == (10 + 5 + 67) << 20
    assert [g.bytes for g in result.groups] == sorted((g.bytes for g in result.groups), reverse=True)
    assert result.note is not None and result.note.startswith(f"{format_bytes(82 << 20)} of the")
    assert f"eager ops {format_bytes(6 << 20)} (RandomStandardNormal: {lines.NO_CALLBACK})" in result.note
    assert f"XLA buffers {format_bytes(9 << 20)} (XLA allocates its buffers without op names)" in result.note
    # the largest tensors of a line, largest first
    assert [t.bytes for t in wide.tensors] == [8 << 20, 2 << 20] and wide.tensors[0].shape == "[256,8192]"


def test_a_path_outside_every_run_is_looked_for_in_the_other_functions(functions, resolver):
    """A run's event is kept only by the trace segment it ends in: its allocations may lie outside every run the
    trace kept. Their path is then looked for in the functions the cell traced and its models hold."""
    rows = [row("StatefulPartitionedCall/sequential_1/wide_1/MatMul", "wide", t_ps=10**9)]
    alone = lines.by_line(rows, [], resolver, top=25)
    # not found: a custom layer's tensor is named by its layer and the line that made it, never by a line inside
    assert [(g.kind, g.label, g.made_by) for g in alone.groups] == [("layer", "layer wide", "In [3] line 2")]
    functions["gone"] = None  # garbage collected: the eager context no longer knows it
    found = lines.by_line(rows, [], resolver, top=25, others=["gone", "outer"])
    assert found.groups[0].label == "In [2] line 3"


def test_a_bare_name_no_eager_op_made_is_looked_for_as_a_node_of_the_functions_that_ran(functions, resolver):
    """tf_keras' train function has top-level nodes named as op types (`Tile`): where the trace lost its run, the
    allocation looks like an eager op's. With no eager op of its type and size noted, it is the function's node."""
    lost = row("Tile", chunk=64 << 20, shape="[16384,1024]", t_ps=10**9)._replace(eager=lines.NOT_NOTED)
    found = lines.by_line([lost], [], resolver, top=25, others=["inner"])
    assert [(g.kind, g.label) for g in found.groups] == [("line", "In [2] line 5")]
    # no op callback (quick mode, no API): an op type alone stays an eager op's, never a guessed node
    alone = lines.by_line([lost._replace(eager=None)], [], resolver, top=25, others=["inner"])
    assert [g.kind for g in alone.groups] == ["eager"]
    # an eager op the callback noted is that op's
    made = lost._replace(eager=(CELL_FIT, 1, False))
    assert [g.label for g in lines.by_line([made], [], resolver, top=25, others=["inner"]).groups] == ["In [4] line 1"]


def test_the_text_report_shows_the_top_lines_with_their_code():
    info = TraceInfo(
        by_line=[
            LineGroup(
                label="In [2] line 3",
                code="return keras.ops.matmul(x, self.w)",
                bytes=10 << 20,
                forward_bytes=8 << 20,
                backward_bytes=2 << 20,
                count=2,
                layer="wide",
                made_by="In [3] line 2",
                made_by_code="Wide(),",
                tensors=[lines.LineTensor(8 << 20, "[256,8192]", "float32", "MatMul", "forward")],
            ),
            LineGroup(label="eager ops", kind="eager", bytes=1 << 20),
        ],
        by_line_note="10.0 MiB of the 11.0 MiB traced at the peak named by a line of code; not by a line: eager ops",
    )
    text = "\n".join(by_line_text(info))
    eight, two = format_bytes(8 << 20), format_bytes(2 << 20)
    assert f"In [2] line 3  return keras.ops.matmul(x, self.w) (forward {eight}, backward {two})" in text
    assert f"largest of 2 tensors: float32[256,8192] MatMul {eight}" in text
    assert "layer wide made at In [3] line 2: Wide()," in text
    assert "eager ops" in text.splitlines()[-1] and "In [" not in text.splitlines()[-1]
    assert by_line_text(TraceInfo()) == []


def test_a_node_the_graph_optimizer_made_is_named_by_the_one_line_of_its_scope(functions, resolver):
    """Grappler's rewrites are in no function's def (`square_1/ArithmeticOptimizer/ReplaceMulWithSquare_mul`): the
    one line of the nodes in the scope it was made in names it; a node in no scope of the function names nothing."""
    p = "StatefulPartitionedCall/"
    rows = [
        row(p + "sequential_1/wide_1/ArithmeticOptimizer/ReplaceMulWithSquare_mul", "wide", chunk=3 << 20),
        row(p + "ArithmeticOptimizer/AddN", None, chunk=1 << 20),  # the step's own scope: Tile's line, sgd's...
    ]
    result = lines.by_line(rows, RUN, resolver, top=25)
    named = {g.label: g for g in result.groups}
    assert named["In [2] line 3"].bytes == 3 << 20
    assert named["graph ops of functions no longer found"].bytes == 1 << 20


def test_a_tfmem_cells_own_line_is_named_as_the_notebook_shows_the_cell(monkeypatch):
    """IPython compiles a `%%tfmem` body as the next cell (In [5] here), one line short: the magic notes its files."""
    body = "/tmp/ipykernel_7/5555.py"
    monkeypatch.setattr(lines, "cell_numbers", lambda: {**CELLS, body: 5})
    monkeypatch.setattr(lines.SESSION, "cell_bodies", {})
    lines.note_cell_body(set(CELLS), 4)
    assert lines.SESSION.cell_bodies == {body: (4, 1)}
    monkeypatch.setitem(
        linecache.cache, body, (1, None, ["small = tf.ones([4])\n", "x = tf.random.normal([9])\n"], body)
    )
    site = lines.Resolver({}, cells={**CELLS, body: 5}).site(body, 2)
    assert site.label == "In [4] line 3" and site.code == "x = tf.random.normal([9])"
    assert lines.Resolver({}, cells=CELLS).site(CELL_FIT, 1).label == "In [4] line 1"  # a plain cell: as before


def test_an_ooms_request_names_its_node_and_function_and_a_traceback_its_user_frame():
    from tfmem_magic.measure.guard import parse_oom

    message = (
        "Graph execution error:\n\nOOM when allocating tensor with shape[1099511627776] and type float on "
        "/job:localhost/replica:0/task:0/device:CPU:0 by allocator mklcpu\n"
        "\t [[{{node sequential_1/huge_1/random_normal/RandomStandardNormal}}]]\nHint: ...\n"
        " [Op:__inference_multi_step_on_iterator_272]"
    )
    request = parse_oom(message)
    assert request is not None and request["op"] == "sequential_1/huge_1/random_normal/RandomStandardNormal"
    assert request["function"] == "__inference_multi_step_on_iterator_272"
    user = compile("def cell():\n    raise MemoryError\n", CELL_FIT, "exec")
    namespace: dict[str, object] = {}
    exec(user, namespace)  # noqa: S102 - a frame in a notebook cell's file
    try:
        namespace["cell"]()  # type: ignore[operator]
    except MemoryError as exc:
        assert lines.traceback_frame(exc.__traceback__) == (CELL_FIT, 2)

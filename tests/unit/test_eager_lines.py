"""Eager ops named by the line that ran them (measure/eager_ops.py, analyze/lines.py `match_eager`): the op callback's
records, their pairing with the trace's eager allocations, and the by-line groups they make. No TensorFlow: the
callback is called by hand with stand-in tensors, the trace is built by hand."""

from __future__ import annotations

import linecache
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from tfmem_magic.analyze import analysis, lines
from tfmem_magic.core import fallbacks
from tfmem_magic.measure import eager_ops
from tfmem_magic.measure.eager_ops import EagerOp, EagerOps
from tfmem_magic.measure.xplane import FUNCTION_SPAN, MemoryEvents, Span, Trace

CELL = "/tmp/ipykernel_7/4444.py"  # In [4]
SOURCE = ["parts = [tf.random.normal([1024, 1024]) for _ in range(8)]", "whole = tf.concat(parts, 0)"]
MiB = 1 << 20
FLOAT32 = 1
PS = 10**12


class Tensor:
    """What the callback reads of an EagerTensor."""

    def __init__(self, shape: tuple[int, ...], dtype: int = FLOAT32) -> None:
        self.shape, self.dtype = shape, dtype

    def _shape_tuple(self) -> tuple[int, ...]:
        return self.shape

    def _datatype_enum(self) -> int:
        return self.dtype


def recorder(ops: list[EagerOp] | None = None, recording: int = 0) -> EagerOps:
    made = EagerOps(SimpleNamespace(recording=recording, _t0=0.0))  # type: ignore[arg-type]
    made.ops = list(ops or [])
    return made


def op(name: str, line: int, t_s: float, shape=(1024, 1024), segment=0, file=CELL, keras=False) -> EagerOp:
    return EagerOp(segment, name, file, line, keras, t_s, ((shape, FLOAT32),))


def alloc(index: int, name: str, t_s: float, size: int = 4 * MiB, window: int = 0) -> lines.EagerAllocation:
    return lines.EagerAllocation(index, window, name, size, int(t_s * PS))


# ---- the callback -----------------------------------------------------------------------------------------------


def test_the_callback_notes_an_eager_op_with_its_outputs_and_the_frame_that_ran_it():
    made = recorder()
    line = ran_here(made, "AddV2", (Tensor((1024, 1024)), Tensor((), 9)))
    (noted,) = made.ops
    assert (noted.segment, noted.op, noted.file, noted.line, noted.keras) == (0, "AddV2", __file__, line, False)
    assert noted.outputs == (((1024, 1024), FLOAT32), ((), 9))
    assert [eager_ops.output_bytes(*o) for o in noted.outputs] == [4 * MiB, 8]
    assert eager_ops.output_bytes((3,), 7) is None and eager_ops.output_bytes(None, FLOAT32) is None  # a string


def ran_here(made: EagerOps, name: str | bytes, outputs: tuple[Tensor, ...], graph: object = None) -> int:
    """Calls the callback as TensorFlow does, from a frame of TensorFlow's own (its op wrapper): returns the line of
    this (user's) frame that ran the op."""

    def gen_op_wrapper() -> None:  # stands in for TensorFlow's frame between the op and the user's code
        made._callback(name, (), (), outputs, None, graph)

    gen_op_wrapper.__code__ = gen_op_wrapper.__code__.replace(co_filename="/venv/site-packages/tensorflow/gen.py")
    line = sys._getframe().f_lineno + 1
    gen_op_wrapper()
    return line


def test_an_op_named_in_bytes_is_noted_by_its_name():
    """TensorFlow's generated op wrappers call `execute(b"MatMul", ...)` on their slow path: the callback gets bytes."""
    made = recorder()
    ran_here(made, b"MatMul", (Tensor((512, 512)),))  # type: ignore[arg-type]
    assert [o.op for o in made.ops] == ["MatMul"] and made.failed is None


def test_an_op_whose_outputs_are_all_small_is_not_noted_and_its_allocations_say_why():
    made = recorder()
    ran_here(made, "MatMul", (Tensor((4, 4)),))  # 64 bytes: below MIN_NOTED_BYTES, no frame walked
    ran_here(made, "Unpack", (Tensor((4, 4)), Tensor((512, 512))))  # one large output: the op and all its outputs
    assert [o.op for o in made.ops] == ["Unpack"] and len(made.ops[0].outputs) == 2
    found = lines.match_eager([0, 1], [alloc(0, "MatMul", 0.9, 64), alloc(1, "Unpack", 0.9, 64)], made)
    assert found == {0: lines.TOO_SMALL, 1: lines.TOO_SMALL}  # a small size is never paired, noted or not


def test_graph_ops_function_runs_and_a_paused_trace_are_not_noted():
    made = recorder()
    ran_here(made, "MatMul", (Tensor((512, 512)),), graph=object())  # an op added to a graph being traced
    ran_here(made, "__inference_step_12", (Tensor((512, 512)),))  # a tf.function ran: its ops are named from its graph
    assert made.ops == []
    paused = recorder(recording=-1)
    ran_here(paused, "MatMul", (Tensor((512, 512)),))
    assert paused.ops == []


def test_the_callback_never_raises_into_the_users_code():
    made = recorder()
    fallbacks.forget()

    class Broken:
        def _shape_tuple(self) -> tuple[int, ...]:
            raise RuntimeError("a tensor TensorFlow cannot describe")

    assert made._callback("MatMul", (), (), (Broken(),)) is None
    assert made.failed == "RuntimeError: a tensor TensorFlow cannot describe" and made.ops == []
    assert any("eager op's line" in f.what for f in fallbacks.recent())
    ran_here(made, "MatMul", (Tensor((512, 512)),))  # off from then on
    assert made.ops == []
    made.stop()  # never added: nothing to remove, no TensorFlow imported
    assert made._callback("MatMul", (), (), (Tensor((512, 512)),)) is None


def test_the_records_stop_at_their_cap(monkeypatch):
    monkeypatch.setattr(eager_ops, "MAX_OPS", 2)
    made = recorder()
    for _ in range(3):
        ran_here(made, "MatMul", (Tensor((512, 512)),))
    assert len(made.ops) == 2 and made.full_from == 0


# ---- pairing the trace's allocations with the records -----------------------------------------------------------


def comprehension_and_concat() -> tuple[EagerOps, list[lines.EagerAllocation]]:
    """Eight tf.random.normal (each a RandomStandardNormal, a Mul and an AddV2 of 4 MiB) on line 1, their concat on
    line 2; the trace saw each allocation just before its op's callback ran."""
    ops, allocations, t = [], [], 1.0
    for _ in range(8):
        for name in ("RandomStandardNormal", "Mul", "AddV2"):
            allocations.append(alloc(len(allocations), name, t - 0.0005))
            ops.append(op(name, 1, t))
            t += 0.001
    allocations.append(alloc(len(allocations), "ConcatV2", t - 0.0005, 32 * MiB))
    ops.append(op("ConcatV2", 2, t, (8192, 1024)))
    return recorder(ops), allocations


def test_each_allocation_is_paired_with_its_op_by_type_size_and_order():
    ops, allocations = comprehension_and_concat()
    peak = [a.event for a in allocations if a.op in ("AddV2", "ConcatV2")]
    found = lines.match_eager(peak, allocations, ops)
    assert set(found) == set(peak)
    assert [found[i] for i in peak] == [(CELL, 1, False)] * 8 + [(CELL, 2, False)]


def test_two_lines_of_one_op_and_size_are_told_apart_by_order_and_never_guessed():
    ops = recorder([op("AddV2", 1, 1.0), op("AddV2", 2, 2.0), op("AddV2", 1, 3.0)])
    allocations = [alloc(0, "AddV2", 0.9), alloc(1, "AddV2", 1.9), alloc(2, "AddV2", 2.9)]
    assert lines.match_eager([0, 1, 2], allocations, ops) == {
        0: (CELL, 1, False),
        1: (CELL, 2, False),
        2: (CELL, 1, False),
    }
    # one allocation the trace lost: which op each remaining one was is not known -> none named
    missing = lines.match_eager([0, 2], [allocations[0], allocations[2]], ops)
    assert all(v == lines.NOT_ONE_TO_ONE for v in missing.values()), missing
    # as many, but one allocated after every recorded op of its kind ran: the order is off -> none named
    late = [alloc(0, "AddV2", 0.9), alloc(1, "AddV2", 1.9), alloc(2, "AddV2", 3.5)]
    assert all(v == lines.OUT_OF_ORDER for v in lines.match_eager([0, 1, 2], late, ops).values())


def test_fewer_allocations_than_outputs_of_one_line_are_that_lines():
    """An output that reused its input's buffer allocates nothing: where every recorded output of that op type and
    size ran on one line, the allocations the trace holds are that line's."""
    ops = recorder([op("Mul", 1, 1.0), op("Mul", 1, 2.0), op("Mul", 1, 3.0)])
    assert lines.match_eager([5], [alloc(5, "Mul", 1.9)], ops) == {5: (CELL, 1, False)}


def test_another_size_type_segment_or_a_missing_record_is_never_named():
    ops = recorder([op("AddV2", 1, 1.0), op("AddV2", 2, 2.0, segment=1)])
    found = lines.match_eager(
        [0, 1, 2, 3],
        [
            alloc(0, "AddV2", 0.9, size=8 * MiB),  # no output of that size
            alloc(1, "Sub", 0.9),  # no such op
            alloc(2, "AddV2", 0.95),  # segment 0: line 1
            alloc(3, "AddV2", 1.9, window=1),  # segment 1: line 2
        ],
        ops,
    )
    assert found[2] == (CELL, 1, False) and found[3] == (CELL, 2, False)
    assert found[0] == found[1] == lines.NOT_NOTED
    full = recorder([op("AddV2", 1, 1.0)])
    full.full_from = 0
    assert "more than" in str(lines.match_eager([0], [alloc(0, "AddV2", 0.9)], full)[0])
    nobody = recorder([op("AddV2", 1, 1.0, file=None)])
    assert lines.match_eager([0], [alloc(0, "AddV2", 0.9)], nobody) == {0: lines.NO_USER_FRAME}


# ---- from the trace to the by-line groups -----------------------------------------------------------------------


def test_the_traces_eager_allocations_outside_function_runs_are_matched():
    strings = ["RandomStandardNormal", "ConcatV2", "StatefulPartitionedCall/dense_1/MatMul", "AddV2"]
    #        t µs, alloc, bytes, op
    events = [
        (100, True, 4 * MiB, 0),  # line 1, freed at 150
        (150, False, 4 * MiB, 0),
        (200, True, 4 * MiB, 0),  # line 1, live at the peak
        (300, True, 32 * MiB, 1),  # line 2, live at the peak
        (400, True, 4 * MiB, 2),  # a graph op: not eager
        (450, True, 4 * MiB, 0),  # inside a function run: a node named like an op type, not eager
        (600, True, 4 * MiB, 3),  # outside every segment
    ]
    n = len(events)
    trace = Trace(
        MemoryEvents(
            t_ps=np.array([e[0] for e in events], dtype=np.int64) * 10**6,
            is_alloc=np.array([e[1] for e in events]),
            live=np.cumsum([e[2] if e[1] else -e[2] for e in events]),
            requested=np.array([e[2] for e in events], dtype=np.int64),
            chunk=np.array([e[2] for e in events], dtype=np.int64),
            addr=np.arange(n, dtype=np.int64),
            dtype=np.ones(n, dtype=np.int64),
            op=np.array([e[3] for e in events], dtype=np.int32),
            region=np.full(n, -1, np.int32),
            shape=np.full(n, -1, np.int32),
            thread=np.zeros(n, np.int32),
            strings=strings,
            threads=["python"],
            allocator="bfc",
        ),
        [Span(FUNCTION_SPAN + "__inference_f_9", 420 * 10**6, 500 * 10**6, "python")],
    )
    us = 1e-6
    ops = recorder(
        [
            op("RandomStandardNormal", 1, 120 * us),
            op("RandomStandardNormal", 1, 220 * us),
            op("ConcatV2", 2, 320 * us, (8192, 1024)),
            op("AddV2", 1, 620 * us),
        ]
    )
    ctx = analysis.TraceContext(windows=[(0.0, 500 * us)], eager_ops=ops, models=[])
    att = analysis.attribute_events(trace, ctx)
    idx = np.array([2, 3, 4, 5, 6])
    found = analysis._eager_lines(trace, att, idx, [None] * len(idx), ctx)
    assert found[2] == (CELL, 1, False) and found[3] == (CELL, 2, False)
    assert 4 not in found  # a graph op's path
    assert found[5] == found[6] == lines.IN_FUNCTION


@pytest.fixture
def cell(monkeypatch):
    monkeypatch.setitem(linecache.cache, CELL, (1, None, [t + "\n" for t in SOURCE], CELL))
    return lines.Resolver({}, cells={CELL: 4})


def eager_row(name: str, made: lines.EagerMade | str | None, chunk: int = 4 * MiB, shape="[1024,1024]"):
    return lines.TracedTensor(name, name, None, "other", "float32", shape, chunk, chunk, 500, None, made)


def test_matched_eager_ops_are_grouped_by_their_line_the_rest_stays_eager_with_why(cell):
    rows = [
        *(eager_row("AddV2", (CELL, 1, False)) for _ in range(8)),
        eager_row("ConcatV2", (CELL, 2, False), 32 * MiB, "[8192,1024]"),
        eager_row("Mul", (CELL, 1, True)),  # under Keras' fit: Keras' own
        eager_row("Sub", lines.NOT_ONE_TO_ONE),
    ]
    result = lines.by_line(rows, [], cell, top=25)
    named = {g.label: g for g in result.groups if g.kind == "line"}
    comprehension, concat = named["In [4] line 1"], named["In [4] line 2"]
    assert comprehension.code == SOURCE[0] and comprehension.bytes == 32 * MiB and comprehension.count == 8
    assert comprehension.tensors[0].shape == "[1024,1024]" and comprehension.tensors[0].op == "AddV2"
    assert concat.code == SOURCE[1] and concat.bytes == 32 * MiB and concat.tensors[0].op == "ConcatV2"
    assert result.named_bytes == 64 * MiB
    kinds = {g.kind: g.bytes for g in result.groups}
    assert kinds["keras"] == 4 * MiB and kinds["eager"] == 4 * MiB
    assert result.note is not None and f"eager ops 4 MiB (Sub: {lines.NOT_ONE_TO_ONE})" in result.note
    unrecorded = lines.by_line([eager_row("Sub", None)], [], cell, top=25)
    assert unrecorded.note is not None and lines.NO_CALLBACK in unrecorded.note


def test_onednns_name_of_an_eager_op_is_its_op_type():
    assert lines.eager_op_type("_MklMatMul") == "MatMul" and lines.eager_op_type("_MklNativeConv2D") == "Conv2D"
    assert lines.eager_op_type("AddV2") == "AddV2" and lines.eager_op_type("_Mklish") == "_Mklish"

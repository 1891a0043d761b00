"""Trace parsing and analysis of a synthetic xplane with 1,000,000 memory events: time and memory.

The xplane is built with TensorFlow's own XSpace classes (`tensorflow.tsl.profiler.protobuf.xplane_pb2`) and shaped
as TF 2.21's BFC allocator writes it: a `/host:CPU` plane whose MemoryAllocation / MemoryDeallocation events carry
the allocator's stats (allocator_name, bytes_reserved, bytes_allocated, bytes_available, fragmentation,
peak_bytes_in_use, requested_bytes, allocation_bytes, addr, tf_op, id, region_type, data_type, shape; strings as
`ref_value`s into the stat metadata), on a python thread, several tf_Compute threads and a tf.data thread. The
allocations come from a few thousand node paths (`StatefulPartitionedCall/sequential/dense_3/MatMul`, their
`gradient_tape/...` twins, optimizer updates, eager op types), reuse addresses as an allocator does, and are
matched by frees (1% never freed, 1% of the frees are of tensors allocated before the trace). Non-memory events
(executor and eager-runtime TraceMes, our `tfmem:layer/...` spans) are mixed in, as in a real trace.

The parse and the analysis run in fresh child processes that hold the serialized blobs (as the tracer does) and
measure, for `xplane.read_segments` and then `analysis.summarize`, the wall time and the growth of the RSS
high-water mark (VmHWM, reset through /proc/self/clear_refs before each part, after malloc_trim hands back the pages
the part before freed), printed as a ratio to the trace's serialized size; the "both" line is the high-water mark of
both parts over the RSS before the parse. The analysis is timed twice and the faster call kept: right after the
trim, the first call also pays for faulting in fresh pages, which a cell does not. Building the trace takes 15-25 s
per million events on a 2-core machine; each measuring process a few seconds.

    python benchmarks/analysis_1m.py [--events 1000000] [--ops 3000] [--other 250000] [--segments 1] [--rounds 3]

Target: parsing holds at most about 2x the trace's size. docs/overhead.md ('Huge traces stay bounded') has the
measurements.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

MiB = 2**20
PS_PER_US = 10**6
STAT_NAMES = (
    "allocator_name",
    "bytes_reserved",
    "bytes_allocated",
    "bytes_available",
    "fragmentation",
    "peak_bytes_in_use",
    "requested_bytes",
    "allocation_bytes",
    "addr",
    "tf_op",
    "id",
    "region_type",
    "data_type",
    "shape",
    "step_id",
    "long_name",
    "_c",
    "_p",
)
LAYER_KINDS = {  # layer kind -> (forward op types, their gradient op types)
    "dense": (
        ("MatMul", "BiasAdd", "Relu"),
        ("MatMul/MatMul_1", "MatMul/MatMul", "BiasAdd/BiasAddGrad", "Relu/ReluGrad"),
    ),
    "conv2d": (
        ("Conv2D", "BiasAdd", "Relu"),
        ("Conv2D/Conv2DBackpropInput", "Conv2D/Conv2DBackpropFilter", "BiasAdd/BiasAddGrad", "Relu/ReluGrad"),
    ),
    "batch_normalization": (("FusedBatchNormV3", "mul", "add"), ("FusedBatchNormV3/FusedBatchNormGradV3", "mul/Mul")),
    "lstm": (
        ("while/body/MatMul", "while/body/MatMul_1", "while/body/Sigmoid", "while/body/Tanh", "while/body/mul"),
        ("while/body/MatMul/MatMul_1", "while/body/Sigmoid/SigmoidGrad", "while/body/Tanh/TanhGrad"),
    ),
    "multi_head_attention": (
        (
            "query/einsum/Einsum",
            "key/einsum/Einsum",
            "value/einsum/Einsum",
            "Softmax",
            "attention_output/einsum/Einsum",
        ),
        ("Softmax/SoftmaxGrad", "query/einsum/Einsum/Einsum"),
    ),
    "layer_normalization": (("moments/mean", "moments/variance", "batchnorm/mul"), ("batchnorm/mul/Mul",)),
    "dropout": (
        ("stateless_dropout/SelectV2", "stateless_dropout/GreaterEqual"),
        ("stateless_dropout/SelectV2/Select",),
    ),
    "embedding": (("GatherV2",), ("GatherV2/UnsortedSegmentSum",)),
}
OTHER_EVENTS = (
    "ExecutorState::Process",
    "EagerKernelExecute",
    "EagerLocalExecute: MatMul",
    "TFE_Py_FastPathExecute_C",
    "KernelAndDeviceFunc::Run",
    "FunctionRun",
    "ThreadpoolListener::StartRegion",
    "IteratorGetNext",
    "Iterator::Prefetch",
    "Iterator::Map",
    "MatMul:MatMul",
    "BiasAdd:BiasAdd",
    "Relu:Relu",
    "Conv2D:Conv2D",
    "Mul:Mul",
    "AddV2:AddV2",
    "ReadVariableOp:ReadVariableOp",
    "TFE_DeleteTensorHandle",
)


# ---- the synthetic trace ------------------------------------------------------------------------------------------


def op_names(n_ops: int) -> tuple[list[str], list[str]]:
    """About n_ops distinct tf_op values (graph node paths and eager op types), and the layer names they mention."""
    ops, layers = [], []
    kinds = list(LAYER_KINDS)
    k = 0
    while len(ops) < n_ops - 40:
        kind = kinds[k % len(kinds)]
        layer = kind if k < len(kinds) else f"{kind}_{k // len(kinds)}"
        layers.append(layer)
        forward, backward = LAYER_KINDS[kind]
        ops += [f"StatefulPartitionedCall/sequential/{layer}/{op}" for op in forward]
        ops += [f"StatefulPartitionedCall/gradient_tape/sequential/{layer}/{op}" for op in backward]
        ops.append(f"StatefulPartitionedCall/adam/Mul_{k}")
        k += 1
    ops += ["StatefulPartitionedCall/compile_loss/mean_squared_error/sub", "IteratorGetNext", "MakeIterator"]
    ops += [
        "MatMul",
        "BiasAdd",
        "Relu",
        "AddV2",
        "Mul",
        "Cast",
        "ReadVariableOp",
        "AssignVariableOp",
        "Conv2D",
        "Identity",
        "Reshape",
        "ConcatV2",
        "Tanh",
        "Sigmoid",
        "Softmax",
        "Sum",
        "Mean",
        "Sub",
        "RealDiv",
    ]
    return ops[:n_ops], layers


def _interner(table):
    """A function giving each name its id in a plane's metadata `table`, adding the name on first use."""
    ids: dict[str, int] = {}

    def intern(name: str) -> int:
        k = ids.get(name)
        if k is None:
            k = ids[name] = len(ids) + 1
            table[k].id, table[k].name = k, name
        return k

    return intern


def build(
    n_events: int, n_ops: int, n_other: int, n_segments: int, seed: int = 0
) -> tuple[list[tuple[bytes, int]], list[str], list[tuple]]:
    """Serialized XSpaces (one per segment, with its start offset in ps), the layer names, and the windows."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    rng = np.random.default_rng(seed)
    ops, layers = op_names(n_ops)
    is_graph = np.array(["/" in op for op in ops])
    is_input = np.array([op in ("IteratorGetNext", "MakeIterator") for op in ops])
    shapes = [f"[32,{d}]" for d in (1, 8, 16, 64, 128, 256, 512, 1024)] + [f"[32,28,28,{c}]" for c in (16, 32, 64)]
    # allocations, frees of them, frees of tensors allocated before the trace
    n_unfreed = n_pre = n_events // 200
    n_alloc = (n_events - n_pre + n_unfreed) // 2
    n_pre = n_events - 2 * n_alloc + n_unfreed
    slots = 1 << 14  # an address comes back 16k allocations later: the tensor at it was freed by then
    alloc_t = np.cumsum(rng.integers(1, 4, n_alloc)) * 2 * PS_PER_US  # ps
    life = np.minimum(rng.lognormal(2.0, 2.0, n_alloc).astype(np.int64) + 1, slots - 1)  # in allocations
    freed = np.ones(n_alloc, dtype=bool)
    freed[rng.choice(n_alloc, n_unfreed, replace=False)] = False  # weights, optimizer slots, the result
    free_t = alloc_t[np.minimum(np.arange(n_alloc) + life, n_alloc - 1)] + PS_PER_US
    free_t[np.arange(n_alloc) + life >= n_alloc] = alloc_t[-1] + 2 * PS_PER_US  # freed at the end
    addr = 0x7F00_0000_0000 + (np.arange(n_alloc) % slots) * 0x10_0000
    addr[~freed] = 0x7E00_0000_0000 + np.arange(int((~freed).sum())) * 0x10_0000  # kept: addresses of their own
    # op popularity is skewed: a few ops allocate most (a Zipf-like rank distribution over a shuffled op list)
    rank = np.minimum(rng.zipf(1.3, n_alloc), len(ops)) - 1
    op = rng.permutation(len(ops))[rank]
    requested = rng.choice(
        [4, 128, 512, 2048, 8192, 32768, 131072, 524288, 4 * MiB],
        n_alloc,
        p=[0.15, 0.15, 0.15, 0.15, 0.15, 0.1, 0.08, 0.05, 0.02],
    ) * rng.integers(1, 4, n_alloc)
    chunk = (requested + 255) // 256 * 256
    dtype = rng.choice([1, 3, 9, 10], n_alloc, p=[0.85, 0.07, 0.06, 0.02])
    has_shape = rng.random(n_alloc) < 0.3
    shape = rng.integers(0, len(shapes), n_alloc)
    alloc_id = rng.integers(-(2**62), 2**62, n_alloc)
    n_compute = 4
    line_of_op = np.where(is_input, n_compute + 1, np.where(is_graph, 1 + np.arange(len(ops)) % n_compute, 0))
    line = line_of_op[op]
    pre_t = np.sort(rng.integers(0, alloc_t[-1], n_pre))
    pre_chunk = rng.choice([256, 4096, 65536], n_pre)
    # every memory event, in time order: the allocator's counters follow it
    t = np.concatenate([alloc_t, free_t[freed], pre_t])
    kind = np.concatenate([np.ones(n_alloc, np.int8), np.zeros(int(freed.sum()) + n_pre, np.int8)])
    src = np.concatenate([np.arange(n_alloc), np.nonzero(freed)[0], np.full(n_pre, -1)])
    size = np.concatenate([chunk, chunk[freed], pre_chunk])
    order = np.lexsort((1 - kind, t))  # frees first at equal times
    t, kind, src, size = t[order], kind[order], src[order], size[order]
    preexisting = 64 * MiB + int(pre_chunk.sum())  # the tensors freed before their allocation was seen, and more
    live = preexisting + np.cumsum(np.where(kind == 1, size, -size))
    peak = np.maximum.accumulate(live)
    pre_addr = 0x7D00_0000_0000 + np.arange(n_pre) * 0x1000
    ev_addr = np.where(src >= 0, addr[np.maximum(src, 0)], 0)
    ev_addr[src < 0] = pre_addr
    ev_op = np.where(src >= 0, op[np.maximum(src, 0)], rng.integers(0, len(ops), len(src)))
    ev_line = np.where(src >= 0, line[np.maximum(src, 0)], 0)
    windows_ps = np.linspace(0, t[-1] + PS_PER_US, n_segments + 1).astype(np.int64)

    other_t = np.sort(rng.integers(0, t[-1], n_other))
    other_name = rng.integers(0, len(OTHER_EVENTS), n_other)
    other_line = rng.integers(0, n_compute + 2, n_other)
    other_dur = rng.integers(1, 50, n_other) * PS_PER_US
    other_op = rng.integers(0, len(ops), n_other)
    span_t = np.arange(0, t[-1], 500 * PS_PER_US)  # a layer call every 0.5 ms on the python thread
    span_layer = rng.integers(0, len(layers), len(span_t))

    line_names = (
        ["python"]
        + [f"tf_Compute/{-5713192063483277081 + k}" for k in range(n_compute)]
        + ["tf_data_private_threadpool/859098830030588192"]
    )
    blobs = []
    for s in range(n_segments):
        lo, hi = windows_ps[s], windows_ps[s + 1]
        space = xplane_pb2.XSpace(hostnames=["localhost"])
        space.planes.add(id=1, name="Task Environment")
        plane = space.planes.add(id=0, name="/host:CPU")
        sid, eid = _interner(plane.stat_metadata), _interner(plane.event_metadata)

        for name in STAT_NAMES:
            sid(name)
        bfc = sid("bfc_cpu_allocator_for_gpu")
        op_ref = [sid(name) for name in ops]
        shape_ref = [sid(name) for name in shapes]
        output, temp = sid("output"), sid("temp")
        alloc_e, free_e = eid("MemoryAllocation"), eid("MemoryDeallocation")
        other_e = [eid(name) for name in OTHER_EVENTS]
        span_e = [eid(f"tfmem:layer/{name}") for name in layers]
        S = {name: sid(name) for name in STAT_NAMES}
        XStat = xplane_pb2.XStat
        lines = [
            plane.lines.add(id=1000 + k, display_id=1000 + k, name=name, display_name=name, timestamp_ns=7627)
            for k, name in enumerate(line_names)
        ]
        base = -int(lo)  # offsets are from the segment's start (its offset in the trace is lo)
        pick = np.nonzero((t >= lo) & (t < hi))[0]
        for i, ti, ki, si, zi, li, pi, ai, oi in zip(
            pick.tolist(),
            t[pick].tolist(),
            kind[pick].tolist(),
            src[pick].tolist(),
            size[pick].tolist(),
            live[pick].tolist(),
            peak[pick].tolist(),
            ev_addr[pick].tolist(),
            ev_op[pick].tolist(),
            strict=True,
        ):
            stats = [
                XStat(metadata_id=S["allocator_name"], ref_value=bfc),
                XStat(metadata_id=S["bytes_reserved"], int64_value=0),
                XStat(metadata_id=S["bytes_allocated"], int64_value=li),
                XStat(metadata_id=S["bytes_available"], int64_value=(64 << 30) - li),
                XStat(metadata_id=S["fragmentation"], double_value=1e-4)
                if i % 10 == 0
                else XStat(metadata_id=S["fragmentation"], int64_value=0),
                XStat(metadata_id=S["peak_bytes_in_use"], int64_value=pi),
            ]
            if ki:
                stats += [
                    XStat(metadata_id=S["requested_bytes"], int64_value=int(requested[si])),
                    XStat(metadata_id=S["allocation_bytes"], int64_value=zi),
                    XStat(metadata_id=S["addr"], int64_value=ai),
                    XStat(metadata_id=S["tf_op"], ref_value=op_ref[oi]),
                    XStat(metadata_id=S["id"], int64_value=int(alloc_id[si])),
                ]
                if has_shape[si]:
                    stats += [
                        XStat(metadata_id=S["region_type"], ref_value=output if si % 7 else temp),
                        XStat(metadata_id=S["data_type"], int64_value=int(dtype[si])),
                        XStat(metadata_id=S["shape"], ref_value=shape_ref[int(shape[si])]),
                    ]
                else:
                    stats.append(XStat(metadata_id=S["data_type"], int64_value=int(dtype[si])))
            else:
                stats += [
                    XStat(metadata_id=S["requested_bytes"], int64_value=0),
                    XStat(metadata_id=S["allocation_bytes"], int64_value=zi),
                    XStat(metadata_id=S["addr"], int64_value=ai),
                    XStat(metadata_id=S["tf_op"], ref_value=op_ref[oi]),
                    XStat(metadata_id=S["id"], int64_value=0),
                    XStat(metadata_id=S["data_type"], int64_value=0),
                ]
            lines[int(ev_line[i])].events.add(metadata_id=alloc_e if ki else free_e, offset_ps=ti + base, stats=stats)
        pick = np.nonzero((other_t >= lo) & (other_t < hi))[0]
        for ti, ni, li, di, oi in zip(
            other_t[pick].tolist(),
            other_name[pick].tolist(),
            other_line[pick].tolist(),
            other_dur[pick].tolist(),
            other_op[pick].tolist(),
            strict=True,
        ):
            stats = (
                [
                    XStat(metadata_id=S["step_id"], int64_value=ti // (50_000 * PS_PER_US)),
                    XStat(metadata_id=S["long_name"], ref_value=op_ref[oi]),
                ]
                if li
                else [XStat(metadata_id=S["_c"], uint64_value=ti & 0xFFFF_FFFF_FFFF)]
            )
            lines[li].events.add(metadata_id=other_e[ni], offset_ps=ti + base, duration_ps=di, stats=stats)
        pick = np.nonzero((span_t >= lo) & (span_t < hi))[0]
        for ti, yi in zip(span_t[pick].tolist(), span_layer[pick].tolist(), strict=True):
            lines[0].events.add(metadata_id=span_e[yi], offset_ps=ti + base, duration_ps=400 * PS_PER_US)
        blobs.append((space.SerializeToString(), int(lo)))
        del space, plane, lines
    windows = [(float(a) / 1e12, float(b) / 1e12) for a, b in zip(windows_ps[:-1], windows_ps[1:], strict=True)]
    return blobs, layers, windows


# ---- the measurement (in a fresh process) --------------------------------------------------------------------------


def _status() -> dict[str, int]:
    with open("/proc/self/status") as f:
        text = f.read()
    return {k: int(re.search(rf"{k}:\s+(\d+)", text).group(1)) * 1024 for k in ("VmRSS", "VmHWM")}


def _reset_hwm() -> bool:
    """Start a new high-water mark at the current RSS, after handing freed heap pages back (so that what the next
    part allocates shows, rather than reusing pages the previous part freed but malloc kept)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def child(path: str) -> None:
    """Read the blobs written by the parent, then parse and analyse them once; print the figures as JSON."""
    from tfmem_magic.analyze import analysis
    from tfmem_magic.measure import xplane

    with open(path) as f:
        meta = json.load(f)
    segments = []
    for k, offset in enumerate(meta["offsets"]):
        with open(f"{path}.{k}", "rb") as f:
            segments.append((f.read(), offset))
    context = getattr(analysis, "TraceContext", None) or analysis.Context
    ctx = context(
        layer_names=set(meta["layers"]),
        windows=[tuple(w) for w in meta["windows"]],
        batch_size=32,
        weight_shapes={"[128,512]", "[512]"},
    )
    xplane._lazy_space_class()  # imports protobuf: not part of what is measured
    out: dict = {"reset": _reset_hwm()}
    before = _status()["VmRSS"]
    start = time.perf_counter()
    trace = xplane.read_segments(segments)
    out["decode_s"] = time.perf_counter() - start
    out["decode_peak"] = _status()["VmHWM"] - before
    out["events"] = len(trace.events)
    out["spans"] = len(trace.spans)
    _reset_hwm()
    before_analysis = _status()["VmRSS"]
    out["kept"] = before_analysis - before  # what the parsed trace holds (once malloc handed back what it freed)
    start = time.perf_counter()
    info = analysis.summarize(trace, ctx)
    first = time.perf_counter() - start
    out["analysis_peak"] = _status()["VmHWM"] - before_analysis
    # timed again on pages malloc already holds, as in a cell (the trim above made the first call fault in ~90 MB)
    start = time.perf_counter()
    analysis.summarize(trace, ctx)
    out["analysis_s"] = min(first, time.perf_counter() - start)
    out["overall_peak"] = max(out["decode_peak"], out["analysis_peak"] + before_analysis - before)
    out["peak_live"] = info.peak_live_bytes
    out["top_layer"] = info.by_layer[0].layer if info.by_layer else None
    print(json.dumps(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000, help="memory events (allocations and frees)")
    parser.add_argument("--ops", type=int, default=3000, help="distinct tf_op values")
    parser.add_argument("--other", type=int, default=250_000, help="non-memory events")
    parser.add_argument("--segments", type=int, default=1, help="xplane blobs the trace is split into")
    parser.add_argument("--rounds", type=int, default=3, help="fresh processes measuring the same trace")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    start = time.perf_counter()
    blobs, layers, windows = build(args.events, args.ops, args.other, args.segments)
    size = sum(len(b) for b, _ in blobs)
    print(
        f"Synthetic xplane: {args.events:,} memory events, {args.other:,} other events, {args.ops:,} tf_op values,"
        f" {args.segments} segment(s): {size / MiB:.1f} MiB serialized (built in "
        f"{time.perf_counter() - start:.0f} s)",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="tfmem-bench-") as tmp:
        path = os.path.join(tmp, "trace.json")
        for k, (data, _) in enumerate(blobs):
            with open(f"{path}.{k}", "wb") as f:
                f.write(data)
        with open(path, "w") as f:
            json.dump({"offsets": [o for _, o in blobs], "layers": layers, "windows": windows}, f)
        del blobs
        runs = []
        for _ in range(args.rounds):
            out = subprocess.run(
                [sys.executable, __file__, "--child", path], capture_output=True, text=True, timeout=900
            )
            lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
            if out.returncode != 0 or not lines:
                raise RuntimeError(f"the measuring process failed:\n{out.stderr[-3000:]}")
            runs.append(json.loads(lines[-1]))
    if not runs[0]["reset"]:
        print("(could not reset VmHWM: peaks are measured from the process's start)")
    med = {
        k: statistics.median(r[k] for r in runs)
        for k in ("decode_s", "analysis_s", "decode_peak", "kept", "analysis_peak", "overall_peak")
    }
    n = runs[0]["events"]
    print(f"{n:,} memory events and {runs[0]['spans']:,} spans read; medians of {args.rounds} fresh processes")
    print(
        f"  decode   (xplane.read_segments)  {med['decode_s']:6.2f} s  {n / med['decode_s']:>10,.0f} events/s"
        f" | RSS peak +{med['decode_peak'] / MiB:6.0f} MiB = {med['decode_peak'] / size:4.2f}x the trace"
        f" (the result holds +{med['kept'] / MiB:.0f} MiB = {med['kept'] / size:4.2f}x)"
    )
    print(
        f"  analysis (analysis.summarize)    {med['analysis_s']:6.2f} s  {n / med['analysis_s']:>10,.0f} events/s"
        f" | RSS peak +{med['analysis_peak'] / MiB:6.0f} MiB = {med['analysis_peak'] / size:4.2f}x the trace"
    )
    total = med["decode_s"] + med["analysis_s"]
    print(
        f"  both                             {total:6.2f} s  {n / total:>10,.0f} events/s"
        f" | RSS peak +{med['overall_peak'] / MiB:6.0f} MiB = {med['overall_peak'] / size:4.2f}x the trace"
        f" (over the {size / MiB:.0f} MiB of blobs held)"
    )
    print(
        f"  (peak live {runs[0]['peak_live'] / MiB:,.0f} MiB; the layer holding most at the peak: "
        f"{runs[0]['top_layer']})"
    )


if __name__ == "__main__":
    main()

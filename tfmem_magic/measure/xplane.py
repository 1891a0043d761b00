"""Read TensorFlow profiler XSpace files into columns of memory events, our own trace spans and XLA's runs.

We parse the xplane ourselves instead of TF's `memory_profile` tool: that tool keeps only the peak step and lumps
everything else together. The memory events of a line are decoded together with numpy, one protobuf field per
round (a million memory events' time and memory: benchmarks/analysis_1m.py, docs/overhead.md).

Memory. A blob is never parsed whole by a message class (TF's XSpace class holds ~6 bytes per byte of xplane; a lean
class that kept each event as a bytes object, plus the joined copy we decoded, ~4): a Python walk over the wire
format finds the planes, the lines and where each event starts (`_walk_line`), and numpy reads the events in place,
from the caller's bytes, CHUNK_EVENTS at a time. Only the memory events (81 bytes each, in columns of the narrowest
type), our spans and XLA's runs are kept, so that a tracer can decode each segment as soon as it is exported and
drop its bytes (`Decoded`); `finish` joins and sorts the blocks one column at a time. Reading then grows the RSS
high-water mark by about the blob's size, not a multiple of it (docs/overhead.md).

A missing `addr` stat reads as -1 (unknown) in both decoders, and the analysis never pairs events on it; an event
without `bytes_available` records no allocator limit (its `limit` column reads 0).
"""

from __future__ import annotations

import re
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tfmem_magic.core.types import ProtoMessage

ALLOC, FREE = "MemoryAllocation", "MemoryDeallocation"
_INT64_MASK = 2**63 - 1
SPAN_PREFIX = "tfmem:"  # TraceMe names we emit around Keras layer calls and weight creation
# XLA's runs, kept as spans named XLA_SPAN + the event's name. Measured on TF 2.21's CPU: a jit_compile=True step
# (Keras' or a tf.function's) runs in a "CpuExecutable::ExecuteAsyncOnStream" event, and the buffers XLA allocates
# are allocated inside it on the same thread (untagged, or tagged with the function's name); a GPU's executable
# records "<HLO module>:XLA GPU module" (xla/service/gpu/gpu_executable.cc), and TensorFlow's launch ops record
# "<node>:XlaLaunch" / "<node>:_XlaRun" (auto-clustering), around the allocations their kernel makes.
XLA_SPAN = "xla/"
XLA_GPU_MODULE = ":XLA GPU module"
_XLA_LAUNCH_OPS = frozenset({"XlaLaunch", "XlaLaunchV2", "_XlaRun"})
# an HLO module TensorFlow compiled from a function: "a_inference_step_878__XlaMustCompile_true_config_proto_...",
# "a_inference_one_step_on_data_803__.7" (measured); its function's op name is "__inference_step_878"
_HLO_MODULE = re.compile(r"^a(_inference_.+?_\d+)__")
# a tf.function's run, kept as a span named FUNCTION_SPAN + the function's op name: TensorFlow records each call of a
# function from Python as "EagerLocalExecute: __inference_step_1041" (host tracer level 2; measured on TF 2.21). The
# allocations of its ops are made inside it (on the runtime's threads): which concrete function made them
# (analyze/lines.py reads the function's stack traces)
FUNCTION_RUN = "EagerLocalExecute: "
FUNCTION_SPAN = "function/"
CHUNK_EVENTS = 1 << 14  # events of a line decoded together: bounds the decoder's temporaries (~3 MB)

# The stats we keep, in the column order of the decoder's matrix. Integers are 0 when absent, except addr and
# bytes_available (-1: unknown); strings are read as indices into the string table (-1 = absent). TensorFlow's BFC
# allocator writes bytes_available as its limit minus bytes_reserved minus bytes in use (AddTraceMe in
# xla/tsl/framework/bfc_allocator.cc): the three together are its limit, kept as one column.
_INT_STATS = (
    "bytes_allocated",
    "requested_bytes",
    "allocation_bytes",
    "addr",
    "data_type",
    "bytes_available",
    "bytes_reserved",
    "peak_bytes_in_use",
)
_STR_STATS = ("tf_op", "region_type", "shape", "allocator_name")
_ADDR = _INT_STATS.index("addr")
_AVAILABLE, _RESERVED = _INT_STATS.index("bytes_available"), _INT_STATS.index("bytes_reserved")
_LIFETIME_PEAK = _INT_STATS.index("peak_bytes_in_use")
_UNKNOWN_WHEN_ABSENT = (_ADDR, _AVAILABLE)
_REF_VALUE_TAG = 7 << 3  # XStat.ref_value (field 7, varint): how TF writes string stats, as ids into stat_metadata
# A block of decoded memory events: one array per column, in this order and of these types (81 bytes per event)
_FIELDS = (
    ("t_ps", np.int64),
    ("is_alloc", np.bool_),
    ("thread", np.int32),
    ("live", np.int64),
    ("requested", np.int64),
    ("chunk", np.int64),
    ("addr", np.int64),
    ("dtype", np.int32),
    ("op", np.int32),
    ("region", np.int32),
    ("shape", np.int32),
    ("allocator", np.int32),
    ("limit", np.int64),
    ("lifetime_peak", np.int64),
)
_COLUMN = {name: k for k, (name, _) in enumerate(_FIELDS)}
DATA_TYPES = {
    1: "float32",
    2: "float64",
    3: "int32",
    4: "uint8",
    5: "int16",
    6: "int8",
    7: "string",
    8: "complex64",
    9: "int64",
    10: "bool",
    14: "bfloat16",
    17: "uint16",
    18: "complex128",
    19: "float16",
    20: "resource",
    21: "variant",
    22: "uint32",
    23: "uint64",
}


@dataclass
class MemoryEvents:
    """Memory events of one traced allocator, sorted by time. Times are picoseconds from the first segment's start."""

    t_ps: np.ndarray  # int64
    is_alloc: np.ndarray  # bool
    live: np.ndarray  # int64: allocator bytes in use after the event
    requested: np.ndarray  # int64: bytes the op asked for
    chunk: np.ndarray  # int64: bytes the allocator handed out (rounded)
    addr: np.ndarray  # int64, -1 = unknown (the event had no addr stat)
    dtype: np.ndarray  # int64: TF DataType enum, 0 = unknown
    op: np.ndarray  # int32 index into strings, -1 = none
    region: np.ndarray  # int32 index into strings
    shape: np.ndarray  # int32 index into strings
    thread: np.ndarray  # int32 index into threads
    strings: list[str]
    threads: list[str]
    allocator: str | None = None
    # int64: the allocator's limit as the event states it (bytes_allocated + bytes_available + bytes_reserved);
    # 0 = not recorded
    limit: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.t_ps)

    def string(self, index: int) -> str | None:
        return None if index < 0 else self.strings[index]


@dataclass
class Span:
    name: str  # ours without the "tfmem:" prefix ("layer/dense", "weights/dense"); XLA's runs "xla/<event name>"
    start_ps: int
    end_ps: int
    thread: str


@dataclass
class AllocatorSeries:
    """One allocator's memory events in the trace, summed up. A GPU trace has several: each GPU's BFC allocator
    (`GPU_0_bfc`), the pinned host allocator (`gpu_host_bfc`), the CPU's."""

    name: str
    device: str | None  # the TF device it serves ("GPU:4" from "GPU_4_bfc", "CPU:0"); None: pinned host memory
    events: int
    peak_bytes: int  # the most it had in use
    limit_bytes: int | None  # what it may hand out in all (in use + available + reserved); None: not recorded
    start_bytes: int = 0  # in use before its first traced event
    end_bytes: int = 0  # in use after its last one
    timeline: list[list[float]] = field(default_factory=list)  # [[t seconds, in use], ...], downsampled, peak kept
    # the most it had in use since its process started (or its stats were last reset), as its events state it (BFC's
    # peak_bytes_in_use): above `peak_bytes` where an earlier moment, before the trace, held more. None: not recorded
    lifetime_peak_bytes: int | None = None


@dataclass
class Trace:
    events: MemoryEvents
    spans: list[Span] = field(default_factory=list)
    allocators: list[AllocatorSeries] = field(default_factory=list)  # the one kept in `events` first
    unreadable_planes: int = 0  # host planes skipped: their format needs TensorFlow's own reader, not installed
    xla_modules: list[str] = field(default_factory=list)  # HLO modules that ran in the trace (see _xla_modules)


# a GPU's BFC allocator, or its cudaMallocAsync one (TF_GPU_ALLOCATOR=cuda_malloc_async: "gpu_async_<id>")
_GPU_ALLOCATOR = re.compile(r"^(?:GPU_(\d+)_bfc|gpu_async_(\d+))$")


def allocator_device(name: str) -> str | None:
    """The TF device an allocator serves, from the name TensorFlow gives it: `GPU_4_bfc` (or `gpu_async_4`) ->
    GPU:4, a CPU allocator (`bfc_cpu_allocator_for_gpu`, `mklcpu`, `cpu`) -> CPU:0; the pinned host memory a GPU
    copies through (`gpu_host_bfc`, `cuda_host_bfc`) serves no TF device of its own: None."""
    gpu = _GPU_ALLOCATOR.match(name)
    if gpu:
        return f"GPU:{int(gpu.group(1) or gpu.group(2))}"
    lowered = name.lower()
    if "host" in lowered:
        return None
    return "CPU:0" if "cpu" in lowered else None


def _summaries(
    alloc_col: np.ndarray, c: dict[str, np.ndarray], strings: list[str]
) -> list[tuple[int, AllocatorSeries]]:
    """Per allocator (index into strings): its summary, from the columns t_ps, live, chunk, is_alloc, limit and
    lifetime_peak."""
    out = []
    for index in np.unique(alloc_col[alloc_col >= 0]):
        mine = np.nonzero(alloc_col == index)[0]
        in_use, limits = c["live"][mine], c["limit"][mine]
        limit = int(limits.max()) if (limits > 0).any() else None
        lifetime = c["lifetime_peak"][mine]
        times = c["t_ps"][mine]
        first, last = mine[np.argmin(times)], mine[len(mine) - 1 - np.argmax(times[::-1])]  # ties: the last one
        change = int(c["chunk"][first]) if c["is_alloc"][first] else -int(c["chunk"][first])
        name = strings[int(index)]
        out.append(
            (
                int(index),
                AllocatorSeries(
                    name,
                    allocator_device(name),
                    len(mine),
                    int(in_use.max()),
                    limit,
                    int(c["live"][first]) - change,
                    int(c["live"][last]),
                    _points(times, in_use),
                    int(lifetime.max()) if (lifetime > 0).any() else None,
                ),
            )
        )
    return out


def _points(t_ps: np.ndarray, live: np.ndarray, most: int = 300) -> list[list[float]]:
    """An allocator's in-use bytes over time, at most `most` points, its peak among them (seconds on the trace's
    clock, as the main timeline's)."""
    order = np.argsort(t_ps, kind="stable")
    picks = np.unique(
        np.concatenate(
            [np.linspace(0, len(order) - 1, min(most, len(order))).astype(np.int64), [int(np.argmax(live[order]))]]
        )
    )
    return [[round(float(t_ps[order[i]]) / 1e12, 6), int(live[order[i]])] for i in picks]


def _choose(series: list[tuple[int, AllocatorSeries]], device: str | None) -> tuple[int, AllocatorSeries]:
    """The allocator the report is about: the one serving `device` (the report's main device); else the busiest
    GPU's (the most grown within the trace: a multi-GPU trace's headline); else the allocator with the most events
    (the CPU's, on a CPU-only machine)."""
    if device is not None:
        serving = [s for s in series if s[1].device == device]
        if serving:
            return max(serving, key=lambda s: s[1].events)
    gpus = [s for s in series if (s[1].device or "").startswith("GPU:")]
    if gpus:
        return max(gpus, key=lambda s: (s[1].peak_bytes - s[1].start_bytes, s[1].events, -s[0]))
    return max(series, key=lambda s: (s[1].events, -s[0]))


class _Columns:
    """Blocks of decoded memory events (lists of arrays in _FIELDS order, never written to once made) and the
    string and thread tables their indices point into."""

    def __init__(self) -> None:
        self.blocks: list[list[np.ndarray]] = []
        self.strings: dict[str, int] = {}
        self.threads: dict[str, int] = {}
        self.unreadable = 0  # host planes neither decoder could read (the reference one needs TensorFlow)
        self.xla_modules: set[str] = set()

    def intern(self, text: str) -> int:
        index = self.strings.get(text)
        if index is None:
            index = self.strings[text] = len(self.strings)
        return index


def _block(
    t: np.ndarray, is_alloc: np.ndarray, thread: int | np.ndarray, ints: np.ndarray, strs: np.ndarray
) -> list[np.ndarray]:
    """One block of memory events as contiguous columns of their own (copies, never views of a decoder's matrix,
    which would keep all of it alive). ints: _INT_STATS columns; strs: string indices, _STR_STATS columns."""
    n = len(t)
    available = ints[:, _AVAILABLE]
    limit = np.where(available >= 0, ints[:, 0] + available + ints[:, _RESERVED], 0)
    return [
        np.array(t, dtype=np.int64),
        np.array(is_alloc, dtype=np.bool_),
        np.broadcast_to(np.asarray(thread, dtype=np.int32), (n,)).copy(),
        *(np.array(ints[:, k], dtype=np.int64) for k in range(4)),  # live, requested, chunk, addr
        np.array(ints[:, 4], dtype=np.int32),  # data type
        *(np.array(strs[:, k], dtype=np.int32) for k in range(len(_STR_STATS))),
        limit.astype(np.int64, copy=False),  # the allocator's limit as the event states it (0: not recorded)
        np.array(ints[:, _LIFETIME_PEAK], dtype=np.int64),  # its peak since the process started (0: not recorded)
    ]


# ---- the wire format --------------------------------------------------------------------------------------------


def _malformed(what: str) -> Exception:
    from google.protobuf.message import DecodeError

    error: Exception = DecodeError(f"malformed xplane: {what}")  # protobuf is untyped here (Any)
    return error


def _varint_at(data: bytes, pos: int) -> tuple[int, int]:
    """The varint at data[pos] (unsigned) and the position after it."""
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift >= 70:
            raise _malformed("a varint longer than 10 bytes")


def _field_at(data: bytes, pos: int) -> tuple[int, int, int, int]:
    """The field whose tag is at data[pos]: (number, wire type, start of its value, end). A length-delimited
    value's range is its payload; a varint's, its bytes."""
    key, pos = _varint_at(data, pos)
    wire = key & 7
    if wire == 0:
        start = pos
        _, pos = _varint_at(data, pos)
    elif wire == 2:
        size, start = _varint_at(data, pos)
        pos = start + size
    elif wire == 1:
        start, pos = pos, pos + 8
    elif wire == 5:
        start, pos = pos, pos + 4
    else:
        raise _malformed(f"wire type {wire}")
    return key >> 3, wire, start, pos


def _fields(data: bytes, pos: int, end: int) -> Iterator[tuple[int, int, int, int, int]]:
    """(tag position, number, wire type, value start, value end) of each field of the message in data[pos:end]."""
    while pos < end:
        number, wire, start, after = _field_at(data, pos)
        yield pos, number, wire, start, after
        pos = after
    if pos != end:
        raise _malformed("a field runs past its message")


def _int64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _walk_line(data: bytes, pos: int, end: int) -> tuple[str, int, np.ndarray]:
    """Name, timestamp_ns, and where each event's record (its tag) starts, of the serialized XLine in data[pos:end].

    The parse's only Python loop per event (~0.2 µs): events are consecutive length-delimited records, so where
    one starts is known only once the length of the one before is read. 8 bytes per event of the line."""
    name, timestamp_ns = "", 0
    records = array("q")
    add = records.append
    while pos < end:
        if data[pos] == 0x22:  # field 4 (events), length-delimited
            add(pos)
            size = data[pos + 1]
            if size < 0x80:
                pos += 2 + size
            else:
                size, pos = _varint_at(data, pos + 1)
                pos += size
            continue
        number, wire, start, pos = _field_at(data, pos)
        if number == 2 and wire == 2:
            name = bytes(data[start:pos]).decode("utf-8", "replace")
        elif number == 3 and wire == 0:
            timestamp_ns = _int64(_varint_at(data, start)[0])
    if pos != end:
        raise _malformed("an event runs past its line")
    return name, timestamp_ns, np.frombuffer(records, dtype=np.int64)


def _plane_parts(data: bytes, start: int, end: int) -> tuple[ProtoMessage, list[tuple[int, int]]]:
    """A serialized XPlane → its name and metadata (a lean message parsed from those fields alone: the lines are
    never copied) and the byte range of each of its lines."""
    meta_parts: list[bytes] = []
    lines: list[tuple[int, int]] = []
    for tag_pos, number, wire, value_start, value_end in _fields(data, start, end):
        if number == 3 and wire == 2:
            lines.append((value_start, value_end))
        elif number in (2, 4, 5):  # name, event_metadata, stat_metadata
            meta_parts.append(data[tag_pos:value_end])
    meta = _lazy_plane_class()()
    meta.ParseFromString(b"".join(meta_parts))
    return meta, lines


def read_xspace(
    data: bytes,
    offset_ps: int = 0,
    columns: _Columns | None = None,
    spans: list[Span] | None = None,
    reference: bool = False,
) -> tuple[_Columns, list[Span]]:
    """Parse one serialized XSpace, appending its host memory events to `columns` (times shifted by offset_ps).

    Each host plane is read by the vectorized decoder, or by the per-stat reference decoder (TF's own message
    class) when its wire data is not shaped as the fast one expects, or always with `reference=True` (tests)."""
    columns = columns if columns is not None else _Columns()
    spans = spans if spans is not None else []
    buf = np.frombuffer(data, dtype=np.uint8)  # a view: events are read in place
    try:
        planes = [
            (start, end) for _, number, wire, start, end in _fields(data, 0, len(data)) if number == 1 and wire == 2
        ]
        parts = [_plane_parts(data, start, end) for start, end in planes]
    except IndexError:
        raise _malformed("truncated") from None
    for (start, end), (meta, lines) in zip(planes, parts, strict=True):
        if not meta.name.startswith("/host:"):
            continue
        columns.xla_modules |= _xla_modules(meta)
        if not reference:
            try:
                _read_plane_fast(data, buf, meta, lines, offset_ps, columns, spans)
                continue
            except (_Unexpected, IndexError):
                pass
        try:
            from tensorflow.tsl.profiler.protobuf import xplane_pb2

            plane = xplane_pb2.XPlane()
        except (ImportError, AttributeError):  # no TensorFlow, or moved (capabilities.py says so in the report):
            columns.unreadable += 1  # this plane is skipped
            continue
        plane.ParseFromString(data[start:end])
        _read_plane_slow(plane, offset_ps, columns, spans)
    return columns, spans


_lazy_class: type | None = None
_lazy_plane: type | None = None


def _lazy_space_class() -> type:
    """Lean message classes for the same wire data: a Space of Planes that declare only their name and the names
    of their event and stat metadata. We parse a plane's metadata with it (`_plane_parts`): its lines, nearly all of
    the bytes, are walked by hand. Call it once from the main thread before decoding elsewhere: it imports protobuf.
    """
    global _lazy_class, _lazy_plane
    if _lazy_class is None:
        from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

        F = descriptor_pb2.FieldDescriptorProto
        proto = descriptor_pb2.FileDescriptorProto(name="tfmem_raw_xplane.proto", package="tfmem_raw", syntax="proto3")
        meta = proto.message_type.add(name="Meta")  # XEventMetadata and XStatMetadata share id=1 and name=2
        meta.field.add(name="id", number=1, type=F.TYPE_INT64, label=F.LABEL_OPTIONAL)
        meta.field.add(name="name", number=2, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
        plane = proto.message_type.add(name="Plane")
        plane.field.add(name="name", number=2, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
        for number, name in ((4, "event_metadata"), (5, "stat_metadata")):
            entry_name = "".join(part.title() for part in name.split("_")) + "Entry"
            entry = plane.nested_type.add(name=entry_name)
            entry.options.map_entry = True
            entry.field.add(name="key", number=1, type=F.TYPE_INT64, label=F.LABEL_OPTIONAL)
            entry.field.add(
                name="value", number=2, type=F.TYPE_MESSAGE, type_name=".tfmem_raw.Meta", label=F.LABEL_OPTIONAL
            )
            plane.field.add(
                name=name,
                number=number,
                type=F.TYPE_MESSAGE,
                type_name=f".tfmem_raw.Plane.{entry_name}",
                label=F.LABEL_REPEATED,
            )
        space = proto.message_type.add(name="Space")
        space.field.add(
            name="planes", number=1, type=F.TYPE_MESSAGE, type_name=".tfmem_raw.Plane", label=F.LABEL_REPEATED
        )
        pool = descriptor_pool.DescriptorPool()
        pool.Add(proto)
        _lazy_plane = message_factory.GetMessageClass(pool.FindMessageTypeByName("tfmem_raw.Plane"))
        _lazy_class = message_factory.GetMessageClass(pool.FindMessageTypeByName("tfmem_raw.Space"))
    return _lazy_class


def _lazy_plane_class() -> type:
    _lazy_space_class()
    assert _lazy_plane is not None  # set together with _lazy_class
    return _lazy_plane


def is_xla_run(name: str) -> bool:
    """An event of an XLA computation's run (see XLA_SPAN), by its TraceMe name."""
    return (
        name.startswith("CpuExecutable::Execute")
        or name.endswith(XLA_GPU_MODULE)
        or name.rpartition(":")[2].strip() in _XLA_LAUNCH_OPS
    )


def xla_function(module: str) -> str | None:
    """The op name of the function an HLO module was compiled from ("a_inference_step_878__XlaMustCompile_..." ->
    "__inference_step_878"), None for another module: allocations tagged with it are XLA's (a GPU executable's are
    made before its module's event begins; a run whose event the trace lost has none around them)."""
    match = _HLO_MODULE.match(module)
    return "_" + match.group(1) if match else None


def _xla_modules(plane: ProtoMessage) -> set[str]:
    """Names of the HLO modules that ran in a host plane, from its metadata alone: a GPU executable's run event
    ("<module>:XLA GPU module"); on a CPU, the values of the `hlo_module` stat XLA's ops carry (measured on TF 2.21:
    "a_inference_step_878__XlaMustCompile_true_config_proto_..."), which the plane declares as stat metadata names
    next to `hlo_module` itself. A run whose own event the trace lost (cut by a pause of the trace) is named here."""
    modules = {m.name[: -len(XLA_GPU_MODULE)] for m in plane.event_metadata.values() if m.name.endswith(XLA_GPU_MODULE)}
    names = [m.name for m in plane.stat_metadata.values()]
    if "hlo_module" in names:
        modules.update(name for name in names if _HLO_MODULE.match(name))
    return modules


def _event_ids(plane: ProtoMessage) -> tuple[set[int], set[int], dict[int, str]]:
    """Event metadata ids of allocations, frees, and the spans we keep (id -> span name): ours without their prefix,
    XLA's runs as XLA_SPAN + their name, tf.function runs as FUNCTION_SPAN + the function's name. One look at each
    name of the plane's metadata, none at its events."""
    alloc_ids, free_ids, span_ids = set(), set(), {}
    for k, meta in plane.event_metadata.items():
        if meta.name == ALLOC:
            alloc_ids.add(k)
        elif meta.name == FREE:
            free_ids.add(k)
        elif meta.name.startswith(SPAN_PREFIX):
            span_ids[k] = meta.name[len(SPAN_PREFIX) :]
        elif is_xla_run(meta.name):
            span_ids[k] = XLA_SPAN + meta.name
        elif meta.name.startswith(FUNCTION_RUN + "__inference_"):
            span_ids[k] = FUNCTION_SPAN + meta.name[len(FUNCTION_RUN) :]
    return alloc_ids, free_ids, span_ids


# ---- the reference decoder --------------------------------------------------------------------------------------


def _read_plane_slow(plane: ProtoMessage, offset_ps: int, cols: _Columns, spans: list[Span]) -> None:
    """Reference implementation, on TF's XPlane message: one protobuf stat at a time (~8 µs per memory event)."""
    stat_names = {k: v.name for k, v in plane.stat_metadata.items()}
    int_col = {k: _INT_STATS.index(n) for k, n in stat_names.items() if n in _INT_STATS}
    str_col = {k: len(_INT_STATS) + _STR_STATS.index(n) for k, n in stat_names.items() if n in _STR_STATS}
    alloc_ids, free_ids, span_ids = _event_ids(plane)
    if not (alloc_ids or free_ids or span_ids):
        return
    value_field: dict[int, str] = {}  # stat id -> the oneof field that holds its value, learnt on first sight
    width = len(_INT_STATS) + len(_STR_STATS)
    rows: list[tuple[int, ...]] = []
    intern = cols.intern
    for line in plane.lines:
        base = line.timestamp_ns * 1000 + offset_ps
        thread = cols.threads.setdefault(line.name, len(cols.threads))
        for event in line.events:
            mid = event.metadata_id
            is_alloc = mid in alloc_ids
            if not is_alloc and mid not in free_ids:
                name = span_ids.get(mid)
                if name is not None:
                    start = base + event.offset_ps
                    spans.append(Span(name, start, start + event.duration_ps, line.name))
                continue
            row = [0] * width
            for k in _UNKNOWN_WHEN_ABSENT:
                row[k] = -1  # addr, bytes available: unknown
            for i in range(len(_INT_STATS), width):
                row[i] = -1
            for stat in event.stats:
                sid = stat.metadata_id
                attr = value_field.get(sid)
                if attr is None:
                    attr = value_field[sid] = stat.WhichOneof("value") or "int64_value"
                col = int_col.get(sid)
                if col is not None:
                    # addresses are uint64: keep them in int64 (identity is all we use them for)
                    row[col] = getattr(stat, attr) & _INT64_MASK if col == _ADDR else getattr(stat, attr)
                    continue
                col = str_col.get(sid)
                if col is not None:
                    value = getattr(stat, attr)
                    if attr == "ref_value":
                        value = stat_names.get(value, "")
                    row[col] = intern(value) if value else -1
            rows.append((base + event.offset_ps, is_alloc, thread, *row))
    if rows:
        matrix = np.array(rows, dtype=np.int64).reshape(len(rows), 3 + width)
        cols.blocks.append(
            _block(
                matrix[:, 0],
                matrix[:, 1],
                matrix[:, 2],
                matrix[:, 3 : 3 + len(_INT_STATS)],
                matrix[:, 3 + len(_INT_STATS) :],
            )
        )


# ---- the vectorized decoder -------------------------------------------------------------------------------------


class _Unexpected(Exception):
    """The wire data is not shaped as the fast decoder expects: use the per-stat loop."""


def _varint(buf: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Decode one varint at each position; returns (values as uint64, lengths). Work ~ total varint bytes."""
    first = buf[pos]
    value = (first & 0x7F).astype(np.uint64)
    length = np.ones(len(pos), dtype=np.int64)
    going = np.nonzero(first >= 0x80)[0]
    k = 1
    while going.size:
        if k == 10:
            raise _Unexpected("varint longer than 10 bytes")
        b = buf[pos[going] + k]
        value[going] |= (b & 0x7F).astype(np.uint64) << np.uint64(7 * k)
        length[going] += 1
        going = going[b >= 0x80]
        k += 1
    return value, length


def _read_plane_fast(
    data: bytes,
    buf: np.ndarray,
    plane: ProtoMessage,
    lines: list[tuple[int, int]],
    offset_ps: int,
    cols: _Columns,
    spans: list[Span],
) -> None:
    """Decode the memory events (and our spans) of each line with numpy, CHUNK_EVENTS at a time, in place in `buf`
    (the blob's bytes; `plane`: its lean metadata, `lines`: the byte range of each line).

    Every stat we keep is a varint (ints, and strings as `ref_value` ids into the stat metadata); a stat in another
    encoding, or a multi-byte tag, raises _Unexpected before anything is appended (the string and thread tables
    may have grown: harmless)."""
    stat_names = {k: v.name for k, v in plane.stat_metadata.items()}
    alloc_ids, free_ids, span_ids = _event_ids(plane)
    if not (alloc_ids or free_ids or span_ids):
        return
    wanted_ids = np.array(sorted(alloc_ids | free_ids | set(span_ids)), dtype=np.int64)
    span_id_array = np.array(sorted(span_ids), dtype=np.int64)
    alloc_id_array = np.array(sorted(alloc_ids), dtype=np.int64)
    column, ref_string = _stat_tables(stat_names, cols)
    n_int = len(_INT_STATS)
    blocks: list[list[np.ndarray]] = []
    new_spans: list[Span] = []
    last = len(buf) - 1
    for line_start, line_end in lines:
        name, timestamp_ns, records = _walk_line(data, line_start, line_end)
        thread = cols.threads.setdefault(name, len(cols.threads))
        base = timestamp_ns * 1000 + offset_ps
        for lo in range(0, len(records), CHUNK_EVENTS):
            size, length = _varint(buf, records[lo : lo + CHUNK_EVENTS] + 1)  # each record: tag 0x22, size, event
            starts = records[lo : lo + CHUNK_EVENTS] + 1 + length
            ends = starts + size.astype(np.int64)
            # every event starts with its metadata_id (field 1), left out when 0
            mids = np.zeros(len(starts), dtype=np.int64)
            has_id = (starts < ends) & (buf[np.minimum(starts, last)] == 0x08)
            mids[has_id] = _varint(buf, starts[has_id] + 1)[0].astype(np.int64)
            pick = np.nonzero(np.isin(mids, wanted_ids))[0]
            if not pick.size:
                continue
            mid = mids[pick]
            offsets, durations, values = _decode_events(buf, starts[pick], ends[pick], column)
            t = base + offsets
            is_span = np.isin(mid, span_id_array)
            for i in np.nonzero(is_span)[0]:
                new_spans.append(Span(span_ids[int(mid[i])], int(t[i]), int(t[i] + durations[i]), name))
            mem = ~is_span
            if not mem.any():
                continue
            values = values[mem]
            refs = values[:, n_int:]
            known = (refs >= 0) & (refs < len(ref_string))  # a ref to no stat metadata reads as absent
            strs = np.where(known, ref_string[np.where(known, refs, 0)], -1)
            blocks.append(_block(t[mem], np.isin(mid[mem], alloc_id_array), thread, values[:, :n_int], strs))
    cols.blocks.extend(blocks)
    spans.extend(new_spans)


def _stat_tables(stat_names: dict[int, str], cols: _Columns) -> tuple[np.ndarray, np.ndarray]:
    """Per stat id: our column for its value (-1 = not kept), and the interned string of its name (for refs)."""
    max_id = max(stat_names, default=0) + 1
    column = np.full(max_id, -1, dtype=np.int64)  # stat id -> our column
    ref_string = np.full(max_id, -1, dtype=np.int64)  # ref id -> interned string index
    for k, name in stat_names.items():
        if name in _INT_STATS:
            column[k] = _INT_STATS.index(name)
        elif name in _STR_STATS:
            column[k] = len(_INT_STATS) + _STR_STATS.index(name)
        if name:
            ref_string[k] = cols.intern(name)
    return column, ref_string


def _decode_events(
    buf: np.ndarray, starts: np.ndarray, ends: np.ndarray, column: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """XEvent fields of many events at once, one field per round: (offset_ps, duration_ps, stat columns)."""
    n = len(starts)
    width = len(_INT_STATS) + len(_STR_STATS)
    values = np.full((n, width), -1, dtype=np.int64)  # strings absent, addr and bytes available unknown
    values[:, [k for k in range(len(_INT_STATS)) if k not in _UNKNOWN_WHEN_ABSENT]] = 0
    offsets = np.zeros(n, dtype=np.int64)
    durations = np.zeros(n, dtype=np.int64)
    p = starts.copy()
    active = np.arange(n)
    while active.size:
        pa = p[active]
        tag = buf[pa]
        if (tag >= 0x80).any():
            raise _Unexpected("multi-byte tag")
        field, wire = tag >> 3, tag & 7
        if ((wire == 3) | (wire == 4) | (wire > 5)).any():
            raise _Unexpected("group or unknown wire type")
        step = np.empty(len(pa), dtype=np.int64)
        varints = np.nonzero(wire == 0)[0]
        if varints.size:
            v, ln = _varint(buf, pa[varints] + 1)
            step[varints] = 1 + ln
            f = field[varints]
            offsets[active[varints[f == 2]]] = v[f == 2].astype(np.int64)
            durations[active[varints[f == 3]]] = v[f == 3].astype(np.int64)
        step[wire == 1] = 9
        step[wire == 5] = 5
        delimited = np.nonzero(wire == 2)[0]
        if delimited.size:
            size, ln = _varint(buf, pa[delimited] + 1)
            body = pa[delimited] + 1 + ln
            step[delimited] = 1 + ln + size.astype(np.int64)
            is_stat = field[delimited] == 4
            _decode_stats(
                buf,
                body[is_stat],
                body[is_stat] + size[is_stat].astype(np.int64),
                active[delimited[is_stat]],
                column,
                values,
            )
        p[active] = pa + step
        active = active[p[active] < ends[active]]
    return offsets, durations, values


def _decode_stats(
    buf: np.ndarray, start: np.ndarray, end: np.ndarray, rows: np.ndarray, column: np.ndarray, values: np.ndarray
) -> None:
    """One XStat per row: metadata_id (field 1) then one value field. Keeps varint values of known stats."""
    if not len(start):
        return
    has_id = buf[start] == 0x08
    stat_id = np.zeros(len(start), dtype=np.int64)
    q = start.copy()
    if has_id.any():
        v, ln = _varint(buf, start[has_id] + 1)
        stat_id[has_id] = v.astype(np.int64)
        q[has_id] = start[has_id] + 1 + ln
    has_value = q < end
    vtag = np.where(has_value, buf[np.minimum(q, len(buf) - 1)], 0)
    vwire = vtag & 7
    in_table = (stat_id >= 0) & (stat_id < len(column))
    col = np.where(in_table, column[np.where(in_table, stat_id, 0)], -1)
    wanted = col >= 0
    if (wanted & has_value & (vwire != 0)).any():
        raise _Unexpected("a kept stat that is not a varint")  # e.g. tf_op as str_value in another TF version
    take = np.nonzero(wanted & has_value)[0]
    if take.size:
        if ((col[take] >= len(_INT_STATS)) & (vtag[take] != _REF_VALUE_TAG)).any():
            raise _Unexpected("a string stat that is not a ref_value")
        v, _ = _varint(buf, q[take] + 1)
        v[col[take] == _ADDR] &= np.uint64(_INT64_MASK)  # addresses are uint64: identity is all we use them for
        values[rows[take], col[take]] = v.astype(np.int64)
    zero = np.nonzero(wanted & ~has_value)[0]  # proto3 leaves out a zero value
    values[rows[zero], col[zero]] = 0


# ---- the trace --------------------------------------------------------------------------------------------------


def finish(cols: _Columns, spans: list[Span], device: str | None = None) -> Trace:
    """Columns → arrays sorted by time, restricted to one allocator: the one serving `device` (the report's main
    device), else the busiest GPU's, else the busiest (see `_choose`). Every allocator's summary is kept.

    Takes the blocks out of `cols` (which is left empty of events) and joins, reorders and drops them one column at
    a time: the high-water mark is the blocks plus a few columns, not twice the blocks."""
    n = sum(len(block[0]) for block in cols.blocks)
    blocks: list[list[np.ndarray | None]] = [list(block) for block in cols.blocks]  # a taken column becomes None
    cols.blocks = []
    taken: dict[str, np.ndarray] = {}

    def take(name: str) -> np.ndarray:
        if name in taken:
            return taken.pop(name)
        k = _COLUMN[name]
        out = np.empty(n, dtype=_FIELDS[k][1])
        pos = 0
        for block in blocks:
            part, block[k] = block[k], None
            assert part is not None  # each column is taken once
            out[pos : pos + len(part)] = part
            pos += len(part)
        return out

    strings = list(cols.strings)
    threads = list(cols.threads)
    allocator = None
    keep = None
    allocators: list[AllocatorSeries] = []
    alloc_col = take("allocator")
    if (alloc_col >= 0).any():
        for name in ("t_ps", "live", "chunk", "is_alloc", "limit", "lifetime_peak"):
            taken[name] = take(name)
        series = _summaries(alloc_col, taken, strings)
        main, chosen = _choose(series, device)
        allocator = chosen.name
        allocators = [chosen] + [s for i, s in series if i != main]
        keep = np.nonzero((alloc_col == main) | (alloc_col < 0))[0]
    del alloc_col
    t = take("t_ps")
    order = np.argsort(t, kind="stable") if keep is None else keep[np.argsort(t[keep], kind="stable")]
    del keep
    columns = {"t_ps": t[order]}
    del t
    for name, _ in _FIELDS:
        if name not in columns and name not in ("allocator", "lifetime_peak"):
            columns[name] = take(name)[order]
    columns["dtype"] = columns["dtype"].astype(np.int64)
    events = MemoryEvents(**columns, strings=strings, threads=threads, allocator=allocator)
    return Trace(events, sorted(spans, key=lambda s: s.start_ps), allocators, cols.unreadable, sorted(cols.xla_modules))


class Decoded:
    """What we keep of xplane blobs once read: their memory events as columns (81 bytes each) and our spans.

    A tracer decodes each large segment as soon as it is exported, so that it never holds many raw blobs at once;
    `read_segments` merges it with any blobs still raw.
    """

    def __init__(self) -> None:
        self.columns = _Columns()
        self.spans: list[Span] = []
        self.xplane_bytes = 0  # size of the blobs read

    def add(self, data: bytes, offset_ps: int) -> None:
        read_xspace(data, offset_ps, self.columns, self.spans)
        self.xplane_bytes += len(data)

    @property
    def events(self) -> int:
        return sum(len(block[0]) for block in self.columns.blocks)

    @property
    def nbytes(self) -> int:
        return sum(column.nbytes for block in self.columns.blocks for column in block)


def _merge(into: _Columns, other: _Columns) -> None:
    """Append other's blocks to `into`, renumbering their thread and string indices. A column that needs no
    renumbering is shared, not copied (blocks are never written to); other is left as it was."""
    into.unreadable += other.unreadable
    into.xla_modules |= other.xla_modules
    strings = np.array([into.intern(text) for text in other.strings] + [-1], dtype=np.int32)
    threads = np.array(
        [into.threads.setdefault(name, len(into.threads)) for name in other.threads] + [-1], dtype=np.int32
    )
    renumber = []
    if not np.array_equal(threads[:-1], np.arange(len(other.threads))):
        renumber.append((_COLUMN["thread"], threads))
    if not np.array_equal(strings[:-1], np.arange(len(other.strings))):
        renumber += [(_COLUMN[name], strings) for name in ("op", "region", "shape", "allocator")]
    for block in other.blocks:
        block = list(block)
        for k, table in renumber:
            block[k] = table[block[k]]  # -1 (absent) maps to the -1 at the end
        into.blocks.append(block)


def read_segments(segments: list[tuple[bytes | Decoded, int]], device: str | None = None) -> Trace:
    """Parse several xplane blobs (each with its start offset in ps) into one time-ordered trace of the allocator
    serving `device` (see `finish`). An item may also be a `Decoded` (blobs read already, offsets applied) with
    offset 0. The items are not changed."""
    cols, spans = _Columns(), []
    for data, offset_ps in segments:
        if isinstance(data, Decoded):
            _merge(cols, data.columns)
            spans.extend(data.spans)
        else:
            read_xspace(data, offset_ps, cols, spans)
    return finish(cols, spans, device)


def read_file(path: str | Path, device: str | None = None) -> Trace:
    return read_segments([(Path(path).read_bytes(), 0)], device)

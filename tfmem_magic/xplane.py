"""Read TensorFlow profiler XSpace files into columns of memory events and our own trace spans.

We parse the xplane ourselves instead of TF's `memory_profile` tool: that tool keeps only the peak step and lumps
everything else together. The hot loop touches each stat once and caches, per stat id, which protobuf field holds
its value, so that a trace of 100k events reads in well under a second (see benchmarks/overhead.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ALLOC, FREE = "MemoryAllocation", "MemoryDeallocation"
_INT64_MASK = 2**63 - 1
SPAN_PREFIX = "tfmem:"  # TraceMe names we emit around Keras layer calls and weight creation

# Column order of the integer matrix; strings live in tables and the matrix holds their index (-1 = absent).
_INT_STATS = ("bytes_allocated", "requested_bytes", "allocation_bytes", "addr", "peak_bytes_in_use", "data_type")
_STR_STATS = ("tf_op", "region_type", "shape", "allocator_name")
DATA_TYPES = {
    1: "float32", 2: "float64", 3: "int32", 4: "uint8", 5: "int16", 6: "int8", 7: "string", 8: "complex64",
    9: "int64", 10: "bool", 14: "bfloat16", 17: "uint16", 18: "complex128", 19: "float16", 20: "resource",
    21: "variant", 22: "uint32", 23: "uint64",
}


@dataclass
class MemoryEvents:
    """Memory events of one traced allocator, sorted by time. Times are picoseconds from the first segment's start."""

    t_ps: np.ndarray  # int64
    is_alloc: np.ndarray  # bool
    live: np.ndarray  # int64: allocator bytes in use after the event
    requested: np.ndarray  # int64: bytes the op asked for
    chunk: np.ndarray  # int64: bytes the allocator handed out (rounded)
    addr: np.ndarray  # int64
    dtype: np.ndarray  # int64: TF DataType enum, 0 = unknown
    op: np.ndarray  # int32 index into strings, -1 = none
    region: np.ndarray  # int32 index into strings
    shape: np.ndarray  # int32 index into strings
    thread: np.ndarray  # int32 index into threads
    strings: list[str]
    threads: list[str]
    allocator: str | None = None

    def __len__(self) -> int:
        return len(self.t_ps)

    def string(self, index: int) -> str | None:
        return None if index < 0 else self.strings[index]


@dataclass
class Span:
    name: str  # without the "tfmem:" prefix, e.g. "layer/dense" or "weights/dense"
    start_ps: int
    end_ps: int
    thread: str


@dataclass
class Trace:
    events: MemoryEvents
    spans: list[Span] = field(default_factory=list)


class _Columns:
    """Growing Python lists for one parse; turned into arrays once."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, ...]] = []
        self.strings: dict[str, int] = {}
        self.threads: dict[str, int] = {}
        self.allocators: dict[str, int] = {}

    def intern(self, text: str) -> int:
        index = self.strings.get(text)
        if index is None:
            index = self.strings[text] = len(self.strings)
        return index


def read_xspace(data: bytes, offset_ps: int = 0, columns: _Columns | None = None,
                spans: list[Span] | None = None) -> tuple[_Columns, list[Span]]:
    """Parse one serialized XSpace, appending its host memory events to `columns` (times shifted by offset_ps)."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    space.ParseFromString(data)
    columns = columns or _Columns()
    spans = spans if spans is not None else []
    for plane in space.planes:
        if plane.name.startswith("/host:"):
            _read_plane(plane, offset_ps, columns, spans)
    return columns, spans


def _read_plane(plane, offset_ps: int, cols: _Columns, spans: list[Span]) -> None:
    stat_names = {k: v.name for k, v in plane.stat_metadata.items()}
    int_col = {k: _INT_STATS.index(n) for k, n in stat_names.items() if n in _INT_STATS}
    str_col = {k: len(_INT_STATS) + _STR_STATS.index(n) for k, n in stat_names.items() if n in _STR_STATS}
    alloc_ids, free_ids, span_ids = set(), set(), {}
    for k, meta in plane.event_metadata.items():
        if meta.name == ALLOC:
            alloc_ids.add(k)
        elif meta.name == FREE:
            free_ids.add(k)
        elif meta.name.startswith(SPAN_PREFIX):
            span_ids[k] = meta.name[len(SPAN_PREFIX):]
    if not (alloc_ids or free_ids or span_ids):
        return
    value_field: dict[int, str] = {}  # stat id -> the oneof field that holds its value, learnt on first sight
    width = len(_INT_STATS) + len(_STR_STATS)
    rows, intern = cols.rows, cols.intern
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
            row[3] = -1  # addr unknown
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
                    row[col] = getattr(stat, attr) & _INT64_MASK if col == 3 else getattr(stat, attr)
                    continue
                col = str_col.get(sid)
                if col is not None:
                    value = getattr(stat, attr)
                    if attr == "ref_value":
                        value = stat_names.get(value, "")
                    row[col] = intern(value) if value else -1
            rows.append((base + event.offset_ps, is_alloc, thread, *row))


def finish(cols: _Columns, spans: list[Span]) -> Trace:
    """Columns → arrays sorted by time, restricted to the allocator that did most of the work."""
    strings = list(cols.strings)
    threads = list(cols.threads)
    n_int = len(_INT_STATS)
    matrix = np.array(cols.rows, dtype=np.int64).reshape(len(cols.rows), 3 + n_int + len(_STR_STATS))
    alloc_col = matrix[:, 3 + n_int + _STR_STATS.index("allocator_name")]
    allocator = None
    keep = np.ones(len(matrix), dtype=bool)
    if (alloc_col >= 0).any():  # several allocators (a GPU's, a host one): keep the busiest
        values, counts = np.unique(alloc_col[alloc_col >= 0], return_counts=True)
        main = int(values[np.argmax(counts)])
        allocator = strings[main]
        keep = (alloc_col == main) | (alloc_col < 0)
    matrix = matrix[keep]
    matrix = matrix[np.argsort(matrix[:, 0], kind="stable")]
    ints = matrix[:, 3:3 + n_int]
    strs = matrix[:, 3 + n_int:].astype(np.int32)
    events = MemoryEvents(
        t_ps=matrix[:, 0].copy(), is_alloc=matrix[:, 1].astype(bool), thread=matrix[:, 2].astype(np.int32),
        live=ints[:, 0].copy(), requested=ints[:, 1].copy(), chunk=ints[:, 2].copy(), addr=ints[:, 3].copy(),
        dtype=ints[:, 5].copy(), op=strs[:, 0].copy(), region=strs[:, 1].copy(), shape=strs[:, 2].copy(),
        strings=strings, threads=threads, allocator=allocator,
    )
    return Trace(events, sorted(spans, key=lambda s: s.start_ps))


def read_segments(segments: list[tuple[bytes, int]]) -> Trace:
    """Parse several xplane blobs (each with its start offset in ps) into one time-ordered trace."""
    cols, spans = _Columns(), []
    for data, offset_ps in segments:
        read_xspace(data, offset_ps, cols, spans)
    return finish(cols, spans)


def read_file(path: str | Path) -> Trace:
    return read_segments([(Path(path).read_bytes(), 0)])

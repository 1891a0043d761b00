"""Read TensorFlow profiler XSpace files into columns of memory events and our own trace spans.

We parse the xplane ourselves instead of TF's `memory_profile` tool: that tool keeps only the peak step and lumps
everything else together. The hot loop touches each stat once and caches, per stat id, which protobuf field holds
its value, so that a trace of 100k events reads in well under a second (see benchmarks/overhead.py).

Memory: a blob is parsed once, with a lean message class that keeps each event as raw bytes (TF's full XSpace class
would hold about 6 bytes per byte of xplane, ours about 2), and only the memory events and our spans are kept, as
integer columns (`Decoded`), so that a tracer can decode each segment as soon as it is exported and drop its bytes.
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
        self.blocks: list[np.ndarray] = []  # int64 matrices: t, is_alloc, thread, ints..., string indices...
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
    lean = _lazy_space_class()()
    lean.ParseFromString(data)
    columns = columns or _Columns()
    spans = spans if spans is not None else []
    full = None  # TF's own message class, parsed only if the fast decoder cannot read a plane
    for k, plane in enumerate(lean.planes):
        if not plane.name.startswith("/host:"):
            continue
        try:
            _read_plane_fast(plane, plane, offset_ps, columns, spans)
        except _Unexpected:
            if full is None:
                from tensorflow.tsl.profiler.protobuf import xplane_pb2

                full = xplane_pb2.XSpace()
                full.ParseFromString(data)
            _read_plane_slow(full.planes[k], offset_ps, columns, spans)
    return columns, spans


_lazy_class = None


def _lazy_space_class() -> type:
    """A lean message class for the same wire data: planes with their names, metadata names and lines, in which
    each XLine's events stay raw bytes.

    Reading `events` then costs one bytes object per event instead of a message wrapper plus field accesses:
    memory events are picked out and decoded together with numpy. Fields we do not declare (stats of metadata,
    display names) stay unparsed. Call it once from the main thread before decoding elsewhere: it imports protobuf.
    """
    global _lazy_class
    if _lazy_class is None:
        from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

        F = descriptor_pb2.FieldDescriptorProto
        proto = descriptor_pb2.FileDescriptorProto(name="tfmem_raw_xplane.proto", package="tfmem_raw",
                                                   syntax="proto3")
        meta = proto.message_type.add(name="Meta")  # XEventMetadata and XStatMetadata share id=1 and name=2
        meta.field.add(name="id", number=1, type=F.TYPE_INT64, label=F.LABEL_OPTIONAL)
        meta.field.add(name="name", number=2, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
        line = proto.message_type.add(name="Line")
        line.field.add(name="name", number=2, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
        line.field.add(name="timestamp_ns", number=3, type=F.TYPE_INT64, label=F.LABEL_OPTIONAL)
        line.field.add(name="events", number=4, type=F.TYPE_BYTES, label=F.LABEL_REPEATED)
        plane = proto.message_type.add(name="Plane")
        plane.field.add(name="name", number=2, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
        plane.field.add(name="lines", number=3, type=F.TYPE_MESSAGE, type_name=".tfmem_raw.Line",
                        label=F.LABEL_REPEATED)
        for number, name in ((4, "event_metadata"), (5, "stat_metadata")):
            entry_name = "".join(part.title() for part in name.split("_")) + "Entry"
            entry = plane.nested_type.add(name=entry_name)
            entry.options.map_entry = True
            entry.field.add(name="key", number=1, type=F.TYPE_INT64, label=F.LABEL_OPTIONAL)
            entry.field.add(name="value", number=2, type=F.TYPE_MESSAGE, type_name=".tfmem_raw.Meta",
                            label=F.LABEL_OPTIONAL)
            plane.field.add(name=name, number=number, type=F.TYPE_MESSAGE,
                            type_name=f".tfmem_raw.Plane.{entry_name}", label=F.LABEL_REPEATED)
        space = proto.message_type.add(name="Space")
        space.field.add(name="planes", number=1, type=F.TYPE_MESSAGE, type_name=".tfmem_raw.Plane",
                        label=F.LABEL_REPEATED)
        pool = descriptor_pool.DescriptorPool()
        pool.Add(proto)
        _lazy_class = message_factory.GetMessageClass(pool.FindMessageTypeByName("tfmem_raw.Space"))
    return _lazy_class


def _event_ids(plane) -> tuple[set[int], set[int], dict[int, str]]:
    """Event metadata ids of allocations, frees, and our spans (id -> span name without the prefix)."""
    alloc_ids, free_ids, span_ids = set(), set(), {}
    for k, meta in plane.event_metadata.items():
        if meta.name == ALLOC:
            alloc_ids.add(k)
        elif meta.name == FREE:
            free_ids.add(k)
        elif meta.name.startswith(SPAN_PREFIX):
            span_ids[k] = meta.name[len(SPAN_PREFIX):]
    return alloc_ids, free_ids, span_ids


def _read_plane_slow(plane, offset_ps: int, cols: _Columns, spans: list[Span]) -> None:
    """Reference implementation: one protobuf stat at a time (~8 µs per memory event)."""
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
    if rows:
        cols.blocks.append(np.array(rows, dtype=np.int64).reshape(len(rows), 3 + width))


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


def _read_plane_fast(plane, raw_plane, offset_ps: int, cols: _Columns, spans: list[Span]) -> None:
    """Decode the memory events (and our spans) of each line together with numpy, from their raw bytes.

    Every stat we keep is a varint (ints, and strings as `ref_value` ids into the stat metadata); a stat in another
    encoding, or a multi-byte tag, raises _Unexpected before anything is appended. One line at a time, so that the
    temporary copies are those of the largest line, not of the plane.
    """
    stat_names = {k: v.name for k, v in plane.stat_metadata.items()}
    alloc_ids, free_ids, span_ids = _event_ids(plane)
    if not (alloc_ids or free_ids or span_ids):
        return
    wanted_ids = np.array(sorted(alloc_ids | free_ids | set(span_ids)), dtype=np.int64)
    span_id_array = np.array(sorted(span_ids), dtype=np.int64)
    alloc_id_array = np.array(sorted(alloc_ids), dtype=np.int64)
    column, ref_string = _stat_tables(stat_names, cols)
    line_names = [line.name for line in plane.lines]
    thread_of_line = [cols.threads.setdefault(name, len(cols.threads)) for name in line_names]
    blocks: list[np.ndarray] = []
    new_spans: list[Span] = []
    for k, raw_line in enumerate(raw_plane.lines):
        parts = list(raw_line.events)
        if not parts:
            continue
        length = np.fromiter(map(len, parts), dtype=np.int64, count=len(parts))
        parts.append(_PAD)  # room for the varint reader to look past the last byte
        buf = np.frombuffer(b"".join(parts), dtype=np.uint8)
        del parts
        ends = np.cumsum(length)
        starts = ends - length
        # every event starts with its metadata_id (field 1), left out when 0
        mids = np.zeros(len(starts), dtype=np.int64)
        has_id = buf[starts] == 0x08
        mids[has_id] = _varint(buf, starts[has_id] + 1)[0].astype(np.int64)
        pick = np.nonzero(np.isin(mids, wanted_ids))[0]
        if not pick.size:
            continue
        mid = mids[pick]
        offsets, durations, values = _decode_events(buf, starts[pick], ends[pick], column)
        t = raw_line.timestamp_ns * 1000 + offset_ps + offsets
        is_span = np.isin(mid, span_id_array)
        for i in np.nonzero(is_span)[0]:
            new_spans.append(Span(span_ids[int(mid[i])], int(t[i]), int(t[i] + durations[i]), line_names[k]))
        mem = ~is_span
        if not mem.any():
            continue
        values = values[mem]
        strs = values[:, len(_INT_STATS):]
        known = strs >= 0
        strs[known] = ref_string[np.minimum(strs[known], len(ref_string) - 1)]
        values[:, 3] &= _INT64_MASK  # addresses: identity only
        thread = thread_of_line[k]
        is_alloc = np.isin(mid[mem], alloc_id_array).astype(np.int64)
        blocks.append(np.column_stack([t[mem], is_alloc, np.full(len(values), thread, dtype=np.int64), values]))
    cols.blocks.extend(blocks)
    spans.extend(new_spans)


_PAD = bytes(16)


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


def _decode_events(buf: np.ndarray, starts: np.ndarray, ends: np.ndarray, column: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """XEvent fields of many events at once, one field per round: (offset_ps, duration_ps, stat columns)."""
    n = len(starts)
    width = len(_INT_STATS) + len(_STR_STATS)
    values = np.full((n, width), -1, dtype=np.int64)
    values[:, :len(_INT_STATS)] = 0
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
            _decode_stats(buf, body[is_stat], body[is_stat] + size[is_stat].astype(np.int64),
                          active[delimited[is_stat]], column, values)
        p[active] = pa + step
        active = active[p[active] < ends[active]]
    return offsets, durations, values


def _decode_stats(buf: np.ndarray, start: np.ndarray, end: np.ndarray, rows: np.ndarray, column: np.ndarray,
                  values: np.ndarray) -> None:
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
        v, _ = _varint(buf, q[take] + 1)
        values[rows[take], col[take]] = v.astype(np.int64)
    zero = np.nonzero(wanted & ~has_value)[0]  # proto3 leaves out a zero value
    values[rows[zero], col[zero]] = 0


def finish(cols: _Columns, spans: list[Span]) -> Trace:
    """Columns → arrays sorted by time, restricted to the allocator that did most of the work."""
    strings = list(cols.strings)
    threads = list(cols.threads)
    n_int = len(_INT_STATS)
    matrix = np.concatenate(cols.blocks) if cols.blocks else np.zeros((0, 3 + n_int + len(_STR_STATS)), np.int64)
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


class Decoded:
    """What we keep of xplane blobs once read: their memory events as integer columns (104 bytes each) and our spans.

    A tracer decodes each large segment as soon as it is exported, so that it never holds many raw blobs (and their
    parse) at once; `read_segments` merges it with any blobs still raw.
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
        return sum(len(block) for block in self.columns.blocks)

    @property
    def nbytes(self) -> int:
        return sum(block.nbytes for block in self.columns.blocks)


def _merge(into: _Columns, other: _Columns) -> None:
    """Append other's blocks to `into`, renumbering their thread and string indices (other is left as it was)."""
    strings = np.array([into.intern(text) for text in other.strings] + [-1], dtype=np.int64)
    threads = np.array([into.threads.setdefault(name, len(into.threads)) for name in other.threads] + [-1],
                       dtype=np.int64)
    first_str = 3 + len(_INT_STATS)
    for block in other.blocks:
        block = block.copy()
        block[:, 2] = threads[block[:, 2]]
        block[:, first_str:] = strings[block[:, first_str:]]  # -1 (absent) maps to the -1 at the end
        into.blocks.append(block)


def read_segments(segments: list[tuple[bytes | Decoded, int]]) -> Trace:
    """Parse several xplane blobs (each with its start offset in ps) into one time-ordered trace. An item may also
    be a `Decoded` (blobs read already, offsets applied) with offset 0. The items are not changed."""
    cols, spans = _Columns(), []
    for data, offset_ps in segments:
        if isinstance(data, Decoded):
            _merge(cols, data.columns)
            spans.extend(data.spans)
        else:
            read_xspace(data, offset_ps, cols, spans)
    return finish(cols, spans)


def read_file(path: str | Path) -> Trace:
    return read_segments([(Path(path).read_bytes(), 0)])

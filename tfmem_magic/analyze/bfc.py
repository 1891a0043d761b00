"""A simulator of TensorFlow's BFC allocator, and the replay of a traced allocation sequence through it.

The first building block of the step replay (docs/bfc-replay.md): to predict a step's peak at another batch, its
allocation sequence is replayed through the allocator TensorFlow uses, so that BFC's rounding, best-fit choice, chunk
splitting, coalescing and region growth are simulated instead of approximated by a fragmentation ratio.

What is followed, from `xla/tsl/framework/bfc_allocator.{h,cc}` (TensorFlow's `tensorflow/core/common_runtime/
bfc_allocator.cc` before the move to tsl, same algorithm since TF 2.4; read at TensorFlow's master branch):
- `RoundedBytes`: every request is rounded up to a multiple of kMinAllocationSize (256 bytes); a 0-byte request fails.
- bins (`BinNumForSize`, `BinNumToSize`): kNumBins = 21 bins, bin b holds free chunks of [256 << b, 256 << (b+1))
  bytes, the last one everything from 256 MiB up; each bin is ordered by (chunk size, address).
- `FindChunkPtr` / `FindTaggedChunkPtr`: scan from the request's bin upwards and take the first free chunk of at
  least the rounded size: the smallest that fits, the lowest address among equals.
- `AllocateChunkFromLowEnd`: split the chunk (`SplitChunk`, the remainder becomes a free chunk at the higher
  address) when chunk size >= 2 x rounded or chunk size - rounded >= max_internal_fragmentation_bytes_ (128 MiB, or
  Options.fragmentation_fraction x memory limit when that is set); otherwise the whole chunk is handed out.
- `FinishChunkAllocation`: bytes_in_use grows by the *chunk* size (not the request), peak_bytes_in_use follows it.
- `Extend`, when no free chunk fits: available = limit - pool bytes, rounded down to 256; fail if the rounded
  request exceeds it; double curr_region_allocation_bytes_ until the request fits (and, if no doubling was needed,
  double it after this region); the new region is min(curr_region_allocation_bytes_, available) bytes, one free
  chunk. curr_region_allocation_bytes_ starts at RoundedBytes(min(limit, 2 MiB)) with allow_growth and at
  RoundedBytes(limit) without (the whole limit at the first allocation). Regions are never merged: the
  sub-allocators TensorFlow uses by default (BasicCPUAllocator, the GPU's DeviceMemAllocator) do not
  `SupportsCoalescing`, so a chunk's neighbours are always in its own region.
- `DeallocateRawInternal` / `MarkFree` / `TryToCoalesce`: bytes_in_use drops by the chunk size; the freed chunk merges
  with its next neighbour, then with its previous one, when they are free.
- `DeallocateFreeRegions` (Options.garbage_collection: on for GPUs unless TF_ENABLE_GPU_GARBAGE_COLLECTION=false,
  off for the CPU): when even Extend fails, regions with no chunk in use go back to the sub-allocator, and Extend is
  tried once more.
- `AllocateRawInternal` returns nullptr (TensorFlow's ResourceExhausted) when all of that fails: `BFCOutOfMemory`.
- `GetStats`: bytes_in_use / peak_bytes_in_use are what `tf.config.experimental.get_memory_info` returns as
  'current' / 'peak'; pool_bytes (the regions held from the sub-allocator) is what the process's RSS (or the GPU's
  memory) sees of the allocator: `region_bytes` here.

How TensorFlow configures it (and so the simulator's defaults):
- CPU with TF_CPU_ALLOCATOR_USE_BFC=1 (what tfmem switches on; `ProcessState::GetCPUAllocator`,
  tensorflow/core/common_runtime/process_state.cc): allow_growth=True, limit TF_CPU_BFC_MEM_LIMIT_IN_MB MiB
  (64 GiB unset; tfmem sets the machine's memory), no garbage collection, name "bfc_cpu_allocator_for_gpu".
- GPU (`GPUBFCAllocator`, gpu_bfc_allocator.cc): allow_growth from GPUOptions.allow_growth or
  TF_FORCE_GPU_ALLOW_GROWTH (default False: one region of the whole limit), garbage collection on, the limit is the
  device memory TensorFlow takes (the traces' bytes_allocated + bytes_available + bytes_reserved).

Not modelled (none changes bytes_in_use in a single-threaded replay of TensorFlow's default configurations):
alignment padding (TF asks for at most 256-byte alignment, and every chunk starts 256-aligned, so
`LowEndAlignmentPadding` is 0), spatial partitioning (off unless asked), timestamped chunks and `SetSafeFrontier`
(`MergeTimestampedChunks`: only with a timing counter, GPUOptions.experimental.timestamped_allocator), the retry
that waits up to 10 s for another thread's free (`AllocateRawInternalWithRetry`), a sub-allocator that returns less
than asked (Extend's 0.9x backpedal) and the real addresses of regions (synthetic addresses here, regions in
creation order: they only break ties between equal-sized free chunks of different regions).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the self-check reads the tracer's columns; the simulator itself needs nothing but Python
    from tfmem_magic.measure.xplane import MemoryEvents

MIN_ALLOCATION_BITS = 8
MIN_ALLOCATION_SIZE = 1 << MIN_ALLOCATION_BITS  # kMinAllocationSize
NUM_BINS = 21  # kNumBins: the largest bin holds chunks of 256 << 20 = 256 MiB and up
DEFAULT_MAX_INTERNAL_FRAGMENTATION = 128 << 20  # the BFCAllocator constructor's default
INITIAL_GROWTH_REGION = 2 << 20  # "2MiB smallest initial allocation" with allow_growth
CPU_DEFAULT_LIMIT = (1 << 16) << 20  # TF_CPU_BFC_MEM_LIMIT_IN_MB's default (64 GiB)
UNLIMITED = 1 << 62
# synthetic addresses: regions are laid out one after another from here, with a gap so they are never adjacent
_BASE_ADDRESS = 1 << 40
_REGION_GAP = 1 << 30


_ROUND_DOWN = -MIN_ALLOCATION_SIZE  # a mask that clears the bits below 256


def rounded_bytes(nbytes: int) -> int:
    """`BFCAllocator::RoundedBytes`: up to a multiple of 256."""
    return MIN_ALLOCATION_SIZE * ((nbytes + MIN_ALLOCATION_SIZE - 1) // MIN_ALLOCATION_SIZE)


def bin_for_size(nbytes: int) -> int:
    """`BinNumForSize`: floor(log2(max(bytes, 256) / 256)), capped at the last bin. Written without min()/max(): the
    simulator asks it for every allocation and free."""
    if nbytes < MIN_ALLOCATION_SIZE:
        return 0
    b = (nbytes >> MIN_ALLOCATION_BITS).bit_length() - 1
    return b if b < NUM_BINS else NUM_BINS - 1


def bin_size(index: int) -> int:
    """`BinNumToSize`: the smallest chunk a bin holds."""
    return MIN_ALLOCATION_SIZE << index


class BFCOutOfMemory(MemoryError):
    """The allocation BFC's AllocateRaw would fail (TensorFlow raises ResourceExhaustedError for it): no free chunk
    fits and the allocator cannot extend under its limit (even after garbage collection, when that is on)."""

    def __init__(
        self, requested: int, rounded: int, bytes_in_use: int, region_bytes: int, limit: int, largest_free_chunk: int
    ) -> None:
        self.requested, self.rounded, self.bytes_in_use = requested, rounded, bytes_in_use
        self.region_bytes, self.limit, self.largest_free_chunk = region_bytes, limit, largest_free_chunk
        super().__init__(
            f"BFC out of memory allocating {requested} bytes (rounded to {rounded}): {bytes_in_use} in "
            f"use, {region_bytes} in regions of a {limit} limit, largest free chunk {largest_free_chunk}"
        )


@dataclass(eq=False, slots=True)
class _Chunk:
    """`BFCAllocator::Chunk`: a piece of one region, wholly in use or wholly free; prev/next are the physically
    adjacent chunks of the same region."""

    ptr: int
    size: int
    region: int  # the region's base address
    requested: int = 0
    handle: int = -1  # allocation id while in use (-1: free), as `allocation_id`
    prev: _Chunk | None = None
    next: _Chunk | None = None
    bin: int = -1  # -1: in no bin (in use, or being moved)

    @property
    def in_use(self) -> bool:
        return self.handle != -1


@dataclass
class _Region:
    ptr: int
    size: int
    first: _Chunk


class BFCSimulator:
    """One BFC allocator, in pure Python. `allocate` returns a handle (TensorFlow's allocation id) or raises
    `BFCOutOfMemory`; `free` takes the handle back.

    memory_limit: the allocator's total_memory (None: unbounded). allow_growth: regions start at 2 MiB and double
    (TensorFlow's CPU BFC, a GPU with allow_growth); without it the first allocation takes one region of the whole
    limit (a GPU's default). initial_region_bytes overrides curr_region_allocation_bytes_'s starting value.
    region_addresses: the addresses of the first regions (else synthetic ones, ascending): they only decide which of
    two equal-sized free chunks in different regions is taken.
    """

    def __init__(
        self,
        memory_limit: int | None = None,
        allow_growth: bool = True,
        initial_region_bytes: int | None = None,
        garbage_collection: bool = False,
        fragmentation_fraction: float = 0.0,
        region_addresses: Sequence[int] = (),
    ) -> None:
        self.memory_limit = UNLIMITED if memory_limit is None else int(memory_limit)
        self.allow_growth = allow_growth
        self.garbage_collection = garbage_collection
        if initial_region_bytes is not None:
            self._curr_region_bytes = rounded_bytes(initial_region_bytes)
        elif allow_growth:
            self._curr_region_bytes = rounded_bytes(min(self.memory_limit, INITIAL_GROWTH_REGION))
        else:
            self._curr_region_bytes = rounded_bytes(self.memory_limit)
        # the BFCAllocator constructor: a fraction of the limit when set, else 128 MiB
        self.max_internal_fragmentation = (
            int(fragmentation_fraction * self.memory_limit)
            if fragmentation_fraction > 0
            else DEFAULT_MAX_INTERNAL_FRAGMENTATION
        )
        # each bin: its free chunks' (size, ptr) keys, sorted as Bin::ChunkComparator sorts them
        self._bins: list[list[tuple[int, int]]] = [[] for _ in range(NUM_BINS)]
        self._free: dict[int, _Chunk] = {}  # ptr -> free chunk
        self._live: dict[int, _Chunk] = {}  # handle -> chunk in use
        self._regions: list[_Region] = []
        self._next_address = _BASE_ADDRESS
        # where the k-th region is (TensorFlow's own, learnt from a trace): equal-sized free chunks are taken lowest
        # address first, across regions too, and the sub-allocator's addresses are in no fixed order (glibc puts the
        # first CPU regions on its heap and later ones in mmaps at lower addresses)
        self._region_addresses = list(region_addresses)
        self._next_handle = 1
        self.bytes_in_use = 0
        self.peak_bytes_in_use = 0
        self.requested_in_use = 0
        self.region_bytes = 0  # stats_.pool_bytes
        self.peak_region_bytes = 0
        self.num_allocs = 0
        self.largest_alloc_size = 0
        self.regions_created = 0
        self.regions_made: list[tuple[int, int]] = []  # (address, size) of every region created, in order
        self.regions_released = 0  # by garbage collection

    # ---- the allocator's interface ----------------------------------------------------------------------------

    def allocate(self, nbytes: int) -> int:
        """`AllocateRawInternal`: best fit, else extend, else (garbage collection) release free regions and extend;
        raises BFCOutOfMemory where TensorFlow's allocation fails."""
        if nbytes <= 0:
            raise ValueError("BFC does not allocate 0 bytes (AllocateRawInternal returns nullptr)")
        rounded = (nbytes + MIN_ALLOCATION_SIZE - 1) & _ROUND_DOWN  # rounded_bytes, inline
        # the common case, `_find_chunk` + `_take` + `_split` + `_finish` written out: a replay comes here once an
        # allocation (docs/bfc-replay.md, "The peaks alone")
        bins = self._bins
        start = (rounded >> MIN_ALLOCATION_BITS).bit_length() - 1  # bin_for_size: rounded is 256 or more
        if start >= NUM_BINS:
            start = NUM_BINS - 1
        keys = bins[start]
        i = bisect_left(keys, (rounded, -1))
        found: list[tuple[int, int]] | None = keys
        if i == len(keys):
            found = None
            for b in range(start + 1, NUM_BINS):
                if bins[b]:
                    found, i = bins[b], 0
                    break
        if found is not None:
            _, ptr = found.pop(i)
            taken = self._free.pop(ptr)
            taken.bin = -1
            size = taken.size
            if size >= rounded * 2 or size - rounded >= self.max_internal_fragmentation:
                after = taken.next
                rest = _Chunk(ptr + rounded, size - rounded, taken.region, prev=taken, next=after)
                if after is not None:
                    after.prev = rest
                taken.next = rest
                taken.size = size = rounded
                self._insert_free(rest)
            handle = self._next_handle
            self._next_handle = handle + 1
            taken.handle, taken.requested = handle, nbytes
            self._live[handle] = taken
            self.num_allocs += 1
            self.bytes_in_use += size
            self.requested_in_use += nbytes
            if self.bytes_in_use > self.peak_bytes_in_use:
                self.peak_bytes_in_use = self.bytes_in_use
            if size > self.largest_alloc_size:
                self.largest_alloc_size = size
            return handle
        chunk: _Chunk | None = None
        if self._extend(rounded):
            chunk = self._find_chunk(rounded)
        if chunk is None and self._release_free_regions(rounded) and self._extend(rounded):
            chunk = self._find_chunk(rounded)
        if chunk is None:
            raise BFCOutOfMemory(
                nbytes, rounded, self.bytes_in_use, self.region_bytes, self.memory_limit, self.largest_free_chunk
            )
        return self._finish(chunk, rounded, nbytes)

    def try_allocate(self, nbytes: int) -> int | None:
        """allocate, or None where TensorFlow's AllocateRaw returns nullptr."""
        try:
            return self.allocate(nbytes)
        except BFCOutOfMemory:
            return None

    def free(self, handle: int) -> None:
        """`DeallocateRawInternal`: mark free, coalesce with free neighbours, put the result in its bin
        (`_insert_free` written out, as in `allocate`)."""
        chunk = self._live.pop(handle)
        chunk.handle = -1
        self.bytes_in_use -= chunk.size
        self.requested_in_use -= chunk.requested
        chunk.requested = 0
        chunk = self._coalesce(chunk)
        size = chunk.size
        b = (size >> MIN_ALLOCATION_BITS).bit_length() - 1  # bin_for_size: a chunk is 256 bytes or more
        if b >= NUM_BINS:
            b = NUM_BINS - 1
        chunk.bin = b
        insort(self._bins[b], (size, chunk.ptr))
        self._free[chunk.ptr] = chunk

    def grow(self, regions: int = 1) -> None:
        """Add `regions` empty regions as `Extend` would for a small request (each the current region size, which
        then doubles): the regions an allocator already held before a replay began."""
        for _ in range(regions):
            if not self._extend(MIN_ALLOCATION_SIZE):
                raise BFCOutOfMemory(
                    MIN_ALLOCATION_SIZE,
                    MIN_ALLOCATION_SIZE,
                    self.bytes_in_use,
                    self.region_bytes,
                    self.memory_limit,
                    self.largest_free_chunk,
                )

    def chunk_size(self, handle: int) -> int:
        """`AllocatedSize`: the chunk's bytes (what bytes_in_use counts for this allocation)."""
        return self._live[handle].size

    def address(self, handle: int) -> int:
        """The chunk's (synthetic) address."""
        return self._live[handle].ptr

    @property
    def region_sizes(self) -> list[int]:
        """The regions held, in the order they were created."""
        return [r.size for r in self._regions]

    @property
    def live_handles(self) -> list[int]:
        return list(self._live)

    @property
    def largest_free_chunk(self) -> int:
        """`LargestFreeChunk`: the last chunk of the highest non-empty bin."""
        for keys in reversed(self._bins):
            if keys:
                return keys[-1][0]
        return 0

    @property
    def fragmentation(self) -> float:
        """`GetFragmentation`: the share of the free pool bytes outside the largest free chunk."""
        available = self.region_bytes - self.bytes_in_use
        return (available - self.largest_free_chunk) / available if available > 0 else 0.0

    def reset_peak(self) -> None:
        """`ClearStats` (what tf.config.experimental.reset_memory_stats does): the peak restarts at bytes in use."""
        self.peak_bytes_in_use = self.bytes_in_use
        self.peak_region_bytes = self.region_bytes

    def chunks(self) -> list[tuple[int, int, bool]]:
        """Every chunk as (address, size, in use), region by region in address order (`RecordMemoryMap`)."""
        out = []
        for region in self._regions:
            c: _Chunk | None = region.first
            while c is not None:
                out.append((c.ptr, c.size, c.in_use))
                c = c.next
        return out

    # ---- internals, one per BFCAllocator method -----------------------------------------------------------------

    def _find_chunk(self, rounded: int) -> _Chunk | None:
        """`FindChunkPtr`: the first chunk of at least `rounded` bytes, scanning from its bin upwards. Within the
        request's own bin the chunks are sorted by size, so a bisect finds the smallest that fits; in every higher
        bin all chunks fit and the first is the smallest."""
        start = bin_for_size(rounded)
        keys = self._bins[start]
        i = bisect_left(keys, (rounded, -1))
        if i < len(keys):
            return self._take(start, i, rounded)
        for b in range(start + 1, NUM_BINS):
            if self._bins[b]:
                return self._take(b, 0, rounded)
        return None

    def _take(self, b: int, i: int, rounded: int) -> _Chunk:
        """`RemoveFreeChunkFromBin` + `AllocateChunkFromLowEnd`'s split rule."""
        _, ptr = self._bins[b].pop(i)
        chunk = self._free.pop(ptr)
        chunk.bin = -1
        if chunk.size >= rounded * 2 or chunk.size - rounded >= self.max_internal_fragmentation:
            self._split(chunk, rounded)
        return chunk

    def _split(self, chunk: _Chunk, nbytes: int) -> None:
        """`SplitChunk`: the chunk keeps its first nbytes; the rest becomes a free chunk after it."""
        rest = _Chunk(chunk.ptr + nbytes, chunk.size - nbytes, chunk.region, prev=chunk, next=chunk.next)
        if chunk.next is not None:
            chunk.next.prev = rest
        chunk.next = rest
        chunk.size = nbytes
        self._insert_free(rest)

    def _finish(self, chunk: _Chunk, rounded: int, nbytes: int) -> int:
        """`FinishChunkAllocation`: the chunk's whole size counts as in use."""
        handle = self._next_handle
        self._next_handle += 1
        chunk.handle, chunk.requested = handle, nbytes
        self._live[handle] = chunk
        self.num_allocs += 1
        size = chunk.size
        self.bytes_in_use += size
        self.requested_in_use += nbytes
        if self.bytes_in_use > self.peak_bytes_in_use:  # max(): a replay comes here once an allocation
            self.peak_bytes_in_use = self.bytes_in_use
        if size > self.largest_alloc_size:
            self.largest_alloc_size = size
        return handle

    def _insert_free(self, chunk: _Chunk) -> None:
        """`InsertFreeChunk`."""
        b = bin_for_size(chunk.size)
        chunk.bin = b
        insort(self._bins[b], (chunk.size, chunk.ptr))
        self._free[chunk.ptr] = chunk

    def _remove_free(self, chunk: _Chunk) -> None:
        """`RemoveFreeChunkFromBin`."""
        keys = self._bins[chunk.bin]
        del keys[bisect_left(keys, (chunk.size, chunk.ptr))]
        del self._free[chunk.ptr]
        chunk.bin = -1

    def _coalesce(self, chunk: _Chunk) -> _Chunk:
        """`TryToCoalesce`: merge the next chunk into this one, then this one into the previous, when free."""
        nxt = chunk.next
        if nxt is not None and nxt.handle == -1:  # free (`in_use`, without a property's call: a hot path)
            self._remove_free(nxt)
            self._merge(chunk, nxt)
        prev = chunk.prev
        if prev is not None and prev.handle == -1:
            self._remove_free(prev)
            self._merge(prev, chunk)
            chunk = prev
        return chunk

    @staticmethod
    def _merge(first: _Chunk, second: _Chunk) -> None:
        """`MergeChunks`: second (physically after first) is absorbed."""
        first.next = second.next
        if second.next is not None:
            second.next.prev = first
        first.size += second.size

    def _extend(self, rounded: int) -> bool:
        """`Extend`: a new region of curr_region_allocation_bytes_ (doubled as needed), within the limit."""
        available = (self.memory_limit - self.region_bytes) // MIN_ALLOCATION_SIZE * MIN_ALLOCATION_SIZE
        if rounded > available:
            return False
        increased = False
        while rounded > self._curr_region_bytes:
            self._curr_region_bytes *= 2
            increased = True
        size = min(self._curr_region_bytes, available)
        if not increased:
            self._curr_region_bytes *= 2
        ptr = self._next_address
        if self.regions_created < len(self._region_addresses):
            wanted = self._region_addresses[self.regions_created]
            # a given address is used only where the region fits there (a replay's regions can differ in size
            # from those of the run the addresses were learnt from)
            if all(wanted + size <= r.ptr or r.ptr + r.size <= wanted for r in self._regions):
                ptr = wanted
        self._next_address = max(self._next_address, ptr + size + _REGION_GAP)
        chunk = _Chunk(ptr, size, ptr)
        self._regions.append(_Region(ptr, size, chunk))
        self.regions_made.append((ptr, size))
        self.region_bytes += size
        self.peak_region_bytes = max(self.peak_region_bytes, self.region_bytes)
        self.regions_created += 1
        self._insert_free(chunk)
        return True

    def _release_free_regions(self, rounded: int) -> bool:
        """`DeallocateFreeRegions` (only with garbage_collection): hand back the regions with no chunk in use, when
        that with the unallocated bytes could serve the request."""
        if not self.garbage_collection:
            return False
        free_regions = [r for r in self._regions if self._region_unused(r)]
        total = sum(r.size for r in free_regions)
        if total == 0 or rounded > self.memory_limit - self.region_bytes + total:
            return False
        for region in free_regions:
            c: _Chunk | None = region.first
            while c is not None:
                if c.bin != -1:
                    self._remove_free(c)
                c = c.next
            self._regions.remove(region)
            self.region_bytes -= region.size
            self.regions_released += 1
        return True

    @staticmethod
    def _region_unused(region: _Region) -> bool:
        c: _Chunk | None = region.first
        while c is not None:
            if c.in_use:
                return False
            c = c.next
        return True


# ---- replay -------------------------------------------------------------------------------------------------------


@dataclass
class LiveAllocation:
    """An allocation live at the simulated peak."""

    key: Any  # the event's address or id
    requested: int
    chunk: int  # the simulated chunk's bytes
    index: int  # the event that allocated it (-1: live before the replay began)


@dataclass
class ReplayResult:
    """What a replay through the simulator found. Indices are positions in the event sequence."""

    peak_bytes_in_use: int  # the most in use (chunk bytes, as TensorFlow's peak_bytes_in_use)
    peak_index: int | None  # the event after which it was first reached (None: no allocation replayed)
    peak_time: Any  # that event's time when the events carried times, else None
    peak_region_bytes: int  # the most bytes held in regions (what RSS / device memory sees)
    live_at_peak: list[LiveAllocation]  # largest chunks first
    bytes_in_use: list[int]  # in use after each event
    chunk_bytes: list[int]  # each allocation's simulated chunk (0 for frees and skipped events)
    addresses: list[int]  # each allocation's simulated (synthetic) address (0 for frees and skipped events)
    region_bases: list[int]  # the address of the region each allocation's chunk is in (0 for frees and skipped)
    final_bytes_in_use: int
    final_region_bytes: int
    largest_free_chunk_at_peak: int
    oom_index: int | None = None  # the allocation the simulated allocator could not serve (replay stopped there)
    oom: BFCOutOfMemory | None = None
    unmatched_frees: int = 0  # frees of keys never allocated in the replay (allocated before it began)
    reallocated_keys: int = 0  # allocations at a key still live (a missed free): the old one was freed first
    simulator: BFCSimulator | None = field(default=None, repr=False)

    @property
    def requested_at_peak(self) -> int:
        return sum(a.requested for a in self.live_at_peak)


Event = tuple[Any, ...]  # (kind, key, requested_bytes) or (kind, key, requested_bytes, time)


def replay(
    events: Iterable[Event],
    memory_limit: int | None = None,
    allow_growth: bool = True,
    initial_region_bytes: int | None = None,
    garbage_collection: bool = False,
    fragmentation_fraction: float = 0.0,
    simulator: BFCSimulator | None = None,
    live: dict[Any, int] | None = None,
    stop_at_oom: bool = True,
) -> ReplayResult:
    """Replay a time-ordered sequence of ('alloc' | 'free', key, requested bytes[, time]) through a BFC simulator
    (a fresh one with these settings, or `simulator`, e.g. one seeded with what was live before: `live` maps the
    keys of those seeded allocations to their handles, so that the sequence's frees of them free them).

    A free's requested bytes are not used (the chunk is the key's). A free of a key never allocated here is counted
    (`unmatched_frees`) and skipped; an allocation at a key still live frees the old allocation first (a free the
    trace missed). The live set at the peak is recorded when the peak is first reached (the trace's own peak rule).
    """
    sim = (
        simulator
        if simulator is not None
        else BFCSimulator(memory_limit, allow_growth, initial_region_bytes, garbage_collection, fragmentation_fraction)
    )
    handles: dict[Any, tuple[int, int]] = {k: (h, -1) for k, h in (live or {}).items()}  # key -> (handle, index)
    seeded = {k: (sim._live[h].requested, sim._live[h].size) for k, (h, _) in handles.items()}
    events = events if isinstance(events, list) else list(events)  # read twice: the live set at the peak, below
    in_use: list[int] = []
    chunks: list[int] = []
    addresses: list[int] = []
    bases: list[int] = []
    peak = sim.bytes_in_use
    peak_index: int | None = None
    peak_time: Any = None
    live_at_peak: list[LiveAllocation] = []
    largest_free_at_peak = sim.largest_free_chunk
    unmatched = reallocated = 0
    oom_index: int | None = None
    oom: BFCOutOfMemory | None = None
    for i, event in enumerate(events):
        kind, key, nbytes = event[0], event[1], event[2]
        when = event[3] if len(event) > 3 else None
        chunk = address = base = 0
        if kind == "alloc":
            if key in handles:
                sim.free(handles.pop(key)[0])
                reallocated += 1
            if nbytes > 0:
                try:
                    handle = sim.allocate(int(nbytes))
                except BFCOutOfMemory as exc:
                    oom_index, oom = i, exc
                    in_use.append(sim.bytes_in_use)
                    chunks.append(0)
                    addresses.append(0)
                    bases.append(0)
                    if stop_at_oom:
                        break
                    continue
                handles[key] = (handle, i)
                chunk, address, base = sim.chunk_size(handle), sim.address(handle), sim._live[handle].region
        elif kind == "free":
            if key in handles:
                sim.free(handles.pop(key)[0])
            else:
                unmatched += 1
        else:
            raise ValueError(f"event {i}: kind {kind!r} is neither 'alloc' nor 'free'")
        in_use.append(sim.bytes_in_use)
        chunks.append(chunk)
        addresses.append(address)
        bases.append(base)
        if sim.bytes_in_use > peak:
            peak, peak_index, peak_time = sim.bytes_in_use, i, when
            largest_free_at_peak = sim.largest_free_chunk
    if peak_index is not None:  # rebuilt once here, not at every new peak (that was most of a replay's time)
        live_at_peak = _live_after(events, peak_index, seeded, chunks)
    live_at_peak.sort(key=lambda a: -a.chunk)
    return ReplayResult(
        peak,
        peak_index,
        peak_time,
        sim.peak_region_bytes,
        live_at_peak,
        in_use,
        chunks,
        addresses,
        bases,
        sim.bytes_in_use,
        sim.region_bytes,
        largest_free_at_peak,
        oom_index,
        oom,
        unmatched,
        reallocated,
        sim,
    )


def _live_after(
    events: list[Event], last: int, seeded: dict[Any, tuple[int, int]], chunks: list[int]
) -> list[LiveAllocation]:
    """The allocations live after event `last`, by the replay's own rules (an allocation at a live key replaces it,
    a free of an unknown key is skipped): seeded ones first, each with its requested bytes and simulated chunk."""
    alive: dict[Any, tuple[int, int, int]] = {k: (requested, size, -1) for k, (requested, size) in seeded.items()}
    for i in range(last + 1):
        kind, key = events[i][0], events[i][1]
        alive.pop(key, None)
        if kind == "alloc" and chunks[i]:
            alive[key] = (int(events[i][2]), chunks[i], i)
    return [LiveAllocation(k, requested, size, at) for k, (requested, size, at) in alive.items()]


# ---- the self-check against a trace ---------------------------------------------------------------------------------


@dataclass
class SelfCheck:
    """A traced allocator's sequence replayed through the simulator, against what TensorFlow reported.

    TensorFlow writes its bytes_in_use after every event (`AddTraceMe`'s bytes_allocated): the simulated value after
    the same event is compared with it, the peaks too. Bytes live before the trace began are seeded first (see
    `self_check`), so both series start from the same value."""

    events: int
    allocations: int
    traced_peak: int  # TF's bytes in use at its peak in the trace
    simulated_peak: int
    peak_error: float  # (simulated - traced) / traced
    traced_peak_index: int
    simulated_peak_index: int | None
    max_abs_error: int  # the largest |simulated - traced| bytes in use over the events
    max_rel_error: float  # the same relative to TF's value there
    events_exact: int  # events after which both agree to the byte
    first_divergence: int | None  # the first event after which they differ (None: never)
    chunks_exact: int  # in-trace allocations whose simulated chunk is TF's (allocation_bytes)
    chunks_larger_traced: int  # ... where TF handed out a larger chunk (it did not split, the simulator did)
    chunks_larger_simulated: int  # ... where the simulator did not split and TF did
    # in-trace allocations at the same place as TensorFlow's: region by region, the simulated address and TF's
    # differ by one constant (the region's real base minus its synthetic one; the most common difference in each
    # simulated region is taken as that), so this counts the allocations whose difference is their region's
    placements_exact: int
    preexisting_bytes: int  # in use before the first event
    preexisting_freed: int  # allocations made before the trace and freed in it
    limit: int | None
    allow_growth: bool
    simulated_region_peak: int
    passed: bool  # |peak_error| within the tolerance
    tolerance: float
    result: ReplayResult = field(repr=False)
    note: str = ""
    prepared: PreparedTrace | None = field(default=None, repr=False)  # the trace as replayed, regions learnt


@dataclass
class PreparedTrace:
    """One traced allocator's events as plain lists, with what was live before its first event and the allocator's
    settings (see `prepare`): replayed once by the self-check, and again at other request sizes by the step replay."""

    events: int
    is_alloc: list[bool]
    addr: list[int]
    requested: list[int]
    chunk: list[int]
    live: list[int]
    t_ps: list[int]
    start: int  # bytes in use before the first event
    pre: dict[int, int]  # allocations made before the trace and freed in it: address -> chunk bytes
    rest: int  # the bytes in use before the trace that are never freed in it (one block)
    first_traced: int | None  # the lowest address an in-trace allocation got, if any
    memory_limit: int | None
    allow_growth: bool
    garbage_collection: bool
    seed_layout: str
    region_addresses: list[int] = field(default_factory=list)  # TF's, learnt by the self-check


def prepare(
    events: MemoryEvents,
    memory_limit: int | None = None,
    allow_growth: bool | None = None,
    garbage_collection: bool | None = None,
    seed_layout: str | None = None,
) -> PreparedTrace:
    """The trace's columns as lists and its seed (see `self_check` for the settings' defaults and the layouts)."""
    n = len(events)
    if n == 0:
        raise ValueError("no memory events to replay")
    name = events.allocator or ""
    gpu = name.startswith("GPU_")
    if memory_limit is None and events.limit is not None and (events.limit > 0).any():
        memory_limit = int(events.limit.max())
    if allow_growth is None:
        allow_growth = not gpu
    if garbage_collection is None:
        garbage_collection = gpu
    is_alloc = events.is_alloc.tolist()
    addr = events.addr.tolist()
    chunk = events.chunk.tolist()
    live = events.live.tolist()
    start = live[0] - chunk[0] if is_alloc[0] else live[0] + chunk[0]
    # allocations made before the trace and freed in it: a free at an address no traced allocation holds
    seen: set[int] = set()
    pre: dict[int, int] = {}  # address -> chunk bytes
    for a, is_a, c in zip(addr, is_alloc, chunk, strict=True):
        if a < 0:
            continue
        if is_a:
            seen.add(a)
        elif a not in seen and a not in pre:
            pre[a] = c
        elif not is_a:
            seen.discard(a)
    if seed_layout is None:
        seed_layout = "compact" if allow_growth else "addresses"
    if seed_layout not in ("addresses", "compact"):
        raise ValueError(f"seed_layout {seed_layout!r}: 'addresses' or 'compact'")
    first_traced = next((a for a, is_a in zip(addr, is_alloc, strict=True) if is_a and a >= 0), None)
    return PreparedTrace(
        n,
        is_alloc,
        addr,
        events.requested.tolist(),
        chunk,
        live,
        events.t_ps.tolist(),
        start,
        pre,
        max(0, start - sum(pre.values())),
        first_traced,
        memory_limit,
        allow_growth,
        garbage_collection,
        seed_layout,
    )


def replay_prepared(
    trace: PreparedTrace,
    requested: Sequence[int] | None = None,
    region_addresses: Sequence[int] | None = None,
    memory_limit: int | None = None,
) -> ReplayResult:
    """Seed a simulator with what was live before the trace, then replay the trace's events, each allocation asking
    for `requested[i]` bytes (the trace's own requests by default: another batch's, for the step replay). The
    regions get `region_addresses` (default: the ones the self-check learnt), and the limit `memory_limit` (default:
    the trace's)."""
    sim, seeded = _seeded(trace, region_addresses, memory_limit)
    sizes = trace.requested if requested is None else requested
    addr, is_alloc, t_ps = trace.addr, trace.is_alloc, trace.t_ps
    seq = [
        ("alloc" if is_alloc[i] else "free", addr[i] if addr[i] >= 0 else ("unknown", i), sizes[i], t_ps[i])
        for i in range(trace.events)
    ]
    return replay(seq, simulator=sim, live=seeded)


def replay_peaks(
    trace: PreparedTrace, requested: Sequence[int] | None = None, memory_limit: int | None = None
) -> tuple[int, int]:
    """`replay_prepared`'s peak_bytes_in_use and peak_region_bytes alone, by the same rules, without its record of
    every event: what the step replay's searches ask at each batch, in about half the time (docs/bfc-replay.md)."""
    sim, handles = _seeded(trace, None, memory_limit)
    sizes = trace.requested if requested is None else requested
    allocate, free, live = sim.allocate, sim.free, handles.pop
    for a, is_a, nbytes in zip(trace.addr, trace.is_alloc, sizes, strict=True):
        if a >= 0:  # an allocation at a live key: the free the trace missed, first; a free of a key never
            old = live(a, None)  # allocated here is skipped
            if old is not None:
                free(old)
        if is_a and nbytes > 0:
            try:
                handle = allocate(int(nbytes))
            except BFCOutOfMemory:  # replay's stop_at_oom
                break
            if a >= 0:  # an unknown address is a key of its own, never freed
                handles[a] = handle
    return sim.peak_bytes_in_use, sim.peak_region_bytes


def _seeded(
    trace: PreparedTrace, region_addresses: Sequence[int] | None, memory_limit: int | None
) -> tuple[BFCSimulator, dict[Any, int]]:
    """A simulator holding what was live before the trace (its peak reset there), and the seeded keys' handles."""
    addresses = trace.region_addresses if region_addresses is None else region_addresses
    limit = trace.memory_limit if memory_limit is None else memory_limit
    sim = BFCSimulator(limit, trace.allow_growth, None, trace.garbage_collection, region_addresses=addresses)
    seeded: dict[Any, int] = {}  # key -> handle of what was live before the trace
    if trace.rest:
        seeded[("preexisting", "never freed")] = sim.allocate(trace.rest)
    pre = trace.pre
    if trace.seed_layout == "addresses":
        # the known chunks at their offsets from the lowest address the trace shows: each gap before one is a
        # placeholder allocation, freed once the seed is laid out, so it becomes a free chunk between them
        cursor = min([*pre, *([trace.first_traced] if trace.first_traced is not None else [])], default=0)
        holes: list[int] = []
        for a in sorted(pre):
            if a > cursor:
                holes.append(sim.allocate(a - cursor))
            seeded[a] = sim.allocate(pre[a])
            cursor = a + pre[a]
        for h in holes:
            sim.free(h)
    else:
        for a in sorted(pre):
            seeded[a] = sim.allocate(pre[a])
    sim.reset_peak()
    return sim, seeded


def self_check(
    events: MemoryEvents,
    memory_limit: int | None = None,
    allow_growth: bool | None = None,
    garbage_collection: bool | None = None,
    tolerance: float = 0.01,
    seed_layout: str | None = None,
) -> SelfCheck:
    """Replay one traced allocator's events (the columns `xplane.read_segments` returns, `Trace.events`) and compare
    the simulated bytes in use after every event and at the peak with what TensorFlow reported.

    The settings default to the trace's: the limit its events state (bytes_allocated + bytes_available +
    bytes_reserved); a GPU allocator ("GPU_<n>_bfc") without allow_growth and with garbage collection (TensorFlow's
    GPU defaults), any other with allow_growth and without (the CPU's BFC).

    A trace rarely starts with an empty allocator: what was live before its first event is seeded first. The
    allocations made before the trace and freed in it are known (their address and chunk from the free event); the
    rest of the bytes in use then is one block. `seed_layout="addresses"` allocates them in address order, the
    never-freed block first (a fresh allocator hands out low addresses first, and what lives longest was mostly
    allocated first), with the gaps between known chunks left free up to the trace's own addresses: that is the free
    space TensorFlow had at the trace's start as far as the trace shows it. `"compact"` packs the known chunks with no
    gaps. The default is "addresses" for one region (no allow_growth: offsets in it are TF's offsets) and "compact"
    with growth (the regions are separate mallocs). Either way the free chunks the allocator had before the trace are
    a guess, so a trace that begins mid-run can differ from TensorFlow where its first allocations reuse holes the
    trace never saw (measured: docs/bfc-replay.md).

    The regions' addresses are TensorFlow's where the trace shows them (`regions_seen`: a region's chunks tile it
    from its low end, so the address ranges its allocations covered merge into one span per region); else they are
    learnt from a first replay and the replay is run again with them (see the loop below).
    """
    trace = prepare(events, memory_limit, allow_growth, garbage_collection, seed_layout)
    # Regions get TensorFlow's addresses, so that ties between equal-sized free chunks of different regions break as
    # TF's did (glibc maps the larger regions downwards: a later region has a lower address, and BFC prefers it).
    # First read from the trace: that holds where every region the simulator makes is one the trace shows.
    seen = regions_seen(trace)
    if seen:
        result = replay_prepared(trace, region_addresses=seen)
        made = result.simulator.regions_made if result.simulator else []
        if len(seen) >= len(made) and result.oom_index is None:
            trace.region_addresses = seen
            return _check_result(trace, result, tolerance)
    # Else learnt from a first replay (each simulated region's most common shift to TF's addresses); a replay whose
    # placements then differ again teaches the next one, up to three times.
    region_addresses: list[int] = []
    result = replay_prepared(trace, region_addresses=region_addresses)
    for _ in range(3):
        shifts = _shifts(trace, result)
        made = result.simulator.regions_made if result.simulator else []
        learnt = [(base + shifts[base].most_common(1)[0][0] if base in shifts else base, size) for base, size in made]
        spans = sorted(learnt)
        overlapping = any(a + size > b for (a, size), (b, _) in zip(spans, spans[1:], strict=False))
        if [a for a, _ in learnt] == region_addresses or overlapping:  # settled, or a shift that cannot be TF's
            break
        region_addresses = [a for a, _ in learnt]
        result = replay_prepared(trace, region_addresses=region_addresses)
    trace.region_addresses = list(region_addresses)  # for replays of the same trace at other request sizes
    return _check_result(trace, result, tolerance)


def _shifts(trace: PreparedTrace, result: ReplayResult) -> dict[int, Counter[int]]:
    """simulated region base -> (TF address - simulated address) -> allocations"""
    shifts: dict[int, Counter[int]] = {}
    is_alloc, addr = trace.is_alloc, trace.addr
    for i in range(len(result.chunk_bytes)):
        if is_alloc[i] and addr[i] >= 0 and result.chunk_bytes[i]:
            shifts.setdefault(result.region_bases[i], Counter())[addr[i] - result.addresses[i]] += 1
    return shifts


def regions_seen(trace: PreparedTrace) -> list[int]:
    """TensorFlow's regions as the trace shows them, in the order they were made: the address ranges of its chunks
    (allocations, and frees of chunks allocated before it) merged where they touch or overlap. BFC hands out a
    region from its low end and splits the remainder off the high end, so the part of a region no chunk ever took is
    its tail: each region is one span, which starts at the region's address. Ordered by first use (a region is made
    when an allocation does not fit the ones before it). Empty when the trace has no addresses."""
    first_use: dict[tuple[int, int], int] = {}
    for i, (a, is_a, c) in enumerate(zip(trace.addr, trace.is_alloc, trace.chunk, strict=True)):
        if a >= 0 and c > 0 and (is_a or a in trace.pre):
            first_use.setdefault((a, a + c), -1 if not is_a else i)
    spans: list[list[int]] = []  # [start, end, first use]
    for (start, end), used in sorted(first_use.items()):
        if spans and start <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], end)
            spans[-1][2] = min(spans[-1][2], used)
        else:
            spans.append([start, end, used])
    return [start for start, _, _ in sorted(spans, key=lambda s: (s[2], s[0]))]


def _check_result(trace: PreparedTrace, result: ReplayResult, tolerance: float) -> SelfCheck:
    """The self-check's comparison of one replay with the trace."""
    n, is_alloc, chunk, live = trace.events, trace.is_alloc, trace.chunk, trace.live
    memory_limit, allow_growth, pre, start = trace.memory_limit, trace.allow_growth, trace.pre, trace.start
    sim_live = result.bytes_in_use
    errors = [s - t for s, t in zip(sim_live, live[: len(sim_live)], strict=True)]
    worst = max(range(len(errors)), key=lambda i: abs(errors[i])) if errors else 0
    traced_peak_index = max(range(n), key=lambda i: (live[i], -i))
    traced_peak = live[traced_peak_index]
    exact = larger_traced = larger_sim = allocs = 0
    for i in range(len(result.chunk_bytes)):
        if not is_alloc[i]:
            continue
        allocs += 1
        s, t = result.chunk_bytes[i], chunk[i]
        exact += s == t
        larger_traced += t > s
        larger_sim += s > t
    placed = sum(counts.most_common(1)[0][1] for counts in _shifts(trace, result).values())
    peak_error = (result.peak_bytes_in_use - traced_peak) / traced_peak if traced_peak else 0.0
    notes = []
    if result.oom_index is not None:
        notes.append(f"the simulator ran out of memory at event {result.oom_index}")
    if result.unmatched_frees:
        notes.append(f"{result.unmatched_frees} frees had no known allocation")
    worst_error = abs(errors[worst]) if errors else 0
    return SelfCheck(
        events=n,
        allocations=allocs,
        traced_peak=traced_peak,
        simulated_peak=result.peak_bytes_in_use,
        peak_error=peak_error,
        traced_peak_index=traced_peak_index,
        simulated_peak_index=result.peak_index,
        max_abs_error=worst_error,
        max_rel_error=worst_error / live[worst] if worst_error and live[worst] else 0.0,
        events_exact=sum(e == 0 for e in errors),
        first_divergence=next((i for i, e in enumerate(errors) if e), result.oom_index),
        chunks_exact=exact,
        chunks_larger_traced=larger_traced,
        chunks_larger_simulated=larger_sim,
        placements_exact=placed,
        preexisting_bytes=start,
        preexisting_freed=len(pre),
        limit=memory_limit,
        allow_growth=allow_growth,
        simulated_region_peak=result.simulator.peak_region_bytes if result.simulator else 0,
        passed=abs(peak_error) <= tolerance and result.oom_index is None,
        tolerance=tolerance,
        result=result,
        note="; ".join(notes),
        prepared=trace,
    )

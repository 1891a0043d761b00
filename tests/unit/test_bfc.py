"""The BFC allocator simulator (tfmem_magic.analyze.bfc): hand-computed cases of TensorFlow's rules
(xla/tsl/framework/bfc_allocator.cc), and the self-check that replays real traces and must give back, event by event,
the bytes in use TensorFlow reported."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from tfmem_magic.analyze import bfc
from tfmem_magic.analyze.bfc import BFCOutOfMemory, BFCSimulator

KiB, MiB, GiB = 2**10, 2**20, 2**30
PUBLIC = Path(__file__).parent.parent / "data" / "gpu_multi_worker_bert.xplane.pb.gz"


# ---- the size rules --------------------------------------------------------------------------------------------


def test_requests_round_up_to_256_bytes():
    assert [bfc.rounded_bytes(n) for n in (1, 255, 256, 257, 1000, 4096)] == [256, 256, 256, 512, 1024, 4096]


def test_bins_double_from_256_bytes_and_the_last_takes_everything_from_256_mib():
    assert [bfc.bin_for_size(n) for n in (256, 511, 512, 1023, 1024, 2048, 3072, 4096)] == [0, 0, 1, 1, 2, 3, 3, 4]
    assert bfc.bin_for_size(256 * MiB - 256) == 19 and bfc.bin_for_size(256 * MiB) == 20
    assert bfc.bin_for_size(64 * GiB) == 20 == bfc.NUM_BINS - 1
    assert [bfc.bin_size(b) for b in (0, 1, 20)] == [256, 512, 256 * MiB]


def test_zero_bytes_is_not_an_allocation():
    with pytest.raises(ValueError):
        BFCSimulator().allocate(0)


# ---- allocation: best fit, split or not ---------------------------------------------------------------------------


def test_the_first_allocation_with_growth_takes_a_2_mib_region_and_counts_its_rounded_chunk():
    sim = BFCSimulator(memory_limit=None, allow_growth=True)
    h = sim.allocate(1000)
    assert sim.chunk_size(h) == 1024 and sim.bytes_in_use == 1024 and sim.requested_in_use == 1000
    assert sim.region_sizes == [2 * MiB] and sim.region_bytes == 2 * MiB
    assert sim.largest_free_chunk == 2 * MiB - 1024


def test_a_chunk_under_twice_the_request_is_handed_out_whole():
    sim = BFCSimulator()
    sim.allocate(1 * MiB)  # the 2 MiB region splits: 1 MiB in use, 1 MiB free
    h = sim.allocate(600 * KiB)  # 1 MiB < 2 x 600 KiB and 424 KiB over is under 128 MiB: no split
    assert sim.chunk_size(h) == 1 * MiB and sim.bytes_in_use == 2 * MiB and sim.largest_free_chunk == 0
    assert sim.requested_in_use == 1 * MiB + 600 * KiB


def test_a_chunk_of_at_least_twice_the_request_is_split():
    sim = BFCSimulator()
    sim.allocate(1 * MiB)
    h = sim.allocate(400 * KiB)  # 1 MiB >= 2 x 400 KiB
    assert sim.chunk_size(h) == 400 * KiB and sim.largest_free_chunk == 1 * MiB - 400 * KiB


def test_more_than_128_mib_of_excess_is_split_off_even_under_twice_the_request():
    sim = BFCSimulator(memory_limit=1 * GiB, allow_growth=False)
    sim.allocate(300 * MiB)  # the one region of the whole limit, split: 724 MiB free after it
    big = sim.allocate(500 * MiB)  # 724 MiB < 1000 MiB, but 224 MiB over >= 128 MiB: split
    assert sim.chunk_size(big) == 500 * MiB and sim.largest_free_chunk == 224 * MiB
    small = sim.allocate(150 * MiB)  # 224 MiB < 300 MiB and 74 MiB over < 128 MiB: the whole chunk
    assert sim.chunk_size(small) == 224 * MiB and sim.bytes_in_use == 1 * GiB


def test_fragmentation_fraction_sets_the_excess_that_forces_a_split():
    sim = BFCSimulator(memory_limit=1 * GiB, allow_growth=False, fragmentation_fraction=0.5)  # 512 MiB
    sim.allocate(300 * MiB)
    h = sim.allocate(500 * MiB)  # 224 MiB over < 512 MiB: no split
    assert sim.chunk_size(h) == 724 * MiB


def test_best_fit_takes_the_smallest_free_chunk_that_fits():
    sim = BFCSimulator()
    a, s1, b, s2 = (sim.allocate(n) for n in (4096, 256, 2048, 256))
    where_a, where_b = sim.address(a), sim.address(b)
    sim.free(a)
    sim.free(b)  # holes of 4 KiB and 2 KiB, kept apart by s1 and s2; the region's rest is free too
    c = sim.allocate(2000)  # 2048 rounded: the 2 KiB hole, not the bigger ones
    assert sim.address(c) == where_b and sim.chunk_size(c) == 2048
    d = sim.allocate(3000)  # 3072: nothing in its bin fits, the 4 KiB hole (next bin) does, unsplit (< 6144)
    assert sim.address(d) == where_a and sim.chunk_size(d) == 4096
    assert sim.bytes_in_use == 4096 + 256 + 2048 + 256


def test_equal_free_chunks_are_taken_lowest_address_first():
    sim = BFCSimulator()
    hs = [sim.allocate(1024) for _ in range(4)]
    addresses = [sim.address(h) for h in hs]
    sim.free(hs[2])
    sim.free(hs[0])  # two 1 KiB holes, apart
    assert sim.address(sim.allocate(1024)) == addresses[0]


# ---- free: coalescing ---------------------------------------------------------------------------------------------


def test_a_free_chunk_merges_with_its_free_neighbours():
    sim = BFCSimulator()
    a, b, c = (sim.allocate(1024) for _ in range(3))
    rest = 2 * MiB - 3 * 1024
    sim.free(b)  # between two chunks in use: stays 1 KiB
    assert sim.largest_free_chunk == rest and sorted(size for _, size, used in sim.chunks() if not used) == [1024, rest]
    sim.free(a)  # merges with b (its next)
    assert sorted(size for _, size, used in sim.chunks() if not used) == [2048, rest]
    sim.free(c)  # merges with the region's rest (next) and a+b (previous): the whole region, one chunk
    assert sim.chunks() == [(sim.chunks()[0][0], 2 * MiB, False)]
    assert sim.bytes_in_use == 0 and sim.largest_free_chunk == 2 * MiB and sim.peak_bytes_in_use == 3072


def test_chunks_of_different_regions_never_merge():
    sim = BFCSimulator()
    a = sim.allocate(int(1.5 * MiB))  # region 1 (2 MiB)
    b = sim.allocate(int(1.5 * MiB))  # does not fit in the 0.5 MiB left: region 2 (4 MiB)
    sim.free(a)
    sim.free(b)
    assert sorted(size for _, size, used in sim.chunks() if not used) == [2 * MiB, 4 * MiB]


# ---- regions: growth, limit, garbage collection ---------------------------------------------------------------------


def test_regions_double_and_a_large_request_doubles_until_it_fits():
    sim = BFCSimulator(memory_limit=None, allow_growth=True)
    sim.allocate(int(1.5 * MiB))  # 2 MiB region; the next will be 4 MiB
    sim.allocate(int(1.5 * MiB))  # 4 MiB region; the next 8 MiB
    assert sim.region_sizes == [2 * MiB, 4 * MiB]
    a = sim.allocate(20 * MiB)  # 8 -> 16 -> 32 MiB: doubled for the request, so not doubled again after it
    b = sim.allocate(40 * MiB)  # 32 -> 64 MiB
    assert sim.region_sizes == [2 * MiB, 4 * MiB, 32 * MiB, 64 * MiB] and sim.region_bytes == 102 * MiB
    # each got its whole region: 32 MiB < 2 x 20 MiB with 12 MiB over, 64 MiB < 2 x 40 MiB with 24 MiB over
    assert (sim.chunk_size(a), sim.chunk_size(b)) == (32 * MiB, 64 * MiB)
    sim.allocate(3 * MiB)  # no free chunk holds it (2.5 and 0.5 MiB left): a new region, 64 MiB again
    assert sim.region_sizes[-1] == 64 * MiB and sim.region_bytes == sim.peak_region_bytes == 166 * MiB
    sim.allocate(MiB // 4)  # fits in the 2 MiB region's 0.5 MiB: no new region
    assert sim.region_bytes == 166 * MiB


def test_without_growth_the_first_allocation_takes_the_whole_limit():
    sim = BFCSimulator(memory_limit=1_000_000, allow_growth=False)
    sim.allocate(1)
    # curr_region_allocation_bytes_ is the limit rounded up (1,000,192); the region is what is available, rounded down
    assert sim.region_sizes == [999_936]


def test_initial_region_bytes_sets_the_first_region():
    sim = BFCSimulator(initial_region_bytes=8 * MiB)
    sim.allocate(1)
    sim.allocate(7 * MiB)  # fits in the first region's 8 MiB - 256
    assert sim.region_sizes == [8 * MiB]
    sim.allocate(2 * MiB)
    assert sim.region_sizes == [8 * MiB, 16 * MiB]


def test_the_last_region_is_cut_to_the_limit_and_past_it_allocation_fails():
    sim = BFCSimulator(memory_limit=5 * MiB)
    sim.allocate(MiB // 2)  # 2 MiB region, split: 1.5 MiB free
    h = sim.allocate(int(2.5 * MiB))  # the next region would be 4 MiB; 3 MiB remain under the limit: a 3 MiB region
    assert sim.region_sizes == [2 * MiB, 3 * MiB] and sim.chunk_size(h) == 3 * MiB  # 3 < 2 x 2.5: whole
    with pytest.raises(BFCOutOfMemory) as info:
        sim.allocate(2 * MiB)  # 1.5 MiB free, nothing left to extend
    assert info.value.rounded == 2 * MiB and info.value.region_bytes == 5 * MiB and info.value.limit == 5 * MiB
    assert info.value.largest_free_chunk == int(1.5 * MiB) and info.value.bytes_in_use == int(3.5 * MiB)
    assert sim.try_allocate(2 * MiB) is None and sim.try_allocate(MiB) is not None


def test_fragmentation_can_fail_an_allocation_that_the_free_bytes_would_hold():
    sim = BFCSimulator(memory_limit=6 * MiB)
    a = sim.allocate(int(1.5 * MiB))
    b = sim.allocate(3 * MiB)
    sim.free(a)
    sim.free(b)  # 6 MiB free, in regions of 2 and 4 MiB, and the limit reached
    with pytest.raises(BFCOutOfMemory):
        sim.allocate(5 * MiB)


def test_garbage_collection_hands_back_free_regions_to_make_a_larger_one():
    def run(gc: bool) -> BFCSimulator:
        sim = BFCSimulator(memory_limit=8 * MiB, garbage_collection=gc)
        a = sim.allocate(int(1.5 * MiB))  # 2 MiB region
        b = sim.allocate(3 * MiB)  # 4 MiB region; the next would be 8 MiB
        sim.free(a)
        sim.free(b)
        sim.allocate(5 * MiB)  # 2 MiB left to extend: fails unless the two free regions go back
        return sim

    with pytest.raises(BFCOutOfMemory):
        run(False)
    sim = run(True)
    # one 8 MiB region, handed out whole (8 MiB < 2 x 5 MiB, 3 MiB over)
    assert sim.regions_released == 2 and sim.region_sizes == [8 * MiB] and sim.bytes_in_use == 8 * MiB
    assert sim.peak_region_bytes == 8 * MiB


def test_reset_peak_restarts_the_peak_at_what_is_in_use():
    sim = BFCSimulator()
    h = sim.allocate(4096)
    sim.allocate(1024)
    sim.free(h)
    assert sim.peak_bytes_in_use == 5120
    sim.reset_peak()
    assert sim.peak_bytes_in_use == 1024


# ---- replay ---------------------------------------------------------------------------------------------------------


def test_replay_reports_the_peak_its_moment_and_what_is_live_there():
    events = [
        ("alloc", "a", 1000, 0.1),
        ("alloc", "b", 3000, 0.2),
        ("free", "a", 1000, 0.3),
        ("alloc", "c", 500, 0.4),
        ("free", "b", 3000, 0.5),
        ("free", "c", 500, 0.6),
    ]
    r = bfc.replay(events)
    # c (512) goes into a's 1 KiB hole, which is split (1024 >= 2 x 512)
    assert r.bytes_in_use == [1024, 4096, 3072, 3584, 512, 0]
    assert r.chunk_bytes == [1024, 3072, 0, 512, 0, 0]
    assert r.peak_bytes_in_use == 4096 and r.peak_index == 1 and r.peak_time == 0.2
    assert [(a.key, a.requested, a.chunk, a.index) for a in r.live_at_peak] == [
        ("b", 3000, 3072, 1),
        ("a", 1000, 1024, 0),
    ]
    assert r.requested_at_peak == 4000 and r.peak_region_bytes == 2 * MiB and r.final_bytes_in_use == 0
    assert r.addresses[3] == r.addresses[0]  # c where a was
    assert r.oom_index is None and r.unmatched_frees == 0


def test_replay_skips_frees_it_never_saw_allocated_and_frees_a_key_allocated_again():
    r = bfc.replay([("free", 7, 100), ("alloc", 1, 300), ("alloc", 1, 600), ("free", 1, 600)])
    assert r.unmatched_frees == 1 and r.reallocated_keys == 1 and r.bytes_in_use == [0, 512, 768, 0]


def test_replay_stops_where_the_allocator_runs_out():
    events = [("alloc", i, MiB) for i in range(10)]
    r = bfc.replay(events, memory_limit=4 * MiB)
    assert r.oom_index == 4 and isinstance(r.oom, BFCOutOfMemory) and r.peak_bytes_in_use == 4 * MiB
    assert len(r.bytes_in_use) == 5
    assert bfc.replay(events, memory_limit=4 * MiB, stop_at_oom=False).oom_index == 9  # the last one that failed


def test_replay_on_a_seeded_simulator_frees_what_was_live_before():
    sim = BFCSimulator()
    before = sim.allocate(10_000)
    sim.reset_peak()
    r = bfc.replay([("alloc", "x", 256), ("free", "old", 10_000)], simulator=sim, live={"old": before})
    assert r.bytes_in_use == [10_240 + 256, 256] and r.unmatched_frees == 0
    assert {a.key: a.index for a in r.live_at_peak} == {"old": -1, "x": 0}


def test_replay_rejects_an_unknown_kind():
    with pytest.raises(ValueError):
        bfc.replay([("malloc", 1, 10)])


# ---- the self-check: regions where TensorFlow put them -------------------------------------------------------------

HEAP, MMAP = 0x5600_0000_0000, 0x7F00_4000_0000


def _traced(steps: list[tuple[str, str, int]], region_addresses: list[int]) -> tuple[object, BFCSimulator]:
    """Events as TensorFlow's tracer would write them for `steps` ("alloc"/"free", name, bytes), made by an allocator
    whose regions lie at `region_addresses` (glibc's: the first ones on the heap, the larger ones mmapped downwards)."""
    import numpy as np

    from tfmem_magic.measure.xplane import MemoryEvents

    tf = BFCSimulator(region_addresses=region_addresses)
    handles: dict[str, int] = {}
    rows = []
    for kind, name, nbytes in steps:
        if kind == "alloc":
            h = handles[name] = tf.allocate(nbytes)
        else:
            h = handles.pop(name)
            nbytes = 0
        row = (kind == "alloc", nbytes, tf.chunk_size(h), tf.address(h))
        if kind == "free":
            tf.free(h)
        rows.append((*row, tf.bytes_in_use))
    n = len(rows)
    column = lambda k, dtype: np.array([r[k] for r in rows], dtype)  # noqa: E731
    events = MemoryEvents(
        t_ps=np.arange(n, dtype=np.int64),
        is_alloc=column(0, bool),
        live=column(4, np.int64),
        requested=column(1, np.int64),
        chunk=column(2, np.int64),
        addr=column(3, np.int64),
        dtype=np.ones(n, np.int64),
        op=np.full(n, -1, np.int32),
        region=np.full(n, -1, np.int32),
        shape=np.full(n, -1, np.int32),
        thread=np.zeros(n, np.int32),
        strings=[],
        threads=["main"],
        allocator="bfc_cpu_allocator_for_gpu",
        limit=np.zeros(n, np.int64),
    )
    return events, tf


# three full regions (glibc's: the first on the heap, the next two mmapped, the later one lower), then a 1 MiB hole
# at the start of regions 2 and 3: a tie, and BFC takes the lower address (region 3's). Which one x took decides
# whether b2's free makes a 2 MiB hole in region 2 that d reuses, or d needs a fourth region
TIE = [
    ("alloc", "a", MiB),
    ("alloc", "a2", MiB),
    ("alloc", "b", MiB),
    ("alloc", "b2", MiB),
    ("alloc", "b3", 2 * MiB),
    ("alloc", "c", MiB),
    ("alloc", "c2", MiB),
    ("alloc", "c3", 6 * MiB),
    ("free", "b", 0),
    ("free", "c", 0),
    ("alloc", "x", 600 * KiB),
    ("free", "b2", 0),
    ("alloc", "d", int(1.5 * MiB)),
    *(("free", name, 0) for name in ("a", "a2", "b3", "c2", "c3", "x", "d")),
]
TIE_REGIONS = [HEAP, MMAP, MMAP - 64 * MiB]


def test_regions_seen_are_tensorflows_in_the_order_it_made_them():
    events, tf = _traced(TIE, TIE_REGIONS)
    assert [a for a, _ in tf.regions_made] == TIE_REGIONS
    assert bfc.regions_seen(bfc.prepare(events)) == TIE_REGIONS


def test_a_tie_between_regions_breaks_as_tensorflows_addresses_say():
    """Ascending synthetic addresses would put x in region 2 and then need a fourth region for d: the self-check
    replays with TensorFlow's own region addresses, read from the trace, and gets every event and place."""
    events, tf = _traced(TIE, TIE_REGIONS)
    ascending = bfc.replay_prepared(bfc.prepare(events), region_addresses=[])
    assert ascending.simulator is not None and len(ascending.simulator.regions_made) == 4  # the trap is real
    check = bfc.self_check(events)
    assert check.prepared is not None and check.prepared.region_addresses == TIE_REGIONS
    assert check.events_exact == check.events and check.placements_exact == check.allocations
    assert check.simulated_region_peak == tf.peak_region_bytes and check.passed


def test_a_real_trace_whose_later_regions_lie_lower_replays_to_the_byte():
    """EfficientNetB0's fit in a fresh process (tests/data/regions-efficientnetb0.npz): eight regions, the five
    mmapped ones each lower than the one before. Learnt from a first replay, the regions' addresses overlapped and
    were dropped; the placements then parted from TensorFlow's at event 140,620 of 166,314 (peak +2.7%)."""
    events = _efficientnet_events()
    n = len(events)
    check = bfc.self_check(events)
    regions = check.prepared.region_addresses if check.prepared else []
    assert len(regions) == 8 and regions[3:] == sorted(regions[3:], reverse=True) and regions[3] > regions[2]
    assert check.events_exact == check.events == n == 166_314 and check.first_divergence is None
    assert check.chunks_exact == check.placements_exact == check.allocations and check.passed


def _efficientnet_events():
    """EfficientNetB0's fit in a fresh process, as the tracer read it (tests/data/regions-efficientnetb0.npz)."""
    import numpy as np

    from tfmem_magic.measure.xplane import MemoryEvents

    with np.load(Path(__file__).parent.parent / "data" / "regions-efficientnetb0.npz") as data:
        columns = {k: data[k] for k in ("is_alloc", "addr", "requested", "chunk", "live", "limit")}
    n = len(columns["addr"])
    return MemoryEvents(
        t_ps=np.arange(n, dtype=np.int64),
        dtype=np.ones(n, np.int64),
        op=np.full(n, -1, np.int32),
        region=np.full(n, -1, np.int32),
        shape=np.full(n, -1, np.int32),
        thread=np.zeros(n, np.int32),
        strings=[],
        threads=["main"],
        allocator="bfc_cpu_allocator_for_gpu",
        **columns,
    )


def test_the_peaks_alone_are_the_full_replays_peaks():
    """bfc.replay_peaks (what the step replay's searches ask at each batch) gives replay_prepared's two peaks to the
    byte on a real trace: at its own sizes, at sizes scaled as another batch's, and under a limit it runs out at."""
    prepared = bfc.self_check(_efficientnet_events()).prepared
    assert prepared is not None
    full = bfc.replay_prepared(prepared)
    assert bfc.replay_peaks(prepared) == (full.peak_bytes_in_use, full.peak_region_bytes)
    scaled = [max(1, round(r * 1.7)) for r in prepared.requested]
    full = bfc.replay_prepared(prepared, requested=scaled, memory_limit=bfc.UNLIMITED)
    assert bfc.replay_peaks(prepared, scaled, bfc.UNLIMITED) == (full.peak_bytes_in_use, full.peak_region_bytes)
    limit = full.peak_region_bytes // 2
    short = bfc.replay_prepared(prepared, requested=scaled, memory_limit=limit)
    assert short.oom_index is not None
    assert bfc.replay_peaks(prepared, scaled, limit) == (short.peak_bytes_in_use, short.peak_region_bytes)


# ---- the self-check on real traces -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def public_trace_bytes() -> bytes:
    pytest.importorskip("google.protobuf")
    return gzip.decompress(PUBLIC.read_bytes())


@pytest.mark.parametrize("device,events,allocations", [("GPU:6", 969, 761), ("GPU:4", 969, 761), ("GPU:1", 19, 19)])
def test_the_public_v100_trace_replays_to_the_byte(public_trace_bytes, device, events, allocations):
    """The BERT job's GPU allocators, with TensorFlow's GPU defaults (no allow_growth: one region of the limit the
    events state, 15,477,102,400 bytes; garbage collection on): every event's bytes in use, every chunk and every
    address (relative to the first allocation) are TensorFlow's, the chunks it did not split included."""
    from tfmem_magic.measure import xplane

    trace = xplane.read_segments([(public_trace_bytes, 0)], device)
    check = bfc.self_check(trace.events)
    assert check.limit == 15_477_102_400 and not check.allow_growth
    assert (check.events, check.allocations) == (events, allocations)
    assert check.events_exact == events and check.first_divergence is None and check.max_abs_error == 0
    assert check.simulated_peak == check.traced_peak and check.peak_error == 0 and check.passed
    assert check.chunks_exact == allocations and check.placements_exact == allocations
    assert check.preexisting_bytes == 4_013_337_088 and check.preexisting_freed == 0
    assert check.simulated_peak_index == check.traced_peak_index
    if device == "GPU:6":  # five allocations got a larger chunk than they asked for (a free chunk under twice theirs)
        assert (
            sum(
                1
                for i in range(events)
                if trace.events.is_alloc[i]
                and trace.events.chunk[i] > bfc.rounded_bytes(int(trace.events.requested[i]))
            )
            == 5
        )


def test_the_public_trace_tells_growth_from_no_growth(public_trace_bytes):
    """The same events replayed with allow_growth (the CPU's setting) part from TensorFlow's: the settings matter,
    and the trace's own say which the job used."""
    from tfmem_magic.measure import xplane

    trace = xplane.read_segments([(public_trace_bytes, 0)], "GPU:6")
    check = bfc.self_check(trace.events, allow_growth=True)
    assert check.first_divergence is not None and check.chunks_exact < check.allocations
    assert check.simulated_peak != check.traced_peak


@pytest.mark.parametrize("seed", range(6))
def test_random_sequences_keep_the_allocators_invariants(seed):
    """Regions stay tiled by their chunks, no two free chunks are neighbours, bytes in use are the chunks in use, and
    every free chunk is in its bin: after every step of a random workload, whatever region addresses are asked for
    (even overlapping ones, which the simulator must refuse)."""
    import random

    rng = random.Random(seed)
    addresses = [rng.choice([1 << 44, 1 << 45, (1 << 44) + 3 * MiB]) for _ in range(4)] if seed % 2 else []
    sim = BFCSimulator(
        memory_limit=rng.choice([None, 64 * MiB, 200 * MiB]),
        allow_growth=seed != 4,
        garbage_collection=seed % 3 == 0,
        region_addresses=addresses,
    )
    live: list[int] = []
    for _ in range(1500):
        if live and rng.random() < 0.45:
            sim.free(live.pop(rng.randrange(len(live))))
        else:
            size = rng.choice([rng.randint(1, 4096), rng.randint(4096, MiB), rng.randint(MiB, 12 * MiB)])
            h = sim.try_allocate(size)
            if h is not None:
                live.append(h)
        chunks = sim.chunks()
        assert sum(size for _, size, used in chunks if used) == sim.bytes_in_use
        assert sum(size for _, size, _ in chunks) == sim.region_bytes <= sim.memory_limit
        spans = sorted((r.ptr, r.ptr + r.size) for r in sim._regions)
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:], strict=False))
        for region in sim._regions:
            c, at = region.first, region.ptr
            while c is not None:
                assert c.ptr == at and c.region == region.ptr
                assert not (not c.in_use and c.next is not None and not c.next.in_use)
                assert (c.bin == bfc.bin_for_size(c.size)) == (not c.in_use)
                at += c.size
                c = c.next
            assert at == region.ptr + region.size
        assert sum(len(keys) for keys in sim._bins) == len(sim._free) == sum(1 for _, _, used in chunks if not used)
    assert sim.peak_bytes_in_use >= sim.bytes_in_use

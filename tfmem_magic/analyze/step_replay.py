"""The step replay: a model's allocation sequence, traced from a fresh allocator at two probe batches, replayed at any
batch through the BFC simulator (analyze/bfc.py).

Each probe process (advise/probe_runs.py) traces everything its allocator does from TensorFlow's first allocation
for the model: the clone built, then its step run twice (the first traces the graph and makes the optimizer's slots,
the second is a steady step). Such a trace replays to the byte (docs/bfc-replay.md), so the only thing a prediction
at another batch has to get right is each allocation's size there:

- the two probes run at odd batches (no layer width collides with them: a width equal to the batch made a tensor
  look batch-shaped in the first attempt), and their allocations are aligned in order of occurrence by (op, dtype,
  shape with the batch masked), then what is left by (op, dtype, rank) (`align`);
- each aligned allocation gets a line through its two sizes (intercept + slope x batch): what scales and what does
  not (weights, slots, the iterator's copy, oneDNN workspaces that carry the batch in a flat shape) falls out of the
  two sizes, not out of a rule about shapes;
- each probe's sequence is replayed with the sizes its lines give at the asked batch. Allocations that did not
  align keep their own size.

Both sequences are replayed: TensorFlow's executor runs a step's ops in another order from run to run, and the order
decides which tensors meet at the peak (a CNN's two probe orders, replayed at one batch, differed by 12-18%). The curve
keeps both, and a prediction takes the larger of the two orders' changes (advise/prediction.py).

Self-check, before a curve is used: each probe's own sequence must give back its traced peak (`bfc.self_check`,
1%), and at least `MIN_ALIGNED` of each probe's allocations must find their match in the other's (or
`MIN_ALIGNED_FEW` where the unmatched hold little of the bytes: `aligned_enough`).

The result is a `ReplayCurve` (core/report.py): the simulated peak at a grid of batches, stored on the report's
basis so that a saved report predicts what the live one did; advise/prediction.py anchors it on the cell's
measured peak (cell peak + replay(B) - replay(cell's batch)). Pure Python and NumPy: no TensorFlow here.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tfmem_magic.analyze import bfc
from tfmem_magic.core.report import ReplayCurve
from tfmem_magic.core.sizes import format_bytes
from tfmem_magic.measure.xplane import MemoryEvents

OWN_TOLERANCE = 0.01  # probe one's sequence replayed as traced: bfc.self_check's tolerance
# the share of each probe's allocations that must find their match in the other's trace: two runs of one model make
# the same tensors; fewer matches mean another graph (a retrace, another algorithm), whose lines would be guesses
MIN_ALIGNED = 0.95
# ... or this share, where the unmatched hold under 2% of the bytes allocated: an unmatched allocation keeps its
# probe's size, so at most its share of the bytes is scaled wrong, a tenth of the replay's band below (-20%). Under
# mixed_float16 the loss-scale optimizer applies the gradients only in steps whose gradients stayed finite, so the
# two probes' optimizer temporaries differ in count, by up to 7%, yet their bytes still match (docs/bfc-replay.md)
MIN_ALIGNED_FEW = 0.90
MIN_ALIGNED_BYTES = 0.98
# an unmatched allocation with no shape, at least this large and a multiple of its probe's batch, grows with it
UNSHAPED_BATCH_BYTES = 64 << 10
# replays far beyond a limit would stop at a simulated out-of-memory: the curve is the model's, not this machine's
UNLIMITED = 1 << 50
# the replays' time a curve may take (a MobileNetV2 step of ~100,000 events replays in ~0.5 s): the grid is finer
# where that allows
REPLAY_BUDGET_S = 15.0
_COLUMNS = ("t_ps", "is_alloc", "live", "requested", "chunk", "addr", "dtype", "op", "region", "shape", "thread")


def save_events(
    events: MemoryEvents, path: str | Path, fed_bytes: int = 0, graph: dict[str, list[str] | None] | None = None
) -> None:
    """Write one allocator's events (the probe process's trace) to an .npz file `load_events` reads. `fed_bytes`:
    the probe's synthetic data made as tensors before its steps (`fed_bytes` reads it back); `graph`: every op type
    in the graphs the probe process ran and its clone's layers (`graph_of` reads it back)."""
    names = json.dumps({"strings": events.strings, "threads": events.threads, "allocator": events.allocator})
    limit = events.limit if events.limit is not None else np.zeros(len(events), np.int64)
    np.savez_compressed(
        path,
        names=np.array(names),
        limit=limit,
        fed=np.int64(fed_bytes),
        graph=np.array(json.dumps(graph or {})),
        **{k: getattr(events, k) for k in _COLUMNS},
    )


def graph_of(path: str | Path) -> dict[str, list[str] | None]:
    """A probe's graph as `save_events` wrote it: "op_types" (None: not read) and "layers" (the clone's layer kinds;
    None for the model's own saved step); {} in a file written without it."""
    with np.load(path) as data:
        return dict(json.loads(str(data["graph"]))) if "graph" in data.files else {}


def fed_bytes(path: str | Path) -> int:
    """The bytes of a probe's data made as tensors before its steps (0 in a file written without them): in the
    probe's sequence from its first allocation, as the model's weights are, and not part of what a call adds."""
    with np.load(path) as data:
        return int(data["fed"]) if "fed" in data.files else 0


def load_events(path: str | Path) -> MemoryEvents:
    with np.load(path) as data:
        names = json.loads(str(data["names"]))
        return MemoryEvents(
            **{k: data[k] for k in _COLUMNS},
            strings=names["strings"],
            threads=names["threads"],
            allocator=names["allocator"],
            limit=data["limit"],
        )


def _masked(shape: str | None, batch: int) -> str | None:
    """A shape with the batch written as B: a dimension equal to the (odd) probe batch, or a multiple of it (a
    reshaped or flat tensor: oneDNN's workspaces are `[707296]` = 23 x 30752 at batch 23), which the other probe's
    shape then has at its own batch."""
    if not shape or not shape.startswith("["):
        return shape
    dims = []
    for part in shape.strip("[]").split(","):
        try:
            d = int(part)
        except ValueError:
            dims.append(part)
            continue
        dims.append("B" if d == batch else f"{d // batch}B" if d > batch and d % batch == 0 else str(d))
    return "[" + ",".join(dims) + "]"


def shape_at(shape: str | None, probe: int, batch: int) -> str | None:
    """A probe's shape at another batch: each dimension `_masked` reads as the probe's batch (or a multiple of it)
    written for `batch` (`[37,1024]` at probe 37 is `[1024,1024]` at 1024)."""
    masked = _masked(shape, probe)
    if masked is None or masked == shape or not masked.startswith("["):
        return shape
    dims = []
    for part in masked.strip("[]").split(","):
        if part == "B":
            dims.append(str(batch))
        elif part.endswith("B") and part[:-1].isdigit():
            dims.append(str(int(part[:-1]) * batch))
        else:
            dims.append(part)
    return "[" + ",".join(dims) + "]"


# allocations' positions by (op, dtype, masked shape or rank)
Keys = dict[tuple[str | None, int, str | int | None], list[int]]


def _keyed(events: MemoryEvents, batch: int, masked: bool) -> Keys:
    """The allocations' positions by (op, dtype, shape with the batch masked) or, with `masked` False, by (op,
    dtype, rank), in order of occurrence."""
    out: Keys = {}
    for i in np.nonzero(events.is_alloc)[0].tolist():
        shape = events.string(int(events.shape[i]))
        if masked:
            form: str | int | None = _masked(shape, batch)
        else:
            form = (shape.count(",") + 1 if shape.strip("[]") else 0) if shape else -1
        out.setdefault((_op_name(events.string(int(events.op[i]))), int(events.dtype[i]), form), []).append(i)
    return out


_FUNCTION_UID = re.compile(r"(__(?:inference|forward|backward)_\w+?)_\d+\b")


def _op_name(name: str | None) -> str | None:
    """An op's name without the uid TensorFlow gives each traced function (`__inference_multi_step_on_iterator_674`
    in one probe is `..._665` in the other: the counter counts every function the process traced before)."""
    return _FUNCTION_UID.sub(r"\1", name) if name and "__" in name else name


@dataclass
class Lines:
    """Each of probe one's events' requested bytes as intercept + slope x batch (frees: their own size, unused)."""

    intercept: np.ndarray  # float64, per event of probe one
    slope: np.ndarray  # float64
    aligned: int  # probe one's allocations that found their match in probe two
    allocations: int
    # of the unmatched, those with no op name under BFC's smallest chunk: tf.data's per-row tensors (a row's int64
    # label, 8 bytes), whose count grows with the batch; the alignment's share leaves them out (`checked`)
    negligible: int = 0
    # requested bytes of probe one's allocations, and of those that found no match (the negligible left out)
    allocated_bytes: int = 0
    unaligned_bytes: int = 0
    # of the unmatched, those whose size at any batch is known all the same (`_sized_unmatched`): their shape carries
    # no batch, or a matched allocation of their op, dtype and shape gives its line. The share counts them as matched
    sized: int = 0

    def aligned_share(self) -> tuple[float, float]:
        """The share of the allocations that found their match, by count and by bytes (the negligible left out)."""
        count = (self.aligned + self.sized) / max(1, self.allocations - self.negligible)
        return count, 1 - self.unaligned_bytes / max(1, self.allocated_bytes)

    def sizes(self, batch: float) -> list[int]:
        sizes: list[int] = np.maximum(1, np.rint(self.intercept + self.slope * batch)).astype(np.int64).tolist()
        return sizes


def align(
    low: MemoryEvents,
    high: MemoryEvents,
    low_batch: int,
    high_batch: int,
    keyed: dict[tuple[int, bool], Keys] | None = None,
) -> Lines:
    """Lines through the sizes of the allocations the two probes share: matched first by (op, dtype, shape with the
    batch masked) in order of occurrence, then what is left by (op, dtype, rank), where a pair is kept only when its
    two sizes are equal or grow roughly as the batch does (between halfway and 1.25x the batches' ratio). Matching
    by rank alone paired tensors of different layers where a step's ops ran in another order (allocations with no
    op name or shape are many): a line through two unrelated sizes, extended to batch 8, made an MLP's peak grow
    as its batch shrank, and one extended to 256 put it 47% over the real one. `keyed`: the probes' allocations
    by key, per (probe batch, masked), when the caller aligns the same two probes both ways (`curve`)."""
    keyed = {} if keyed is None else keyed

    def keys(events: MemoryEvents, batch: int, masked: bool) -> Keys:
        if (batch, masked) not in keyed:
            keyed[batch, masked] = _keyed(events, batch, masked)
        return keyed[batch, masked]

    if high_batch == low_batch:
        raise ValueError("the probes must run at two different batches")
    intercept = low.requested.astype(np.float64)
    slope = np.zeros(len(low), np.float64)
    matched_low: set[int] = set()
    matched_high: set[int] = set()
    siblings: set[int] = set()
    for masked in (True, False):
        others = keys(high, high_batch, masked)
        for key, rows in keys(low, low_batch, masked).items():
            mine = [i for i in rows if i not in matched_low and i not in siblings]
            theirs = [j for j in others.get(key, []) if j not in matched_high]
            n = min(len(mine), len(theirs))
            if not n:
                continue
            unshaped = masked and key[2] is None
            left, right = (
                _same_sizes_first(low, high, mine, theirs) if unshaped else (np.array(mine[:n]), np.array(theirs[:n]))
            )
            a = low.requested[left].astype(np.float64)
            b = high.requested[right].astype(np.float64)
            if not masked or unshaped:
                # paired by rank alone, or with no shape at all: only what is the same size, or grows as the batch
                # does (either way: the curve aligns probe two with probe one too, its batches reversed)
                grows = high_batch > low_batch
                ratio = np.where(grows, b, a) / np.maximum(np.where(grows, a, b), 1)
                expected = max(high_batch, low_batch) / min(high_batch, low_batch)
                keep = (a == b) | ((ratio > 1 + (expected - 1) * 0.5) & (ratio < expected * 1.25))
                left, right, a, b = left[keep], right[keep], a[keep], b[keep]
            s = (b - a) / (high_batch - low_batch)
            slope[left] = s
            intercept[left] = a - s * low_batch
            matched_low.update(left.tolist())
            matched_high.update(right.tolist())
        if masked:  # lines from this pass alone: one paired by rank alone may join two shapes
            siblings = _sized_unmatched(low, keys(low, low_batch, True), matched_low, slope, intercept)
    for i in _batch_sized_unshaped(low, low_batch, matched_low):
        slope[i], intercept[i] = low.requested[i] / low_batch, 0.0
    small = [
        i
        for i in np.nonzero(low.is_alloc & (low.requested < bfc.MIN_ALLOCATION_SIZE))[0].tolist()
        if i not in matched_low and i not in siblings and not low.string(int(low.op[i]))
    ]
    unmatched = [i for i in np.nonzero(low.is_alloc)[0].tolist() if i not in matched_low and i not in siblings]
    return Lines(
        intercept,
        slope,
        len(matched_low),
        int(np.count_nonzero(low.is_alloc)),
        len(small),
        int(low.requested[low.is_alloc].sum()) - int(low.requested[small].sum()),
        int(low.requested[unmatched].sum()) - int(low.requested[small].sum()),
        len(siblings),
    )


def _sized_unmatched(
    events: MemoryEvents, keys: Keys, matched: set[int], slope: np.ndarray, intercept: np.ndarray
) -> set[int]:
    """Unmatched allocations whose size at any batch is known all the same: those whose shape carries no batch
    dimension (their own size, the line they have), and under a key (op, dtype, shape with the batch masked) some of
    whose allocations matched, as many more as matched and of their size (their matched siblings' line). The count
    of one op's allocations can differ between two runs of one step where TensorFlow forwards an input's buffer to
    the output in place of allocating (it can when nothing else holds the input, which depends on the threads'
    timing): a GradientTape loop's Adam update made 0-4 of its `Square` and `Sub` temporaries per variable in each
    probe, an 11 MB kernel's among them, and a CI run that matched 94.9% of its allocations one to one with over 2%
    of the bytes unmatched refused the replay (docs/bfc-replay.md). What carries the batch and has no matched kind
    (another graph: a retrace, another algorithm), or no shape, stays unmatched; so do more siblings than matched (a
    probe that ran a step more than the other)."""
    out: set[int] = set()
    for (_, _, form), rows in keys.items():
        if not isinstance(form, str) or not form.startswith("["):  # no shape: buffers of any size
            continue
        if all(part.isdigit() for part in form.strip("[]").split(",") if part):  # no dimension is the batch's
            out.update(i for i in rows if i not in matched)
            continue
        done = [i for i in rows if i in matched]
        if not done:
            continue
        size = events.requested[done[0]]
        extra = [i for i in rows if i not in matched and events.requested[i] == size][: len(done)]
        for i in extra:
            slope[i], intercept[i] = slope[done[0]], intercept[done[0]]
        out.update(extra)
    return out


def _batch_sized_unshaped(events: MemoryEvents, batch: int, matched: set[int]) -> list[int]:
    """Allocations with no shape that found no match, of at least `UNSHAPED_BATCH_BYTES` and a multiple of the
    probe's (odd, chosen for this: `odd_probes`) batch: a copy of the batch that one probe made and the other did
    not. TensorFlow copies a NumPy array that is not aligned as it needs and wraps one that is: a CNN's probe at
    batch 37 had two copies of its [37,64,64,3] input (1,818,624 bytes, no shape in the trace), the one at 23 none,
    and replayed with them as fixed bytes its order fell 23% short at batch 256. They grow with the batch."""
    return [
        i
        for i in np.nonzero(events.is_alloc)[0].tolist()
        if i not in matched
        and not events.string(int(events.shape[i]))
        and events.requested[i] >= UNSHAPED_BATCH_BYTES
        and events.requested[i] % batch == 0
    ]


def _same_sizes_first(
    low: MemoryEvents, high: MemoryEvents, mine: list[int], theirs: list[int]
) -> tuple[np.ndarray, np.ndarray]:
    """Pairs of allocations with no shape (the trace names none for some buffers) under one key: the same sizes
    first, in order of occurrence, then what is left in order. Paired in order alone, a GRU's probes matched a 2 KB
    buffer with a 1.6 MB one that does not grow (one probe had one more of them before it): its replay grew 119 KB
    per sample too fast, +80% at batch 256."""
    waiting: dict[int, list[int]] = {}
    for j in theirs:
        waiting.setdefault(int(high.requested[j]), []).append(j)
    left: list[int] = []
    right: list[int] = []
    rest: list[int] = []
    for i in mine:
        same = waiting.get(int(low.requested[i]))
        if same:
            left.append(i)
            right.append(same.pop(0))
        else:
            rest.append(i)
    taken = set(right)
    others = [j for j in theirs if j not in taken]
    n = min(len(rest), len(others))
    return np.array(left + rest[:n], dtype=np.int64), np.array(right + others[:n], dtype=np.int64)


@dataclass
class StepReplay:
    """One probe's sequence, prepared for replays, with the lines that size it at any batch."""

    prepared: bfc.PreparedTrace
    lines: Lines
    own: bfc.SelfCheck
    # the probe's events as traced (op, shape, dtype of each: a replay's `LiveAllocation.index` is a position in them,
    # `prepare` keeps every event in order) and its batch; None for a saved trace's replay
    events: MemoryEvents | None = None
    batch: int = 0

    def run(self, batch: float) -> bfc.ReplayResult:
        return bfc.replay_prepared(self.prepared, requested=self.lines.sizes(batch), memory_limit=UNLIMITED)

    def peak(self, batch: float) -> tuple[int, int]:
        """`run`'s peak bytes in use and peak region bytes alone (bfc.replay_peaks: no record of every event)."""
        return bfc.replay_peaks(self.prepared, requested=self.lines.sizes(batch), memory_limit=UNLIMITED)


def grid(
    cell_batch: int,
    probes: tuple[int, int],
    per_replay_s: float = 0.0,
    budget_s: float = REPLAY_BUDGET_S,
    top: int | None = None,
) -> list[int]:
    """The batches the curve is replayed at: the powers of two up to 64x the cell's batch (at least 4096), the
    cell's batch and the probes'; then, as far as `budget_s` allows at `per_replay_s` a replay (each batch is
    replayed in both orders), 1.5x the powers of two within 8x of the cell's batch, and 1.25x and 1.75x within 4x.
    Between them the peak is interpolated: BFC's chunks make it a staircase (a CNN's step peaked at 47.7 MiB at
    batch 32 and 69.6 at 37, where a 18 MB tensor no longer fit a 16 MiB region), so a finer grid where shrinking or
    growing the batch is asked most."""
    top = top or max(4096, 64 * cell_batch)
    out = {cell_batch, *probes}
    power = 1
    while power <= top:
        out.add(power)
        power *= 2
    for factors, span in (((1.5,), 8), ((1.25, 1.75), 4)):
        more = set()
        power = 1
        while power <= top:
            more |= {round(power * f) for f in factors if cell_batch / span <= power * f <= cell_batch * span}
            power *= 2
        if 2 * per_replay_s * len(out | more) > budget_s:
            break
        out |= more
    return sorted(out)


@dataclass
class CheckedReplays:
    """Both probes' sequences, ready to replay at any batch, and the curve's record of their self-check (no peaks
    yet). `replays` is usable only where `curve.why_not` is empty."""

    replays: list[StepReplay]
    curve: ReplayCurve
    started: float  # perf_counter at the start of the check: the curve's seconds count from it

    def peaks(self, batch: float) -> list[tuple[int, int]]:
        """Each probe's op order replayed at `batch`: its peak bytes in use and peak region bytes."""
        return [r.peak(batch) for r in self.replays]


def aligned_enough(count: float, share_of_bytes: float) -> bool:
    """Whether two probes made the same tensors: `MIN_ALIGNED` of the allocations matched, or `MIN_ALIGNED_FEW` with
    the unmatched holding little of the bytes (`MIN_ALIGNED_BYTES`)."""
    return count >= MIN_ALIGNED or (count >= MIN_ALIGNED_FEW and share_of_bytes >= MIN_ALIGNED_BYTES)


def checked(
    low: MemoryEvents, high: MemoryEvents, low_batch: int, high_batch: int, gpu_growth: bool = True
) -> CheckedReplays:
    """The self-check of both probes' sequences and their alignment, before any prediction (see `curve`): each
    sequence must give back its own traced peak, and most allocations must find their match in the other's."""
    started = time.perf_counter()
    replays = []
    why = []
    keyed: dict[tuple[int, bool], Keys] = {}  # each probe's allocations by key, made once for both directions
    for mine, theirs, b_mine, b_theirs in ((low, high, low_batch, high_batch), (high, low, high_batch, low_batch)):
        growth = gpu_growth if (mine.allocator or "").startswith("GPU_") else None
        own = bfc.self_check(mine, allow_growth=growth, tolerance=OWN_TOLERANCE)
        assert own.prepared is not None
        replays.append(StepReplay(own.prepared, align(mine, theirs, b_mine, b_theirs, keyed), own, mine, b_mine))
        if not own.passed:
            where = (
                f" (first divergence at event {own.first_divergence} of {own.events})"
                if own.first_divergence is not None
                else ""
            )
            why.append(
                f"probe {b_mine}'s own sequence replayed to {own.peak_error:+.1%} of its traced peak{where}, "
                f"over the {OWN_TOLERANCE:.0%} the replay needs"
            )
    first, second = replays
    # a GradientTape loop's step fed by tf.data makes more 8-byte label rows at one probe's batch than at the other's
    # (docs/bfc-replay.md)
    shares = [r.lines.aligned_share() for r in replays]
    aligned, aligned_bytes = min(c for c, _ in shares), min(b for _, b in shares)
    # a few more unmatched small tensors (a tape loop's step) leave the bytes matched: the replay's sizes are bytes
    if not aligned_enough(aligned, aligned_bytes):
        why.append(
            f"only {aligned:.0%} of a probe's allocations ({aligned_bytes:.1%} of their bytes) found their "
            f"match in the other probe's trace (the replay needs {MIN_ALIGNED:.0%}, or {MIN_ALIGNED_FEW:.0%} "
            f"and {MIN_ALIGNED_BYTES:.0%} of the bytes): the two runs did not make the same tensors"
        )
    # each sequence at the other probe's sizes against that probe's traced peak: how much the order alone moves it
    cross: list[float] = [
        (r.peak(b)[0] - other.own.traced_peak) / max(1, other.own.traced_peak)
        for r, other, b in ((first, second, high_batch), (second, first, low_batch))
    ]
    out = ReplayCurve(
        probes=[low_batch, high_batch],
        events=len(low),
        allocations=first.lines.allocations,
        aligned=first.lines.aligned,
        negligible=first.lines.negligible,
        sized=first.lines.sized,
        own_error=round(max(abs(r.own.peak_error) for r in replays), 5),
        cross_error=round(cross[0] if abs(cross[0]) >= abs(cross[1]) else cross[1], 5),
        traced_peaks=[int(first.own.traced_peak), int(second.own.traced_peak)],
        why_not="; ".join(why),
    )
    return CheckedReplays(replays, out, started)


def curve(
    low: MemoryEvents,
    high: MemoryEvents,
    low_batch: int,
    high_batch: int,
    cell_batch: int,
    batches: list[int] | None = None,
    gpu_growth: bool = True,
) -> ReplayCurve:
    """Replay both probes' sequences at every batch of the grid, after the self-check (`checked`). Two sequences,
    because the order TensorFlow's executor runs a step's ops in differs from run to run, and with it which tensors
    meet at the peak (measured: a CNN's two probe orders replayed at one batch differed by 12-18%): the curve keeps
    both orders' peaks at each batch. A curve whose self-check failed has no peaks and says why (`why_not`): the
    caller keeps the other bases. `gpu_growth`: whether a GPU allocator's probes ran with memory growth (probe_runs'
    probe processes do, unless the user's TF_FORCE_GPU_ALLOW_GROWTH says otherwise); a CPU allocator always grows."""
    check = checked(low, high, low_batch, high_batch, gpu_growth)
    out = check.curve
    if not out.why_not:
        timed = time.perf_counter()
        check.replays[0].peak(cell_batch)
        per_replay = time.perf_counter() - timed
        for batch in batches or grid(cell_batch, (low_batch, high_batch), per_replay):
            results = check.peaks(batch)
            out.batches.append(batch)
            out.peaks.append(results[0][0])
            out.second_peaks.append(results[1][0])
            out.region_peaks.append(max(regions for _, regions in results))
        out.passed = True
    out.seconds = round(time.perf_counter() - check.started, 2)
    return out


def shape_lines(events: MemoryEvents, batch: int) -> Lines:
    """Lines for one trace at one batch, from the shapes alone: an allocation whose shape carries the batch as its
    first or second dimension (`analysis.batch_dimension`) grows in proportion to it, every other keeps its size.
    What two probes' alignment finds and shapes cannot see (flat workspaces that carry the batch, a width equal to
    the batch) is missed: measured on CPU models, docs/bfc-replay.md ("shape-scaled")."""
    from tfmem_magic.analyze.analysis import batch_dimension

    intercept = events.requested.astype(np.float64)
    slope = np.zeros(len(events), np.float64)
    scaled = 0
    for i in np.nonzero(events.is_alloc)[0].tolist():
        if batch_dimension(events.string(int(events.shape[i])), batch):
            slope[i], intercept[i] = events.requested[i] / batch, 0.0
            scaled += 1
    return Lines(intercept, slope, scaled, int(np.count_nonzero(events.is_alloc)))


BYTE_DTYPES = (4, 6)  # TF's DataType enum: DT_UINT8, DT_INT8 (scratch buffers: workspaces, raw bytes)


def trace_batch(events: MemoryEvents) -> tuple[int | None, float]:
    """The batch a trace most likely ran at, read from its tensors' shapes: the leading dimension that holds the most
    requested bytes among allocations of rank 2 or more that are not byte buffers, and its share of them. A 1-D
    tensor's only dimension is no batch: a bias, or a GPU's convolution workspace (uint8[64552960] on a T4 trace,
    read as the batch, made the what-if refuse the trace: docs/gpu.md). (None, 0.0) without such shapes."""
    held: dict[int, int] = {}
    for i in np.nonzero(events.is_alloc)[0].tolist():
        if int(events.dtype[i]) in BYTE_DTYPES:
            continue
        shape = events.string(int(events.shape[i]))
        if shape and shape.startswith("[") and shape.strip("[]"):
            dims = shape.strip("[]").split(",")
            first = dims[0].strip()
            if len(dims) >= 2 and first.isdigit() and int(first) > 1:
                held[int(first)] = held.get(int(first), 0) + int(events.requested[i])
    if not held:
        return None, 0.0
    batch = max(held, key=lambda b: held[b])
    return batch, held[batch] / sum(held.values())


# a saved trace's curve is made while its report is built (each file of a folder or a cluster): its grid is thinner
TRACE_REPLAY_BUDGET_S = 3.0


def trace_curve(
    events: MemoryEvents, batch: int, own: bfc.SelfCheck | None = None, batches: list[int] | None = None
) -> ReplayCurve:
    """The replay curve of one saved trace (a GPU machine's, say) at its own `batch`: its own sequence, with its
    batch-shaped allocations scaled (`shape_lines`), replayed at a grid of batches through the simulator with the
    trace's own allocator settings (a GPU's: one region, no growth, garbage collection: `bfc.self_check`'s
    defaults), without its limit (a peak past it is what would not fit: the what-if compares it with the budget).
    The self-check comes first: the trace's sequence must give back its own peak; a curve that could not be made
    says why (`why_not`). Region bytes are kept only for a growing allocator (a GPU's one region is its limit).
    `own`: the trace's self-check when the caller has made it (at OWN_TOLERANCE, `bfc.self_check`'s default)."""
    started = time.perf_counter()
    own = bfc.self_check(events, tolerance=OWN_TOLERANCE) if own is None else own
    assert own.prepared is not None
    lines = shape_lines(events, batch)
    out = ReplayCurve(
        probes=[batch],
        events=len(events),
        allocations=lines.allocations,
        aligned=lines.allocations,
        own_error=round(abs(own.peak_error), 5),
        cross_error=0.0,
        traced_peaks=[int(own.traced_peak)],
        source="trace",
        scaled=lines.aligned,
    )
    summed = SummedTrace(events, own.prepared.start, lines, batch) if not own.passed and lines.aligned else None
    if not own.passed and (summed is None or not own.prepared.start or not summed.holds()):
        where = f" (first divergence at event {own.first_divergence})" if own.first_divergence is not None else ""
        out.why_not = (
            f"the trace's own sequence replayed to {own.peak_error:+.1%} of its peak{where}, over the "
            f"{OWN_TOLERANCE:.0%} the replay needs"
        )
        if summed is not None and own.prepared.start:  # it began mid-run, but its chunks do not give its peak back
            out.why_not += (
                f"; the trace begins mid-run, and its own chunks summed over the {format_bytes(own.prepared.start)} "
                f"in use at its start give {format_bytes(summed.peak(batch))}, not its peak of "
                f"{format_bytes(own.traced_peak)} (events missing from it)"
            )
    elif not lines.aligned:
        out.why_not = f"no allocation of the trace has a shape that carries batch {batch}"
    elif summed is not None:  # began mid-run: the simulator cannot know the free chunks it had; the sum can
        for b in batches or grid(batch, (batch, batch), summed.seconds, budget_s=TRACE_REPLAY_BUDGET_S):
            out.batches.append(b)
            out.peaks.append(summed.peak(b))
        out.second_peaks = list(out.peaks)
        out.summed = True
        out.passed = True
    else:
        replay = StepReplay(own.prepared, lines, own)
        timed = time.perf_counter()
        replay.peak(batch)
        per_replay = time.perf_counter() - timed
        for b in batches or grid(batch, (batch, batch), per_replay, budget_s=TRACE_REPLAY_BUDGET_S):
            peak, regions = replay.peak(b)
            out.batches.append(b)
            out.peaks.append(peak)
            if own.prepared.allow_growth:
                out.region_peaks.append(regions)
        out.second_peaks = list(out.peaks)  # one trace, one op order
        out.passed = True
    out.seconds = round(time.perf_counter() - started, 2)
    return out


class SummedTrace:
    """A saved trace's bytes in use at another batch without the allocator's placement: the bytes in use at its start,
    then each allocation's chunk added and taken back at its free, the chunks of the batch-shaped allocations grown
    by what their requests grow by (rounded as BFC rounds, 256 bytes). At the trace's own batch it is the trace's
    own in-use curve, chunk for chunk (`holds`). For a trace that begins mid-run, whose sequence the simulator
    cannot give back because the free chunks the allocator had before it are not in it (docs/gpu.md, "A trace that
    begins mid-run"); the fragmentation another batch would add is not modelled."""

    def __init__(self, events: MemoryEvents, start: int, lines: Lines, batch: int) -> None:
        timed = time.perf_counter()
        self.events, self.start, self.lines, self.batch = events, start, lines, batch
        # each free's allocation in the trace (-1: made before it, or at no known address: its own chunk comes back)
        self.match = np.full(len(events), -1, np.int64)
        open_at: dict[int, int] = {}
        for i, (a, is_a) in enumerate(zip(events.addr.tolist(), events.is_alloc.tolist(), strict=True)):
            if is_a:
                if a >= 0:
                    open_at[a] = i
            elif a >= 0:
                self.match[i] = open_at.pop(a, -1)
        self.traced = self.rounded(batch)
        self.peak(batch)
        self.seconds = time.perf_counter() - timed  # one batch's sum, for the grid's budget

    def rounded(self, batch: float) -> np.ndarray:
        return (np.asarray(self.lines.sizes(batch), np.int64) + 255) // 256 * 256

    def peak(self, batch: float) -> int:
        """The most in use at `batch`: the start plus the largest running sum of the chunks."""
        ev = self.events
        chunk = np.maximum(0, ev.chunk + np.where(ev.is_alloc, self.rounded(batch) - self.traced, 0))
        taken = np.where(self.match >= 0, chunk[np.maximum(self.match, 0)], ev.chunk)
        change = np.where(ev.is_alloc, chunk, -taken)
        return int(self.start + max(0, int(np.cumsum(change).max())))

    def holds(self) -> bool:
        """At the trace's batch the sum gives back the trace's own peak (bytes_allocated) to the byte."""
        return self.peak(self.batch) == int(self.events.live.max())


def odd_probes(cell_batch: int, avoid: set[int] | frozenset[int] = frozenset()) -> tuple[int, int]:
    """Two odd probe batches around the cell's (about 0.7x and 1.15x it, as 23 and 37 are for 32), none equal to a
    dimension in `avoid` (the model's weight shapes: a probe batch equal to a layer's width makes its tensors
    ambiguous), at least 3 and 5."""

    def odd_near(target: float, above: int = 0) -> int:
        n = max(3, above + 2, int(round(target)) | 1)
        while n in avoid or n <= above:
            n += 2
        return n

    low = odd_near(0.7 * cell_batch)
    return low, odd_near(max(1.15 * cell_batch, low + 2), above=low)

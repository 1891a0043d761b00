"""The pre-flight's arithmetic: the step replay on recorded probe traces and what it takes off, the line through two
probe steps where the replay cannot be used, the verdict against the guard's threshold, the largest batch, and the
refusal's words. The probes themselves (a clone in another process) are a collaborator here: they run for real in
tests/integration/test_preflight.py."""

from __future__ import annotations

import weakref
from dataclasses import replace
from pathlib import Path

import psutil
import pytest
from test_fixes import report as fixes_report

from tfmem_magic.advise import bands, diagnose_model, gpu_target, prediction, preflight
from tfmem_magic.advise.preflight import NoReplay, line_through
from tfmem_magic.analyze import step_replay
from tfmem_magic.core.report import DeviceMemory, LineGroup, PreflightInfo, Report, RssInfo
from tfmem_magic.core.sizes import format_bytes
from tfmem_magic.measure.instrument import ModelUse
from tfmem_magic.show import render, view

MiB = 2**20
DATA = Path(__file__).parents[1] / "data" / "replay"  # a CNN's probe traces at batches 23 and 37 (test_step_replay)


def test_the_line_extrapolates_requested_bytes_in_large_tensors_chunks():
    # requested grows 10 MiB per 64 samples; at the larger probe the chunks were 1.4x (a region just doubled): a
    # batch 8x larger gets the chunks large tensors get, at most GROWTH_FRAGMENTATION
    at = line_through({64: (30 * MiB, 20 * MiB), 128: (42 * MiB, 30 * MiB)})
    assert at(1024) == pytest.approx((30 * MiB + (1024 - 128) * (10 * MiB / 64)) * bands.GROWTH_FRAGMENTATION)
    tight = line_through({64: (20 * MiB, 20 * MiB), 128: (30 * MiB, 30 * MiB)})  # 1.0x stays 1.0x
    assert tight(1024) == pytest.approx(30 * MiB + 896 * 10 * MiB / 64)


def test_a_probe_whose_trace_missed_frees_gives_the_allocators_line():
    # requested above allocated: the probe's trace did not see every free, so its requested bytes are no line
    at = line_through({8: (10 * MiB, 30 * MiB), 16: (14 * MiB, 60 * MiB)})
    assert at(32) == pytest.approx(14 * MiB + 16 * (4 * MiB / 8))


class _Model:
    optimizer = None
    trainable_variables: list = []
    weights: list = []


class _Variable:
    def __init__(self, *shape: int) -> None:
        self.shape, self.dtype = shape, "float32"


@pytest.fixture
def no_replay(monkeypatch):
    """The replay cannot be used: the probes' line stands in."""

    def refuse(*args, **kwargs):
        raise NoReplay("its self-check failed")

    monkeypatch.setattr(preflight, "replayed_step", refuse)


def recorded_traces(fed: int = 0, name: str = "cnn"):
    """probe_runs.replay_traces, answered with the recorded CNN traces (or the MLP's: `name` "mlp-fit"), the probes a
    call at batch 320 asks for."""

    def replay_traces(model, batches, train, structure, folder, **kwargs):
        assert batches == [23, 37] and kwargs["pipeline"]
        out = {}
        for b in batches:
            events = step_replay.load_events(DATA / f"{name}-{b}.npz")
            out[b] = str(Path(folder) / f"replay-{b}.npz")
            step_replay.save_events(events, out[b], fed_bytes=fed)
        return out

    return replay_traces


def test_the_replay_predicts_what_the_calls_steps_add_to_what_the_kernel_holds(monkeypatch):
    """The probe process's sequence starts from its first allocation: the weights (and the slots, once the live
    optimizer has them) are held by the kernel already, and the probes' own synthetic data is no part of the call:
    both come off the replayed peak, the larger of the two probes' op orders."""
    monkeypatch.setattr(preflight.probe_runs, "replay_traces", recorded_traces(fed=3 * MiB))
    model = _Model()
    model.weights = [_Variable(256, 1024)]  # 1 MiB
    use = ModelUse(model_ref=lambda: None, calls=["fit"], batch_size=320, feed="arrays")
    at, probes = preflight.replayed_step(model, use, True, 320)
    assert probes == [23, 37]
    check = step_replay.checked(*(step_replay.load_events(DATA / f"cnn-{b}.npz") for b in probes), *probes)
    for batch in (32, 320, 1000):
        replayed = max(peak for peak, _ in check.peaks(batch))
        assert at(batch) == replayed - 4 * MiB
    assert at(320) > 3 * at(32) > 0  # the step's tensors grow with the batch

    class Built:  # an optimizer that has made its slots: the kernel holds them, the probes made them again
        built, variables = True, [_Variable(512, 1024)]  # 2 MiB

    class Legacy:  # tf_keras' legacy optimizers: no `built`, their variables given by a method
        def variables(self):
            return [_Variable(512, 1024)]

    for optimizer in (Built(), Legacy()):
        model.optimizer = optimizer
        again, _ = preflight.replayed_step(model, use, True, 320)
        assert again(320) == at(320) - 2 * MiB
    assert preflight.replayed_step(model, use, False, 320)[0](320) == at(320)  # predict() does not use the slots


def test_slots_to_build_counts_only_an_optimizer_that_has_not_made_them():
    class Adam:
        def __init__(self, variables):
            self.variables = variables

    model = _Model()
    model.trainable_variables = [_Variable(256, 1024)]  # 1 MiB: Adam makes 2 MiB of slots
    model.optimizer = Adam([_Variable(1)])  # its iteration counter only
    assert preflight._slots_to_build(model) == 2 * MiB
    model.optimizer = Adam([_Variable(1), _Variable(256, 1024), _Variable(256, 1024)])
    assert preflight._slots_to_build(model) == 0


def test_a_batch_too_small_for_probes_below_it_is_left_to_the_probes_line():
    with pytest.raises(NoReplay, match="too small"):
        preflight.replayed_step(_Model(), _use(5), True, 5)


def test_a_call_refused_on_the_replay_names_the_replay_and_the_largest_batch_fits(monkeypatch):
    monkeypatch.setattr(preflight.probe_runs, "replay_traces", recorded_traces())
    use = ModelUse(model_ref=lambda: None, calls=["fit"], batch_size=320, feed="arrays")
    at, _ = preflight.replayed_step(_Model(), use, True, 320)
    threshold = round(100 * MiB + at(320) * 0.6)  # the call needs far more than is left
    info = preflight.check(_Model(), "fit", use, threshold, rss=100 * MiB)
    assert info.basis == "replay" and info.band == bands.PREFLIGHT_GROWTH_HIGH and info.verdict == "refused"
    assert info.step_bytes == round(at(320)) and info.probe_batches == [23, 37]
    largest = info.largest_batch
    assert largest is not None
    assert 100 * MiB + at(largest) * (1 + info.band) <= threshold  # it fits with its band
    bigger = next(b for b in range(largest + 1, 320) if preflight.typeable_batch(b) > largest)
    assert 100 * MiB + at(bigger) * (1 + info.band) > threshold  # and the next one typed does not
    text = preflight.refusal(info, "--limit")
    assert "traced at batches 23 and 37 and replayed at batch 320" in text
    assert "(-20%/+40%: it holds" in text  # the replay's two ends: over by at most 20%, under by at most 40%


MLP_CELL = """import keras
model = keras.Sequential([
    keras.layers.Dense(1024, activation="relu"),
    keras.layers.Dense(1024, activation="relu"),
    keras.layers.Dense(10),
])
"""


class _Layer:
    def __init__(self, name: str) -> None:
        self.name = name


class _Sequential(_Model):
    """The recorded MLP's model as the kernel holds it: its layers' names (the probes' clone keeps them), each made
    on a line of a cell (`MLP_CELL`)."""

    def __init__(self) -> None:
        self.layers = [_Layer(name) for name in ("dense", "dense_1", "dense_2")]
        self.name = "sequential"

    def _flatten_layers(self, include_self=True, recursive=True):
        return [self, *self.layers] if include_self else list(self.layers)


def test_a_refusal_names_the_lines_that_made_the_layers_holding_its_replayed_peak(monkeypatch, tmp_path):
    cell = tmp_path / "cell.py"
    cell.write_text(MLP_CELL)
    model = _Sequential()
    sites = {id(model): 2, **{id(layer): 3 + i for i, layer in enumerate(model.layers)}}
    noted = {key: (weakref.ref(x), str(cell), sites[id(x)]) for x in (model, *model.layers) for key in [id(x)]}
    monkeypatch.setattr(preflight.SESSION, "layer_sites", noted)
    monkeypatch.setattr(preflight.probe_runs, "replay_traces", recorded_traces(name="mlp-fit"))
    use = ModelUse(model_ref=lambda: None, calls=["fit"], batch_size=320, feed="arrays")
    at, _ = preflight.replayed_step(model, use, True, 320)
    info = preflight.check(model, "fit", use, round(100 * MiB + at(320) * 0.6), rss=100 * MiB)
    assert info.verdict == "refused" and info.basis == "replay"
    # every tensor live at the larger op order's peak at 320, each in one group: the replay's events are the probe's
    check = step_replay.checked(*(step_replay.load_events(DATA / f"mlp-fit-{b}.npz") for b in (23, 37)), 23, 37)
    assert sum(g.bytes for g in info.by_line) == max(peak for peak, _ in check.peaks(320))
    # the peak is in the backward pass and the optimizer's update: the two hidden layers' gradients are held
    named = {g.label: g for g in info.by_line if g.kind == "line"}
    assert set(named) == {"cell.py:3", "cell.py:4"}
    first, second = named["cell.py:3"], named["cell.py:4"]
    assert first.code == second.code == 'keras.layers.Dense(1024, activation="relu"),'
    assert (first.layer, first.made_by, second.layer) == ("dense", "cell.py:3", "dense_1")
    assert first.backward_bytes == first.bytes and first.tensors[0].shape == "[784,1024]"  # its kernel's gradient
    # a gradient the probes made at [23,1024] and [37,1024], at the asked batch
    grad = second.tensors[0]
    assert (grad.op, grad.shape, grad.phase) == ("MatMul", "[320,1024]", "backward") and grad.bytes >= 320 * 4096
    # the optimizer's and the input pipeline's tensors, and the probe's eager ops: what they are, no line
    others = {g.kind: g for g in info.by_line if g.kind != "line"}
    assert {"keras", "tf.data", "eager"} <= set(others) and all(g.code is None for g in others.values())
    # the refusal's sentence: the top lines, each with its bytes and its code
    text = preflight.refusal(info, "--limit")
    top = sorted(named.values(), key=lambda g: -g.bytes)[0]
    assert f"At the replay's peak: {top.label} (`{top.code}`) {format_bytes(top.bytes)}" in text
    # the text report lists them as its By line block does
    rep = fixes_report(status="refused")
    rep.preflight = info
    rendered = render.render_text(rep)
    assert "Refused   what the replayed step held at its peak at batch 320" in rendered
    assert 'cell.py:3  keras.layers.Dense(1024, activation="relu"),' in rendered
    assert "not by a line: Keras internals" in rendered or "not by a line: eager ops" in rendered
    assert "tfmem-preflight-by-line" in render.render_html(rep)


def test_a_refusal_without_a_named_line_says_nothing_of_lines():
    info = PreflightInfo(call="fit", batch_size=64, verdict="refused", basis="replay", largest_batch=32)
    assert "At the replay's peak" not in preflight.refusal(info, "--limit")
    info.by_line = [LineGroup(label="Keras internals", kind="keras", bytes=MiB)]
    assert "At the replay's peak" not in preflight.refusal(info, "--limit")


def test_the_replay_refuses_on_its_low_end_and_suggests_on_its_high_end(monkeypatch):
    monkeypatch.setattr(preflight.probe_runs, "replay_traces", recorded_traces())
    use = ModelUse(model_ref=lambda: None, calls=["fit"], batch_size=320, feed="arrays")
    at, _ = preflight.replayed_step(_Model(), use, True, 320)
    step = at(320)
    # the growth's low end (-20%) passes the threshold: refused, although a symmetric band (-40%) would not
    refused = preflight.check(_Model(), "fit", use, round(100 * MiB + step * 0.75), rss=100 * MiB)
    assert refused.verdict == "refused" and refused.band_below == bands.PREFLIGHT_GROWTH_LOW == 0.20
    # between the two ends: the call runs under the guard
    between = preflight.check(_Model(), "fit", use, round(100 * MiB + step * 1.1), rss=100 * MiB)
    assert between.verdict == "uncertain"
    # the high end (+40%) fits
    fits = preflight.check(_Model(), "fit", use, round(100 * MiB + step * 1.41), rss=100 * MiB)
    assert fits.verdict == "fits" and preflight.band_words(fits) == "-20%/+40%"


def test_where_the_replay_cannot_be_used_the_probes_line_stands_in_and_says_why(monkeypatch, no_replay):
    monkeypatch.setattr(
        preflight.probe_runs, "probe_peaks", lambda model, batches, *a, **k: {b: (b * MiB, b * MiB) for b in batches}
    )
    info = preflight.check(_Model(), "fit", _use(1024), 600 * MiB, rss=100 * MiB)
    assert info.basis == "probes" and info.replay_note == "its self-check failed"
    assert "the replay was not used: its self-check failed" in preflight.refusal(info, "--limit")


def test_the_call_at_the_batch_a_line_refusal_names_is_judged_on_that_line_without_new_probes(monkeypatch, no_replay):
    """Where the replay could not be used, the refusal's probes' line is kept for the model and its inputs: the call
    at the batch it names is judged on that line (as the refusal judged it), not on two new probes; a batch above
    the refused one probes again."""
    probed: list[list[int]] = []

    def probe_peaks(model, batches, *args, **kwargs):
        probed.append(list(batches))
        return {b: (b * MiB, b * MiB) for b in batches}

    monkeypatch.setattr(preflight.probe_runs, "probe_peaks", probe_peaks)
    monkeypatch.setattr(preflight.SESSION, "preflight_replays", {})
    model = _Model()
    refused = preflight.check(model, "fit", _use(1024), 600 * MiB, rss=100 * MiB)
    assert refused.verdict == "refused" and refused.basis == "probes" and not refused.kept and len(probed) == 1
    named = refused.largest_batch
    assert named is not None and named < 1024
    again = preflight.check(model, "fit", _use(named), 600 * MiB, rss=100 * MiB)
    assert len(probed) == 1, probed  # no new probes
    assert again.kept and again.basis == "probes" and again.probe_batches == refused.probe_batches
    assert again.verdict == "uncertain" and again.largest_batch == named  # the line never says "fits"
    assert again.replay_note == "its self-check failed"
    assert "the line kept from this model's earlier refusal: no new probes" in preflight.how_predicted(again)
    above = preflight.check(model, "fit", _use(2048), 600 * MiB, rss=100 * MiB)
    assert len(probed) == 2 and not above.kept


def test_a_replay_that_fails_after_its_verdict_leaves_the_line_nothing_of_its_own(monkeypatch):
    """The replay judged the call, then failed (its curve for the report): the probes' line stands in with its own
    band, and no replay or lines of the failed one are left in the verdict, nor in what is kept of it."""

    class _FailsLate(_AskedStep):
        fixed = 0

        def curve(self, *args, **kwargs):
            raise NoReplay("its replay at batch 1024 failed")

    monkeypatch.setattr(preflight, "replayed_step", lambda *a, **k: (_FailsLate(), [64, 128]))
    monkeypatch.setattr(
        preflight.probe_runs, "probe_peaks", lambda model, batches, *a, **k: {b: (b * MiB, b * MiB) for b in batches}
    )
    monkeypatch.setattr(preflight.SESSION, "preflight_replays", {})
    info = preflight.check(_Model(), "fit", _use(1024), 600 * MiB, rss=100 * MiB)
    assert info.verdict == "refused" and info.basis == "probes" and info.replay is None and info.by_line == []
    assert preflight.band_words(info) == f"±{bands.PROBE_LINE_BAND:.0%}"
    assert info.replay_note == "its replay at batch 1024 failed"


def _use(batch: int) -> ModelUse:
    return ModelUse(model_ref=lambda: None, calls=["fit"], batch_size=batch, feed="dataset")


@pytest.mark.parametrize(
    # far inside the limit the line still says "uncertain": it missed steps by up to 80% under, so it never lets a
    # call through as fitting (the guard runs it)
    "threshold, verdict",
    [(10_000 * MiB, "uncertain"), (1_100 * MiB, "uncertain"), (600 * MiB, "refused")],
)
def test_the_verdict_uses_the_band_both_ways(monkeypatch, no_replay, threshold, verdict):
    # a step that needs 1 MiB per sample (chunks 1.0x), no probes' floor: 1 GiB at batch 1024, 100 MiB held now
    monkeypatch.setattr(
        preflight.probe_runs, "probe_peaks", lambda model, batches, *a, **k: {b: (b * MiB, b * MiB) for b in batches}
    )
    info = preflight.check(_Model(), "fit", _use(1024), threshold, rss=100 * MiB)
    assert info.basis == "probes" and info.probe_batches == [64, 128]
    assert info.step_bytes == 1024 * MiB and info.predicted_rss_bytes == 1124 * MiB
    assert info.verdict == verdict
    if (
        threshold < 10_000 * MiB
    ):  # the largest batch whose growth, 1 MiB per sample, fits with its band: room / (1 + band)
        expected = int((threshold - 100 * MiB) / (1 + bands.PROBE_LINE_BAND) // MiB)
        assert info.largest_batch == preflight.typeable_batch(expected)


def test_the_allocators_free_regions_absorb_the_growth(monkeypatch, no_replay):
    """RSS never shrinks: regions TF already holds (an earlier, larger step) are reused before the process grows."""
    monkeypatch.setattr(
        preflight.probe_runs, "probe_peaks", lambda model, batches, *a, **k: {b: (b * MiB, b * MiB) for b in batches}
    )
    info = preflight.check(
        _Model(), "fit", _use(1024), 10_000 * MiB, rss=2000 * MiB, tf_current=100 * MiB, tf_held=900 * MiB
    )
    assert info.predicted_rss_bytes == 2000 * MiB + (100 + 1024 - 900) * MiB


def test_a_refusal_says_what_batch_a_restart_would_let_it_name_where_held_regions_cost_it(monkeypatch, no_replay):
    """The held regions never count for the named batch; where they are large, the refusal says what a restart gives
    back and the batch judged without them, as this call was."""
    monkeypatch.setattr(
        preflight.probe_runs, "probe_peaks", lambda model, batches, *a, **k: {b: (b * MiB, b * MiB) for b in batches}
    )
    # 1 MiB per sample, 2000 MiB held now of which 800 MiB are TF's regions beyond its 100 MiB in use
    info = preflight.check(
        _Model(), "fit", _use(1024), 2100 * MiB, rss=2000 * MiB, tf_current=100 * MiB, tf_held=900 * MiB
    )
    assert info.verdict == "refused" and info.reusable_bytes == 800 * MiB
    band = 1 + bands.PROBE_LINE_BAND
    assert info.largest_batch == preflight.typeable_batch(int(100 / band))  # the regions not counted
    assert info.restart_batch == preflight.typeable_batch(int(900 / band))  # the process 800 MiB lower
    text = preflight.refusal(info, "--limit")
    assert "holds 800 MiB of regions from earlier steps" in text and f"then about {info.restart_batch}" in text
    # held regions too small to change much: nothing said
    small = preflight.check(
        _Model(), "fit", _use(1024), 2100 * MiB, rss=2000 * MiB, tf_current=100 * MiB, tf_held=130 * MiB
    )
    assert small.verdict == "refused" and small.restart_batch is None
    assert "kernel restart" not in preflight.refusal(small, "--limit")


def _held_regions_call() -> PreflightInfo:
    """A call at batch 1024 with 100 MiB of room under the threshold, in a kernel whose TF allocator holds 800 MiB
    of regions beyond its 100 MiB in use."""
    return PreflightInfo(
        call="fit",
        batch_size=1024,
        rss_bytes=2000 * MiB,
        threshold_bytes=2100 * MiB,
        band=0.4,
        band_below=0.2,
        tf_bytes=100 * MiB,
        reusable_bytes=800 * MiB,
    )


def test_judged_again_as_the_pre_flight_leaves_the_kernel_a_refusal_says_only_the_restart_it_still_has():
    """_as_left judges a refusal again from where the pre-flight leaves the kernel (more of TF in use, so fewer held
    regions): a restart batch from the first judgement must not outlive it."""
    info = _held_regions_call()
    step = lambda b: b * MiB  # noqa: E731 - a step of 1 MiB per sample
    preflight._judge(info, step, 100 * MiB, 900 * MiB)
    assert info.verdict == "refused" and info.restart_batch == preflight.typeable_batch(int(900 / 1.4))
    # judged again: the pre-flight's own work took 780 MiB more of TF in use, 20 MiB of regions are left held
    info.tf_bytes, info.reusable_bytes = 880 * MiB, 20 * MiB
    preflight._judge(info, step, 880 * MiB, 900 * MiB, decided=True)
    assert info.verdict == "refused" and info.restart_batch is None
    assert "kernel restart" not in preflight.refusal(info, "--limit")
    # the restart would let the call's own batch run: said so, not as "about 1024"
    info.reusable_bytes, info.threshold_bytes = 1900 * MiB, 3000 * MiB
    preflight._judge(info, step, 100 * MiB, 2000 * MiB, decided=True)
    assert info.restart_batch == 1024
    assert "then this call's batch (1024) would be judged to fit" in preflight.refusal(info, "--limit")


class _AskedStep:
    """A step of 1 MiB per sample that notes each batch asked (each a replay, where the real step replays)."""

    def __init__(self) -> None:
        self.asked: list[int] = []

    def __call__(self, b: float) -> float:
        n = max(1, round(b))
        if n not in self.asked:
            self.asked.append(n)
        return n * MiB

    @property
    def replayed(self) -> list[int]:
        return list(self.asked)

    op_types = None  # ReplayedStep's: the probes' graphs' op types (not read)


def test_on_the_replays_path_the_restart_batch_is_searched_once_as_the_pre_flight_leaves_the_kernel():
    """The replay's refusal is judged twice (as the call began, then as the pre-flight leaves the kernel): the
    batch a restart would let it name is searched by the second judgement only, even where nothing grew between."""
    info = _held_regions_call()
    step = _AskedStep()
    preflight._judge(info, step, 100 * MiB, 900 * MiB, hint=False)
    assert info.verdict == "refused" and info.restart_batch is None
    first = len(step.asked)
    # began above where the process is now: nothing grew since the call began
    began = (psutil.Process().memory_info().rss + 1024 * MiB, 1024 * MiB)
    preflight._as_left(info, step, 0, 900 * MiB, began)  # type: ignore[arg-type] - replayed and called as the step
    assert info.verdict == "refused" and info.restart_batch == preflight.typeable_batch(int(900 / 1.4))
    assert info.rss_bytes == 2000 * MiB and info.reusable_bytes == 800 * MiB
    assert len(step.asked) > first  # the hint's own search, seeded with the first one's batches


def test_the_refusal_says_what_was_predicted_against_what_is_allowed_and_what_to_do():
    info = PreflightInfo(
        call="fit",
        batch_size=1024,
        probe_batches=[64, 128],
        step_bytes=4 * 2**30,
        extra_bytes=100 * MiB,
        rss_bytes=800 * MiB,
        predicted_rss_bytes=5 * 2**30,
        threshold_bytes=3 * 10**9,
        band=0.25,
        verdict="refused",
        largest_batch=352,
        seconds=8.6,
    )
    text = preflight.refusal(info, "--limit")
    for said in (
        "stopped fit() before its first step",
        "at batch 1024",
        "~5 GiB",
        "--limit allows 2.79 GiB",
        "Lower the batch size to 352",
        "%tfmem fix shrink-batch",
        "batches 64 and 128",
        "8.6 s",
        "--no-preflight",
    ):
        assert said in text, said
    info.largest_batch = None
    assert "Not even batch 1 fits" in preflight.refusal(info, "--limit")


def test_a_batch_too_small_to_extrapolate_is_left_to_the_guard(no_replay):
    with pytest.raises(preflight.TfmemUsageError, match="too small"):
        preflight.check(_Model(), "fit", _use(1), 10**9, rss=0)


def _refused(monkeypatch) -> tuple[PreflightInfo, Report]:
    """A call at batch 320 refused on the recorded CNN replay, and the report of its cell. TF held 40 MiB more than
    at the cell's start as the call began, and 30 MiB of regions beyond that; the process held 100 MiB then; the
    guard's threshold is not the limit (the cell's start plus its margin was higher); the pre-flight's own replay
    grew the process by 80 MiB after the call began."""
    monkeypatch.setattr(preflight.probe_runs, "replay_traces", recorded_traces())
    use = ModelUse(model_ref=lambda: None, calls=["fit"], batch_size=320, feed="arrays")
    at, _ = preflight.replayed_step(_Model(), use, True, 320)
    threshold = round(100 * MiB + at(320) * 0.6)
    info = preflight.check(_Model(), "fit", use, threshold, rss=100 * MiB, tf_current=60 * MiB, tf_held=90 * MiB)
    rep = fixes_report(status="oom", batch=320)
    rep.preflight, rep.env.budget_bytes = info, threshold - 50 * MiB
    rep.rss = RssInfo(baseline_bytes=100 * MiB, peak_bytes=180 * MiB, end_bytes=180 * MiB)
    rep.tf = {"CPU:0": DeviceMemory(20 * MiB, 60 * MiB, 60 * MiB)}
    return info, rep


def test_a_refused_curve_past_its_budget_replays_only_the_slope_batches_it_lacks(monkeypatch):
    """The refused report's curve (ReplayedStep.curve): with no time left, it still replays the batches from a
    quarter to twice the refused one that the what-if's slope is drawn through (refused_basis), and nothing else."""
    monkeypatch.setattr(preflight.probe_runs, "replay_traces", recorded_traces())
    use = ModelUse(model_ref=lambda: None, calls=["fit"], batch_size=320, feed="arrays")
    at, _ = preflight.replayed_step(_Model(), use, True, 320)
    before = set(at.replayed)
    assert len(preflight.slope_batches(before, 320)) < preflight.SLOPE_POINTS
    curve = at.curve(320, budget_s=0.0)
    added = set(curve.batches) - before
    assert len(preflight.slope_batches(curve.batches, 320)) == preflight.SLOPE_POINTS
    assert added and all(preflight.slope_batches([b], 320) for b in added), added
    assert len(set(at.curve(320).batches)) > len(curve.batches)  # with its budget, more of the grid


def test_a_refused_calls_what_if_is_its_replay_anchored_on_what_it_predicted(monkeypatch):
    info, rep = _refused(monkeypatch)
    assert info.verdict == "refused" and info.reusable_bytes == 30 * MiB and info.tf_bytes == 60 * MiB
    curve = info.replay
    # the batches the verdict and the largest batch's search replayed, and more of the calibration's grid
    assert curve is not None and curve.passed and {320, info.largest_batch} <= set(curve.batches)
    assert len(curve.batches) > 8
    rep.whatif_basis = preflight.refused_basis(rep, prediction.analytic_basis(rep))
    rep.prediction = prediction.summary(rep)
    # nothing of the step ran: at each replayed batch the what-if gives what the pre-flight judged, the step's
    # growth plus fit's copy, over what TF held as the call began (40 MiB over the cell's start)
    at = step_replay.checked(*(step_replay.load_events(DATA / f"cnn-{b}.npz") for b in (23, 37)), 23, 37)
    fixed = max(peak for peak, _ in at.peaks(320)) - info.step_bytes  # the weights and the probes' data
    for batch in (64, 128, info.largest_batch, 320):
        step = max(peak for peak, _ in at.peaks(batch)) - fixed
        assert prediction.predict(rep, batch_size=batch).peak_bytes == pytest.approx(
            40 * MiB + step + info.extra_bytes, abs=2
        )
    now = prediction.predict(rep)
    assert now.basis == "replay" and now.error_band == bands.PREFLIGHT_ANCHORED_BAND
    # judged as the pre-flight judged it (its threshold, TF's bytes and regions held already, +40% on the growth
    # only, the pre-flight's own 80 MiB not the user's): the refusal, the finding, the fix and the what-if name one
    assert now.largest_batch == info.largest_batch and prediction.outside_tf_bytes(rep) == 0
    # ... which holds while the what-if judges with the pre-flight's +40% (the larger of it and its band)
    assert max(bands.PREFLIGHT_ANCHORED_BAND, bands.OWN_STEP_BAND) <= bands.PREFLIGHT_GROWTH_HIGH
    bigger = prediction.typeable_batch(info.largest_batch + 8)
    assert prediction.predict(rep, batch_size=info.largest_batch).fits
    assert not prediction.predict(rep, batch_size=bigger).fits
    assert any("anchored on what the pre-flight predicted for the 320 batch it refused" in n for n in now.notes)
    assert view.whatif_rows(rep, now)[0][0] == "as asked (batch 320, refused)"
    # what grows with the batch is the replay's: twice the input per sample is about the replay at twice the batch
    # (the layer outputs' slope had left most of it in `other`, which no knob scales: -20%; here +13%, from the
    # staircase high the replay has at 320 that the anchor keeps)
    doubled = prediction.predict(rep, input_scale=2)
    assert doubled.basis == "analytic" and doubled.error_band == bands.ANALYTIC_BAND
    assert doubled.peak_bytes == pytest.approx(prediction.predict(rep, batch_size=640).peak_bytes, rel=0.15)
    assert prediction.predict(rep, policy="mixed_bfloat16").peak_bytes < 0.7 * now.peak_bytes
    finding = diagnose_model.large_batch(rep)
    assert finding is not None and "In the pre-flight's replay of the step, what grows" in finding.evidence
    assert f"({format_bytes(rep.whatif_basis.measured_peak)})" in finding.evidence  # the step's predicted peak
    # a saved report predicts as the live one
    again = Report.from_json(rep.to_json())
    assert prediction.predict(again, batch_size=200).peak_bytes == prediction.predict(rep, batch_size=200).peak_bytes


def test_the_what_if_names_the_refusals_batch_where_it_is_asked_the_refusals_question(monkeypatch):
    info, rep = _refused(monkeypatch)
    curve = info.replay
    assert curve is not None and info.largest_batch is not None
    # a staircase that dips above the named batch (a probe's op order can put a tensor in a region better there):
    # the what-if's own search, between the replayed batches, lands on another batch
    dip = next(b for b in curve.batches if b > info.largest_batch + 16)
    k = curve.batches.index(dip)
    low = curve.batches.index(info.largest_batch)
    curve.peaks[k], curve.second_peaks[k] = curve.peaks[low], curve.second_peaks[low]
    rep.whatif_basis = preflight.refused_basis(rep, prediction.analytic_basis(rep))
    basis, now = rep.whatif_basis, prediction.predict(rep)
    searched = prediction.largest_batch(
        basis, basis.knobs, now.budget_bytes, now.error_band, now.process_margin, now.measured_peak, rep
    )
    assert searched is not None and searched > info.largest_batch
    # asked the refusal's question, it names the refusal's batch (the finding, the fix and the panel read it)
    assert now.largest_batch == info.largest_batch
    assert prediction.predict(rep, batch_size=64).largest_batch == info.largest_batch
    # another question (a budget given) is searched on the replay
    other = prediction.predict(rep, tf_budget=now.budget_bytes)
    assert other.largest_batch == searched
    # where the refusal found not even the smallest batch fits, the what-if says so too
    info.largest_batch = None
    assert prediction.predict(rep).largest_batch is None and other.largest_batch is not None


def test_only_a_call_refused_on_the_replay_gives_its_basis(monkeypatch):
    info, rep = _refused(monkeypatch)
    basis = prediction.analytic_basis(rep)
    assert preflight.refused_basis(rep, basis) is not None
    rep.model.batch_size = 256  # the report's model is not the call's step
    assert preflight.refused_basis(rep, prediction.analytic_basis(rep)) is None
    rep.model.batch_size = 320
    assert preflight.refused_basis(rep, replace(basis, measured_peak=10 * MiB)) is None  # a measured peak anchors
    info.verdict = "uncertain"  # it ran: the cell's measured peak anchors calibration's replay instead
    assert preflight.refused_basis(rep, basis) is None
    info.verdict, info.replay = "refused", None  # refused on the probes' line: no replay to predict from
    assert preflight.refused_basis(rep, basis) is None


def test_a_loop_of_calls_is_checked_once_per_batch_and_never_below_one_it_let_run(monkeypatch):
    # a train_on_batch loop over slices: every call comes to the pre-flight, and its last slice is often smaller
    asked = []

    def check(model, call, use, *args):
        asked.append((call, use.batch_size))
        verdict = "fits" if use.batch_size < 200 else "uncertain" if use.batch_size < 300 else "refused"
        return PreflightInfo(call=call, batch_size=use.batch_size, verdict=verdict)

    monkeypatch.setattr(preflight, "check", check)
    checks, model = preflight.Preflight(), _Model()
    for batch in (64, 64, 40, 128, 96, 256, 256, 200):  # 256 is let run under the guard: 200 needs less
        checks(model, "train_on_batch", _use(batch), 10**9, 0, "--limit")
    checks(model, "test_on_batch", _use(40), 10**9, 0, "--limit")  # another call: its own step
    with pytest.raises(preflight.PreflightRefused):
        checks(model, "train_on_batch", _use(512), 10**9, 0, "--limit")
    with pytest.raises(preflight.PreflightRefused):  # below a refused batch, above one let run: checked
        checks(model, "train_on_batch", _use(384), 10**9, 0, "--limit")
    assert asked == [
        ("train_on_batch", 64),
        ("train_on_batch", 128),
        ("train_on_batch", 256),
        ("test_on_batch", 40),
        ("train_on_batch", 512),
        ("train_on_batch", 384),
    ]


def test_only_an_on_batch_loop_of_one_input_shape_skips_smaller_batches_and_failed_probes_are_not_run_again(
    monkeypatch,
):
    asked = []

    def check(model, call, use, *args):
        asked.append((call, use.batch_size, use.input_shape))
        if use.batch_size == 7:
            raise preflight.TfmemUsageError("the probes could not rebuild the model")
        return PreflightInfo(call=call, batch_size=use.batch_size, verdict="fits")

    monkeypatch.setattr(preflight, "check", check)
    checks, model = preflight.Preflight(), _Model()

    def use(batch: int, shape: tuple = (None, 8)) -> ModelUse:
        return ModelUse(model_ref=lambda: None, calls=["fit"], batch_size=batch, feed="arrays", input_shape=shape)

    for call, batch, shape in (
        ("fit", 256, (256, 8)),
        ("fit", 128, (128, 8)),  # fit: another array, checked
        ("train_on_batch", 256, (256, 8)),
        ("train_on_batch", 128, (128, 8)),
        ("train_on_batch", 128, (128, 32)),
    ):  # a longer input: checked
        checks(model, call, use(batch, shape), 10**9, 0, "--limit")
    assert asked == [
        ("fit", 256, (256, 8)),
        ("fit", 128, (128, 8)),
        ("train_on_batch", 256, (256, 8)),
        ("train_on_batch", 128, (128, 32)),
    ]
    asked.clear()
    for batch in (7, 9, 11):  # the probes failed once: not again for this model and call in the cell
        checks(model, "predict_on_batch", use(batch), 10**9, 0, "--limit")
    assert asked == [("predict_on_batch", 7, (None, 8))] and len(checks.notes) == 1


def test_a_steps_cost_per_sample_is_each_layers_weights_times_where_it_applies_them():
    import keras

    from tfmem_magic.analyze.modelinfo import forward_macs_per_sample

    mlp = keras.Sequential([keras.Input((784,)), keras.layers.Dense(4096), keras.layers.Dense(10)])
    assert forward_macs_per_sample(mlp) == (785 * 4096 + 4096) + (4097 * 10 + 10)
    # a convolution applies its kernel at every output pixel: 30 x 30 of them
    cnn = keras.Sequential([keras.Input((32, 32, 3)), keras.layers.Conv2D(8, 3)])
    assert forward_macs_per_sample(cnn) == (3 * 3 * 3 * 8 + 8) * 900 + 900 * 8
    # a recurrent layer at every time step; an Embedding looks up and multiplies nothing
    gru = keras.Sequential([keras.Input((200,)), keras.layers.Embedding(5000, 32), keras.layers.GRU(16)])
    assert forward_macs_per_sample(gru) == 200 * 32 + gru.layers[1].count_params() * 200 + 16
    # attention's scores grow with the sequence squared
    inp = keras.Input((128, 64))
    att = keras.Model(inp, keras.layers.MultiHeadAttention(num_heads=4, key_dim=16)(inp, inp))
    layer = att.layers[-1]
    assert forward_macs_per_sample(att) == layer.count_params() * 128 + 2 * 4 * 16 * 128 * 128 + 128 * 64

    # an encoder-decoder (keras-io's seq2seq): the decoder's LSTM takes [sequence, h, c], each LSTM returns its
    # states, and the time dimension is open; its steps are the ones the cell fed, a layer's first input and output
    enc_in, dec_in = keras.Input((None, 71)), keras.Input((None, 93))
    _, h, c = keras.layers.LSTM(32, return_state=True)(enc_in)
    seq, _, _ = keras.layers.LSTM(32, return_sequences=True, return_state=True)(dec_in, initial_state=[h, c])
    s2s = keras.Model([enc_in, dec_in], keras.layers.Dense(93)(seq))
    fed = {"x": [{"__tfmem_leaf__": [[16, 71], "float32"]}, {"__tfmem_leaf__": [[59, 93], "float32"]}]}
    encoder, decoder, dense = s2s.layers[2], s2s.layers[3], s2s.layers[4]
    assert forward_macs_per_sample(s2s, fed) == (
        encoder.count_params() * 16 + 32 + decoder.count_params() * 59 + 59 * 32 + dense.count_params() * 59 + 59 * 93
    )

    class Never(keras.Model):  # a subclassed model never called on symbolic inputs: its layers' shapes are unknown
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(8)

        def call(self, x):
            return self.dense(x)

    assert forward_macs_per_sample(Never()) is None


def test_the_replays_probes_are_capped_by_what_their_step_costs_not_only_by_the_batch():
    import keras

    use = ModelUse(model_ref=lambda: None, calls=["fit"], batch_size=65536, feed="arrays")
    wide = keras.Sequential([keras.Input((784,)), keras.layers.Dense(4096), keras.layers.Dense(4096)])
    capped = preflight.replay_probe_target(wide, use, 65536)
    # 1/10 of the batch would run ~6,500 rows of a 20-million multiply-add model per probe step
    assert preflight.REPLAY_PROBE_FLOOR <= capped < 6554
    assert 1.15 * capped * (785 * 4096 + 4097 * 4096) <= preflight.REPLAY_PROBE_MACS
    small = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    assert preflight.replay_probe_target(small, use, 65536) == 6554  # cheap steps: 1/10 of the batch
    assert preflight.replay_probe_target(wide, use, 100) == 10  # below the floor already: 1/10 of the batch
    # a model whose cost is unknown is not capped
    assert preflight.replay_probe_target(keras.Sequential([keras.layers.Dense(4)]), use, 65536) == 6554


def test_fits_and_the_largest_batch_never_count_less_than_the_models_own_outputs():
    # a prediction of 0.25 MiB per sample where the model's outputs alone hold 1 MiB: the probes missed most of it
    info = PreflightInfo(call="fit", batch_size=1024, rss_bytes=100 * MiB, threshold_bytes=1200 * MiB, band=0.4)
    info.band_below, info.basis, info.probe_batches = 0.2, "replay", [71, 117]
    preflight._judge(info, lambda b: 0.25 * MiB * b, 0, 0)
    assert info.verdict == "fits" and info.floor_bytes == 0  # without the floor: 256 MiB (+40%) fits the 1.1 GiB
    preflight._judge(info, lambda b: 0.25 * MiB * b, 0, 0, floor=1.0 * MiB)
    # judged on the floor: 1 GiB (+40%) does not fit, but the prediction's low end refuses nothing
    assert info.verdict == "uncertain" and info.step_bytes == 256 * MiB and info.floor_bytes == 1024 * MiB
    largest = info.largest_batch
    assert largest is not None and 100 * MiB + largest * MiB * 1.4 <= 1200 * MiB
    assert "no less than the 1 GiB the model's layer outputs alone hold at batch 1024" in preflight.how_predicted(info)


def test_the_floor_is_a_share_of_the_layers_outputs_when_training_and_the_largest_output_when_not():
    import keras

    model = keras.Sequential(
        [keras.Input((784,)), keras.layers.Dense(4096), keras.layers.Flatten(), keras.layers.Dense(10)]
    )
    use = ModelUse(model_ref=lambda: model, calls=["fit"], batch_size=64, feed="arrays")
    # a Flatten's output is a view of its input: not counted
    training, inferring = preflight.described(use, True), preflight.described(use, False)
    assert preflight.parts_floor(training, True) == pytest.approx(preflight.PARTS_FLOOR_TRAIN * (4096 + 10) * 4)
    assert preflight.parts_floor(inferring, False) == 4096 * 4


def test_the_largest_batch_is_the_one_halving_finds_in_fewer_replays():
    import math
    import random

    def halving(need, room, batch):  # the plain bisection: what the search must answer
        if need(1) > room:
            return None
        if need(batch) <= room:
            return batch
        low, high = 1, batch
        while high - low > 1 and preflight.typeable_batch(high - 1) != preflight.typeable_batch(low):
            mid = (low + high) // 2
            low, high = (mid, high) if need(mid) <= room else (low, mid)
        return preflight.typeable_batch(low)

    rng = random.Random(0)
    calls: list[int] = []
    replays = {"halving": 0, "search": 0, "again": 0}
    for _ in range(300):  # steps that grow in a line with BFC-like stairs where a region is added
        a, s, stair = rng.uniform(0, 1e9), rng.uniform(1e5, 1e7), rng.uniform(0, 3e7)
        region = rng.choice([16 << 20, 64 << 20, 256 << 20])
        batch = rng.choice([1024, 4096, 65536])

        def need(b, a=a, s=s, stair=stair, region=region):
            calls.append(b)
            return a + s * b + stair * math.floor(s * b / region)

        room = rng.uniform(a, need(batch))
        calls.clear()
        expected = halving(need, room, batch)
        replays["halving"] += len(calls)
        calls.clear()
        assert preflight._largest(need, room, batch) == expected
        replays["search"] += len(calls)
        # searched again under a little less room (the kernel as the pre-flight leaves it), from what the first
        # search replayed (free now): the answer halving finds there, in about half the replays
        tried, less = sorted(set(calls)), room - rng.uniform(0, 0.03) * (room - a)
        calls.clear()
        expected = halving(need, less, batch)
        calls.clear()
        assert preflight._largest(need, less, batch, tried) == expected
        replays["again"] += len([b for b in calls if b not in tried])
    assert replays["search"] < 0.5 * replays["halving"]
    assert replays["again"] < 0.55 * replays["search"], replays
    assert preflight._largest(lambda b: 2.0 * b, 1.0, 64) is None  # not even 1
    assert preflight._largest(lambda b: 1.0 * b, 1000.0, 64) == 64


class _Sublayer:
    pass


class _Flat(_Model):
    """A model whose layers Keras' walk gives (gpu_target.flat_layers)."""

    def _flatten_layers(self, include_self: bool = False, recursive: bool = True) -> list[object]:
        return [_Sublayer(), _Sublayer()]


def test_the_probes_graphs_say_what_the_step_runs_only_where_both_were_read_and_the_clone_is_the_kernels():
    """The op types both probes' graphs hold (gpu_target.types_convolve judges them); None where one probe's were
    not read, or where a clone's layers are not the kernel model's (a config rebuilt without some of them); the
    model's own saved step is no clone."""
    layers = ["_Sublayer", "_Sublayer"]
    both = [{"op_types": ["Conv2D"], "layers": layers}, {"op_types": ["MatMul"], "layers": layers}]
    assert gpu_target.traced_op_types(_Flat(), both, False) == ["Conv2D", "MatMul"]
    assert gpu_target.traced_op_types(_Flat(), [both[0], {"op_types": None, "layers": layers}], False) is None
    assert gpu_target.traced_op_types(_Flat(), [both[0], {}], False) is None  # a file written without them
    fewer = [both[0], {"op_types": ["MatMul"], "layers": ["_Sublayer"]}]
    assert gpu_target.traced_op_types(_Flat(), fewer, False) is None
    saved = [{"op_types": ["MatMul"], "layers": None}] * 2
    assert gpu_target.traced_op_types(_Model(), saved, True) == ["MatMul"]
    # what a calibration keeps on its curve (ReplayCurve.convolves): a "none" only where the probes' step was all
    # the cell ran (a predict step's probes did not trace an evaluation's loss); a convolution stands either way
    from tfmem_magic.advise.calibration import _convolves

    assert _convolves(_Model(), saved, True, "folder") is False
    assert _convolves(_Model(), saved, False, "folder") is None
    assert _convolves(_Flat(), both, False, None) is True
    assert _convolves(_Flat(), fewer, True, None) is None  # not the kernel model's clone: the layers decide

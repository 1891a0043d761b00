"""The held-memory rules on hand-made reports, where each expected finding is known in advance (the real-kernel
cases are in tests/integration/test_held.py; a predict loop that grows RSS is not reproducible on TF 2.21, so its
rule's firing is checked here, on call records as the instrumentation writes them)."""

from tfmem_magic.advise.diagnose_held import (
    drop_lines,
    held_by_tensorflow,
    holder_words,
    leak_in_cell,
    predict_loop_growth,
)
from tfmem_magic.core.report import CallRecord, DeviceMemory, HeldInfo, Holder, Report

MiB = 2**20


def report_with(calls=(), holders=(), left=0, runtime_new=0) -> Report:
    r = Report(tf={"CPU:0": DeviceMemory(baseline_bytes=10 * MiB, peak_bytes=50 * MiB, end_bytes=10 * MiB + left)})
    r.calls = list(calls)
    r.held = HeldInfo(
        left_bytes=left,
        holders=list(holders),
        runtime_bytes=runtime_new,
        runtime_entries=2,
        runtime_new_bytes=runtime_new,
    )
    return r


def fit(before, after, call="fit", rss=(0, 0)) -> CallRecord:
    return CallRecord(
        call, "m", tf_before_bytes=before, tf_after_bytes=after, rss_before_bytes=rss[0], rss_after_bytes=rss[1]
    )


def test_a_loop_of_fits_that_each_leave_memory_names_the_name_that_holds_it():
    results = Holder(
        "results",
        "dict",
        12 * MiB,
        new_bytes=12 * MiB,
        models=["a", "b", "c"],
        model_bytes=[4 * MiB] * 3,
        paths=["results[1].model"],
    )
    r = report_with([fit(0, 4 * MiB), fit(4 * MiB, 8 * MiB), fit(8 * MiB, 12 * MiB)], [results], left=12 * MiB)
    finding = leak_in_cell(r)
    assert finding is not None and finding.title == "Each of the 3 fit() calls in this cell left ~4 MiB behind"
    assert finding.holders == ["results"] and "holds 3 Keras models (a, b, c), 4 MiB each" in finding.evidence
    # two calls are not a loop; a loop that gave its memory back before the cell ended is not a leak
    assert leak_in_cell(report_with(r.calls[:2], [results], left=8 * MiB)) is None
    assert leak_in_cell(report_with(r.calls, [results], left=MiB)) is None


def test_models_of_different_sizes_are_given_in_all_not_each():
    h = Holder(
        "histories", "dict", 7 * MiB, models=["s", "l"], model_bytes=[MiB, 6 * MiB], paths=["histories[256].model"]
    )
    assert holder_words(h) == (
        "`histories` — a dict in your namespace — holds 2 Keras models (s, l), 7 MiB (e.g. histories[256].model)"
    )


def test_memory_only_tensorflow_holds_is_named_so_and_only_when_it_grew():
    assert held_by_tensorflow(report_with(runtime_new=5 * MiB)).fixes == ["clear-session"]
    assert held_by_tensorflow(report_with(runtime_new=MiB // 2)) is None


def test_predict_in_a_loop_fires_on_measured_rss_growth_only():
    growing = [fit(0, 0, "predict", (100 * MiB + i * 3 * MiB, 0)) for i in range(6)]
    finding = predict_loop_growth(report_with(growing))
    assert finding is not None and "3 MiB with each predict() call of a loop of 6" in finding.title
    assert "predict_on_batch" in finding.evidence
    flat = [fit(0, 0, "predict", (100 * MiB + (i % 2) * MiB // 4, 0)) for i in range(6)]
    assert predict_loop_growth(report_with(flat)) is None
    assert predict_loop_growth(report_with(growing[:4])) is None  # too few calls to tell growth from noise


def test_the_fix_empties_containers_resets_outputs_and_frees_other_names():
    code = drop_lines(["models", "Out", "keep", "model"], {"models": "list", "keep": "Keep", "model": "Keras model"})
    # the model a name is bound to is the user's working model: never dropped by a fix
    assert code.splitlines() == [
        "models.clear()",
        "# IPython's output cache (Out, _, __, ___)",
        "%reset -f out",
        "# clears the Keras session and what TensorFlow keeps for models that are gone; says what came back",
        "%tfmem free keep",
    ]


def test_a_loop_that_rebinds_model_names_the_registry_not_the_last_model():
    """`for lr in lrs: model = build(); model.fit(...)`: `model` holds only the last of the models; the others are
    TensorFlow's. Naming `model` (and dropping it) would be wrong."""
    model = Holder("model", "Keras model", 4 * MiB, new_bytes=4 * MiB, models=["m3"], model_bytes=[4 * MiB])
    r = report_with(
        [fit(0, 4 * MiB), fit(4 * MiB, 8 * MiB), fit(8 * MiB, 12 * MiB)], [model], left=12 * MiB, runtime_new=8 * MiB
    )
    finding = leak_in_cell(r)
    assert finding is not None and finding.holders == []
    assert "8 MiB of it no Python object holds: TensorFlow's gradient registry" in finding.evidence

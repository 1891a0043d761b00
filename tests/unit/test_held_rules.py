"""The held-memory rules on hand-made reports, where each expected finding is known in advance (the real-kernel
cases are in tests/integration/test_held.py; a predict loop that grows RSS is not reproducible on TF 2.21, so its
rule's firing is checked here, on call records as the instrumentation writes them)."""

from tfmem_magic.advise.diagnose import RunSummary, leak_growth
from tfmem_magic.advise.diagnose_held import (
    drop_lines,
    held_by_tensorflow,
    held_lines_words,
    holder_words,
    leak_in_cell,
    predict_loop_growth,
)
from tfmem_magic.core.report import CallRecord, DeviceMemory, HeldInfo, Holder, LineGroup, Report, TraceInfo

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


def held_lines(complete=True) -> TraceInfo:
    """A trace whose cell left 12 MiB live at its end: 8 MiB made by a line of a tf.function, 3 MiB by eager ops,
    a little by another line and by Keras' own step."""
    return TraceInfo(
        events=10,
        complete=complete,
        held_at_end_by_line=[
            LineGroup("In [2] line 3", "line", "return tf.random.normal([1024, 1024])", bytes=8 * MiB),
            LineGroup("eager ops", "eager", bytes=3 * MiB),
            LineGroup("In [2] line 5", "line", "small = tf.zeros([8])", bytes=1024),
            LineGroup("Keras internals", "keras", bytes=MiB),
        ],
    )


def test_a_leak_names_the_lines_that_made_what_the_cell_left_live_and_never_guesses_one():
    results = Holder("results", "dict", 12 * MiB, new_bytes=12 * MiB, models=["a", "b", "c"], model_bytes=[4 * MiB] * 3)
    r = report_with([fit(0, 4 * MiB), fit(4 * MiB, 8 * MiB), fit(8 * MiB, 12 * MiB)], [results], left=12 * MiB)
    r.trace = held_lines()
    words = (
        " Still live at the cell's end, by the line of code that made it: In [2] line 3 "
        "(`return tf.random.normal([1024, 1024])`) 8 MiB; eager ops 3 MiB (no line: the trace keeps no stack for an "
        "eager op)."
    )
    assert held_lines_words(r) == words  # a line under 256 KiB, Keras' own step: not named
    finding = leak_in_cell(r)
    assert finding is not None and words in finding.evidence
    # a trace that stopped before the cell ended holds a step's temporaries at its end: no line is named from it
    r.trace = held_lines(complete=False)
    assert held_lines_words(r) == ""
    # only eager ops: nothing is named (they carry no line in the trace)
    r.trace = TraceInfo(events=10, held_at_end_by_line=[LineGroup("eager ops", "eager", bytes=12 * MiB)])
    assert held_lines_words(r) == ""
    r.trace = None
    assert held_lines_words(r) == ""


def test_a_cell_that_leaks_at_every_run_names_the_line_too():
    kept = Holder("kept", "list", 12 * MiB, new_bytes=4 * MiB, tensors=3)
    r = report_with(holders=[kept], left=4 * MiB)
    r.run, r.trace = 3, held_lines()
    earlier = [RunSummary(1, 4 * MiB, 0, 0, {"kept": 4 * MiB}), RunSummary(2, 4 * MiB, 0, 0, {"kept": 8 * MiB})]
    finding = leak_growth(r, earlier)
    assert finding is not None and finding.holders == ["kept"]
    assert finding.evidence.endswith(held_lines_words(r)) and "In [2] line 3" in finding.evidence

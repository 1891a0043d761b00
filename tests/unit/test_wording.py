"""What the report says in words, where real code showed it wrong: grouped tensors hide no count, a cell that freed
memory did not 'leave -36 KiB', a small copy is no finding and names the call that made it, an OOM report does not
claim the allocator was unmeasured, and the profiler's memory is never the user's."""

from __future__ import annotations

from tfmem_magic.advise import diagnose, diagnose_model, prediction
from tfmem_magic.core.errors import clip_message
from tfmem_magic.core.report import (
    DeviceMemory,
    EnvInfo,
    ErrorInfo,
    GuardInfo,
    InputCopy,
    LayerInfo,
    LiveGroup,
    ModelInfo,
    Report,
    RssInfo,
    TraceInfo,
)
from tfmem_magic.show.render import render_text, watch_line

MiB = 2**20


def report(**trace) -> Report:
    return Report(
        env=EnvInfo(
            tensorflow="2.21.0",
            allocator="bfc_cpu_allocator_for_gpu",
            allocator_complete=True,
            budget_bytes=8 * 1024 * MiB,
            ram_total_bytes=16 * 1024 * MiB,
        ),
        rss=RssInfo(1000 * MiB, 1100 * MiB, 1050 * MiB),
        tf={"CPU:0": DeviceMemory(10 * MiB, 14 * MiB, 10 * MiB - 36 * 1024)},
        trace=TraceInfo(
            events=10,
            peak_live_bytes=14 * MiB,
            allocated_at_peak_bytes=4 * MiB,
            requested_at_peak_bytes=4 * MiB,
            **trace,
        ),
    )


def test_grouped_tensors_show_their_count():
    rep = report(
        at_peak=[
            LiveGroup(
                op="split",
                layer="lstm_cell",
                phase="forward",
                bytes=16 * MiB,
                count=470,
                dtype="float32",
                shape="[256,32]",
            )
        ]
    )
    assert "lstm_cell · split (forward) float32[256,32] ×470" in render_text(rep, whatifs=[])


def test_a_cell_that_freed_memory_says_freed():
    assert "(freed 36 KiB)" in watch_line(report()) and "left -" not in watch_line(report())


def test_a_small_copy_is_no_finding_and_a_large_one_names_its_call():
    small = report(input_copies=[InputCopy(130 * 1024, 130 * 1024, 0.1, None, True)])
    assert diagnose.input_copy(small) is None  # 3% of the cell's memory at the peak
    large = report(
        input_copies=[
            InputCopy(2 * MiB, 2 * MiB, 0.1, None, True),
            InputCopy(MiB, MiB, 0.2, 0.3, False, role="validation"),
        ]
    )
    large.model = ModelInfo(name="m", calls=["predict"])
    finding = diagnose.input_copy(large)
    assert finding.title == "predict() copied the whole input arrays into tensors"
    assert "(training data 2 MiB and validation data 1 MiB)" in finding.evidence


def test_an_oom_report_says_the_cell_stopped_early_not_that_nothing_was_measured():
    rep = report()
    rep.status = "oom"
    rep.model = ModelInfo(
        name="m",
        batch_size=64,
        calls=["fit"],
        trainable_bytes=MiB,
        new_weight_bytes=MiB,
        layers=[LayerInfo("d", "Dense", 10, "(None, 1024)", 4096)],
    )
    notes = prediction.predict(rep, batch_size=32).notes
    assert any("stopped early (oom)" in n for n in notes)
    assert not any("was not measured" in n for n in notes)


def test_the_profilers_memory_is_not_the_users():
    rep = report(profiler_bytes=10 * MiB, profiler_rss_bytes=400 * MiB)
    rep.rss = RssInfo(1000 * MiB, 1500 * MiB, 1400 * MiB)  # +500 MiB, of which TF 4 MiB and the profiler 400 MiB
    assert diagnose_model.non_tf_growth(rep) is None
    rep.trace.profiler_rss_bytes = 0
    assert diagnose_model.non_tf_growth(rep) is not None
    assert "tfmem's profiler recorded 10 MiB" in render_text(
        report(profiler_bytes=10 * MiB, profiler_rss_bytes=300 * MiB), whatifs=[]
    )


def test_every_budget_is_named_the_way_a_sentence_needs():
    """'over the your limit' was a verdict once: each budget source reads right in every verdict."""
    from tfmem_magic.core.report import EnvInfo, Report, RssInfo
    from tfmem_magic.show.view import verdict

    for source, over, used in (
        ("user", "over your limit by 1 GiB", "used 95% of your limit"),
        ("cgroup", "over the container limit by 1 GiB", "used 95% of the container limit"),
        ("ram", "over the available RAM by 1 GiB", "used 95% of the available RAM"),
    ):
        report = Report(
            status="ok",
            env=EnvInfo(budget_bytes=10 * 2**30, budget_source=source),
            rss=RssInfo(baseline_bytes=0, peak_bytes=11 * 2**30),
        )
        assert verdict(report) == over
        report.rss.peak_bytes = int(9.5 * 2**30)
        assert verdict(report) == used
        report.rss.peak_bytes = 2**30
        assert verdict(report).startswith("fits with 9 GiB to spare (")


def test_a_long_error_is_cut_after_its_last_whole_sentence_or_at_a_word_with_an_ellipsis():
    refusal = (
        "tfmem's pre-flight stopped fit() before its first step: at batch 1024 the process would reach ~3.76 "
        "GiB (-20%/+40%: it holds 781 MiB now, the step needs ~2.98 GiB, plus 96 MiB the call adds (its copy "
        "of numpy arrays)), and --limit allows 2.23 GiB. Nothing of the call ran. Lower the batch size to 312 "
        "(the largest whose upper estimate fits), or run %tfmem fix shrink-batch for a ready cell. (a clone's "
        "steps traced at batches 71 and 117 and replayed at batch 1024 through a simulation of TensorFlow's "
        "allocator, 8.1 s; --no-preflight skips it.)\nsecond line"
    )
    assert clip_message(refusal, 600) == refusal.splitlines()[0]  # 544 characters: the whole refusal
    within = refusal.index(" Lower the batch") + 40  # the next sentence does not fit
    assert clip_message(refusal, within).endswith("--limit allows 2.23 GiB. Nothing of the call ran.")
    cut = clip_message(refusal, 200)  # no sentence ends past half of it: at a word, with an ellipsis
    assert cut.endswith("(its copy…") and len(cut) <= 201
    # "e.g." ends no sentence (the guard's own messages use it)
    cut = clip_message("Set a limit, e.g. 2GB, and run it again: " + "x " * 40, 60)
    assert cut.startswith("Set a limit, e.g. 2GB, and run it again: x") and cut.endswith("x…")
    rep = report()
    rep.status = "oom"
    rep.error = ErrorInfo(type="PreflightRefused", message=refusal)
    oom = diagnose.out_of_memory(rep)
    assert oom.evidence == refusal.splitlines()[0] + " The kernel and your variables are intact."
    # a refusal that says more (the lines at its replay's peak, the batch a restart would let it name) keeps it
    longer = refusal.replace(
        "for a ready cell.",
        "for a ready cell. TensorFlow's allocator holds 283 MiB of regions from earlier steps beyond what it uses "
        "now, and the batch named does not count on them (which of the step's tensors they could hold is not "
        "known); a kernel restart gives them back, and then about 440 would be judged to fit, as this call was "
        "judged.",
    )
    rep.status, rep.error = "refused", ErrorInfo(type="PreflightRefused", message=longer)
    assert "then about 440 would be judged to fit" in diagnose.out_of_memory(rep).evidence


def test_a_step_that_ran_on_past_the_guard_says_how_far():
    rep = report()
    rep.status = "oom"
    limit = 2294 * MiB  # a custom loop's step at batch 1024: the watchdog saw the limit passed, the step ran on
    rep.guard = GuardInfo(
        limit, "--limit", ["batch-end check", "watchdog"], tripped_by="watchdog", tripped_rss_bytes=limit + MiB
    )
    rep.rss = RssInfo(791 * MiB, 4082 * MiB, 4000 * MiB)
    evidence = diagnose.out_of_memory(rep).evidence
    assert "went on to 3.99 GiB (78% over the limit) before it could be stopped" in evidence, evidence
    # the batch-end check runs after the step: the step had been that high inside it, not after
    rep.guard.tripped_by = "batch-end check"
    evidence = diagnose.out_of_memory(rep).evidence
    assert "Inside the last step the process had reached 3.99 GiB (78% over the limit)" in evidence, evidence
    assert "went on to" not in evidence
    rep.rss = RssInfo(791 * MiB, limit + 2 * MiB, limit)  # stopped where it passed: nothing more to say
    assert "the process had reached" not in diagnose.out_of_memory(rep).evidence

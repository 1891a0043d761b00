"""Fix cells written from reports: right code for the situation, honest about what they change, never offering a
knob that does nothing here."""

from __future__ import annotations

import ast

from tfmem_magic.advise import fixes
from tfmem_magic.core.report import (
    DeviceMemory,
    EnvInfo,
    Finding,
    LayerInfo,
    ModelInfo,
    PreflightInfo,
    Report,
    RssInfo,
    TraceInfo,
)

MiB = 2**20
CELL = (
    "model = build()\nmodel.compile('adam', 'mse')  # adam\n"
    "model.fit(x_train, y_train, batch_size=256, epochs=3)  # was batch_size=512\n"
)


def report(devices=("CPU:0",), status="ok", findings=("large-batch",), policy="float32", batch=256) -> Report:
    layers = [
        LayerInfo("conv", "Conv2D", 896, "(None, 30, 30, 32)", 30 * 30 * 32 * 4),
        LayerInfo("flat", "Flatten", 0, "(None, 28800)", 28800 * 4),
        LayerInfo("head", "Dense", 288010, "(None, 10)", 40),
    ]
    model = ModelInfo(
        name="m",
        params=288906,
        trainable_params=288906,
        param_bytes=288906 * 4,
        optimizer="Adam",
        optimizer_slots=2,
        optimizer_bytes=2 * 288906 * 4,
        batch_size=batch,
        input_shape="(512, 32, 32, 3)",
        dtype_policy=policy,
        calls=["fit"],
        layers=layers,
        trainable_bytes=288906 * 4,
        samples=512,
        input_array_bytes=512 * 32 * 32 * 3 * 4 + 512 * 40,
        new_weight_bytes=288906 * 4,
        optimizer_built_in_cell=True,
    )
    rep = Report(
        status=status,
        env=EnvInfo(
            tensorflow="2.21.0",
            allocator="bfc_cpu_allocator_for_gpu",
            allocator_complete=True,
            devices=list(devices),
            budget_bytes=500 * MiB,
            ram_total_bytes=24 * 1024 * MiB,
        ),
        rss=RssInfo(baseline_bytes=400 * MiB, peak_bytes=560 * MiB, end_bytes=540 * MiB),
        tf={"CPU:0": DeviceMemory(0, 120 * MiB, 20 * MiB)},
        model=model,
        number=7,
    )
    links = {
        "large-batch": ["shrink-batch", "grad-accumulation", "mixed-precision"],
        "large-model": ["freeze-layers", "lighter-optimizer"],
        "input-copy": ["tf-data-streaming"],
    }
    rep.findings = [Finding(f, f, "warn", "evidence", fixes=list(links.get(f, []))) for f in findings]
    return rep


def ctx(source=CELL) -> fixes.Context:
    return fixes.FixContext(source=source, model_name="model", array_names=("x_train", "y_train"), number=7)


def by_id(found):
    return {f.id: f for f in found}


def body(code: str) -> str:
    return code.split("\n", 1)[1] if code.startswith("%%tfmem") else code


def test_shrink_batch_rewrites_only_the_literal_and_links_before_after():
    found = by_id(fixes.build(report(), ctx()))
    fix = found["shrink-batch"]
    header, rest = fix.code.split("\n", 1)
    assert header == '%%tfmem --before 7 --fix shrink-batch --label "fix: shrink-batch"'
    new = int(rest.split("batch_size=")[1].split(",")[0])
    assert 1 <= new < 256 and rest == CELL.replace("batch_size=256", f"batch_size={new}")
    assert "# was batch_size=512" in rest  # the comment is untouched
    assert fix.predicted_peak_bytes < 120 * MiB and f"Batch 256 → {new}" in fix.why and not fix.needs_restart
    assert fix.placement == "below"


def test_shrink_batch_says_so_when_the_batch_is_not_in_the_cell():
    fix = by_id(fixes.build(report(), ctx("model.fit(x_train, y_train, batch_size=BS)\n")))["shrink-batch"]
    assert fix.code.startswith("# the batch size comes from `BS`") and "set BS = " in fix.why


def test_grad_accumulation_recompiles_after_the_cells_compile_and_keeps_the_effective_batch():
    fix = by_id(fixes.build(report(), ctx()))["grad-accumulation"]
    code = body(fix.code)
    ast.parse(code)
    lines = code.splitlines()
    compile_at = next(i for i, line in enumerate(lines) if line.startswith("model.compile("))
    assert lines[compile_at + 2] == "config = model.get_compile_config()  # your loss and metrics, as compiled"
    assert 'config["optimizer"]["config"]["gradient_accumulation_steps"] = 4' in lines
    assert "batch_size=64" in lines[-1] and "effective batch of 256" in code


def test_mixed_precision_is_bfloat16_on_cpu_and_float16_only_with_a_gpu():
    cpu = by_id(fixes.build(report(), ctx()))["mixed-precision"]
    assert 'set_global_policy("mixed_bfloat16")' in cpu.code and 'mixed_float16")' not in cpu.code
    assert body(cpu.code).index("set_global_policy") < body(cpu.code).index("model = build()")  # before building
    gpu = by_id(fixes.build(report(devices=("CPU:0", "GPU:0")), ctx()))["mixed-precision"]
    assert 'set_global_policy("mixed_float16")' in gpu.code
    already = by_id(fixes.build(report(policy="mixed_bfloat16"), ctx()))
    assert "mixed-precision" not in already


def test_gpu_only_fixes_are_never_offered_on_cpu():
    cpu = by_id(fixes.build(report(status="oom", findings=("oom", "large-batch")), ctx()))
    assert not {"memory-growth", "gpu-memory-limit"} & set(cpu)
    limit = cpu["cpu-memory-limit"]
    assert limit.needs_restart and limit.placement == "top" and "%tfmem limit " in limit.code
    assert "TF_MEMORY_ALLOCATION" not in limit.code + limit.why
    gpu = by_id(fixes.build(report(devices=("CPU:0", "GPU:0"), status="oom", findings=("oom",)), ctx()))
    assert {"memory-growth", "gpu-memory-limit"} <= set(gpu) and "cpu-memory-limit" not in gpu
    assert "set_memory_growth(gpu, True)" in gpu["memory-growth"].code and gpu["memory-growth"].needs_restart


def test_lighter_optimizer_and_freeze_layers_for_a_large_model():
    found = by_id(fixes.build(report(findings=("large-model",)), ctx()))
    light = found["lighter-optimizer"]
    assert "keras.optimizers.SGD(learning_rate=0.01, momentum=0.9)" in light.code
    ast.parse(body(light.code))
    assert light.predicted_peak_bytes < 120 * MiB  # one slot fewer
    freeze = found["freeze-layers"]
    assert "layer.trainable = False" in freeze.code and "conv" in freeze.why


def test_tf_data_streaming_uses_the_users_array_names_and_does_not_copy_them():
    fix = by_id(fixes.build(report(findings=("input-copy",)), ctx()))["tf-data-streaming"]
    code = body(fix.code)
    ast.parse(code)
    assert "from_generator" in code and "from_tensor_slices" not in code  # from_tensor_slices copies the array
    assert "x_train[i:i + 256], y_train[i:i + 256]" in code and "model.fit(dataset" in code


def test_a_report_without_findings_gets_no_fixes():
    assert fixes.build(report(findings=()), ctx()) == []


def test_before_after_checks_the_prediction():
    before = report()
    before.fixes = fixes.build(before, ctx())
    from tfmem_magic.core.report import Prediction

    before.prediction = Prediction("analytic", 0, 0, 1.0, 0.3)
    predicted = before.fixes[0].predicted_peak_bytes
    after = report(batch=64)
    after.tf = {"CPU:0": DeviceMemory(0, int(predicted * 1.1), 0)}
    ba = fixes.before_after(before, after, "shrink-batch")
    assert ba.held and ba.predicted_peak_bytes == predicted and ba.number == 7
    after.tf = {"CPU:0": DeviceMemory(0, int(predicted * 1.5), 0)}
    assert fixes.before_after(before, after, "shrink-batch").held is False


def test_a_fix_cell_run_after_another_fix_is_not_judged_against_a_kernel_it_no_longer_is():
    """Fix cells of one report tried one after another: the first one's model and optimizer slots stay in the
    kernel, so the second's prediction (for the kernel as it was) is compared, not judged, and the report says why.
    Run alone, or run again, a fix is judged."""
    from tfmem_magic.core.report import BeforeAfter, Prediction
    from tfmem_magic.show.render import before_after_rows

    before = report()
    before.fixes = fixes.build(before, ctx())
    before.prediction = Prediction("analytic", 0, 0, 1.0, 0.3)
    predicted = before.fixes[0].predicted_peak_bytes
    other = report(batch=256)
    other.number, other.before = before.number + 1, BeforeAfter(before.number, "", "ok", 0, 0, 0.0, "mixed-precision")
    after = report(batch=64)
    after.number = before.number + 2
    after.tf = {"CPU:0": DeviceMemory(40 * 2**20, 40 * 2**20 + int(predicted * 0.6), 40 * 2**20)}
    assert fixes.before_after(before, after, "shrink-batch").held is False  # alone: judged (and missed)
    ba = fixes.before_after(before, after, "shrink-batch", since=[before, other, after])
    assert ba.held is None and "the kernel changed since report 7: fix mixed-precision (report 8)" in ba.kernel_changed
    same = report(batch=64)
    same.number, same.before = before.number + 1, BeforeAfter(before.number, "", "ok", 0, 0, 0.0, "shrink-batch")
    assert fixes.before_after(before, after, "shrink-batch", since=[same]).kernel_changed is None  # a rerun of it
    after.before = ba
    rows = dict((k, (x, y)) for k, x, y in before_after_rows(after))
    assert rows[next(k for k in rows if k.startswith("prediction"))][1].endswith("not judged: the kernel changed")


def test_tf_data_streaming_follows_the_call_and_the_arrays_it_had():
    """fit(x) without targets (an autoencoder, a VAE) and a predict cell: no `y` out of nowhere, and a predict cell's
    fix predicts instead of training the model."""
    rep = report(findings=("input-copy",))
    rep.model.feed = "arrays"
    only_x = fixes.FixContext(source=CELL, model_name="vae", array_names={"x": "digits"}, number=7)
    code = body(by_id(fixes.build(rep, only_x))["tf-data-streaming"].code)
    ast.parse(code)
    assert "yield digits[i:i + 256]\n" in code and " y" not in code.replace("yield", "") and "vae.fit(dataset" in code
    rep.model.calls = ["predict"]
    fix = by_id(fixes.build(rep, only_x))["tf-data-streaming"]
    assert "vae.predict(dataset" in fix.code and ".fit(" not in fix.code and fix.title.endswith("predict(numpy)")
    # an array passed as an expression: the cell says which name to fill in, instead of claiming no name was given
    expression = fixes.FixContext(source=CELL, model_name="model", array_names={"x": "images", "y": ""}, number=7)
    rep.model.calls = ["fit"]
    code = body(by_id(fixes.build(rep, expression))["tf-data-streaming"].code)
    assert "# y: your y array (the cell passed it as an expression, not a variable)" in code
    assert "images[i:i + 256], y[i:i + 256]" in code
    # several arrays in one role (a dict of inputs): written from the call's own arguments, as the cell wrote them;
    # not offered rather than wrong when the cell's source does not show the call
    several = fixes.FixContext(source=CELL, model_name="model", array_names={"x": None, "y": "labels"}, number=7)
    code = by_id(fixes.build(rep, several))["tf-data-streaming"].code
    assert "data = as_tuples((x_train, y_train))" in code and "model.fit(dataset, epochs=1)" in code
    unseen = fixes.FixContext(source=None, model_name="model", array_names={"x": None, "y": "labels"}, number=7)
    assert "tf-data-streaming" not in by_id(fixes.build(rep, unseen))
    # a pipeline is not numpy: nothing to stream
    rep.model.feed = "dataset"
    assert "tf-data-streaming" not in by_id(fixes.build(rep, only_x))


def test_a_fix_that_saves_nothing_at_the_peak_says_so():
    r = report()
    peak = r.tf_peak_bytes
    assert "saves nothing at this cell's peak" in fixes._saving(r, peak + 1000)
    assert "(saves " in fixes._saving(r, peak // 2)


def _calibrating(rep: Report, context, monkeypatch):
    """`rep` remembered as a profiled cell's report is (its live model, the context its fixes were written from),
    and the probe process that calibration runs replaced by what it would measure: twice the per-sample bytes the
    model's shapes gave (the probes are TensorFlow runs: tests/integration). Returns the model stand-in (the report
    holds it weakly)."""
    from tfmem_magic.advise import calibration, prediction, probe_runs

    class Model:
        pass

    model = Model()
    rep.whatif_basis = prediction.analytic_basis(rep)
    rep.prediction = prediction.summary(rep)
    rep.fixes = fixes.build(rep, context)
    calibration.remember_model(rep, model, None, context)
    per_sample = 2 * (rep.whatif_basis.activations_per_sample + rep.whatif_basis.input_per_sample)
    peaks = {
        b: (round(1.1 * (20 * MiB + b * per_sample)), round(20 * MiB + b * per_sample))
        for b in calibration.probe_batches(rep, rep.whatif_basis)
    }
    monkeypatch.setattr(probe_runs, "probe_peaks", lambda *args, **kwargs: peaks)
    return model


def _batch(fix) -> int:
    return int(body(fix.code).split("batch_size=")[1].split(",")[0])


def test_a_calibration_writes_the_fixes_again_on_its_basis(monkeypatch):
    from tfmem_magic.advise import calibration, diagnose_model, prediction

    rep = report()
    model = _calibrating(rep, ctx(), monkeypatch)
    rep.findings = [diagnose_model.large_batch(rep), *rep.findings[1:]]  # the rule's own finding, as a cell gets it
    analytic = by_id(rep.fixes)["shrink-batch"]
    assert "analytic basis" in analytic.why
    assert f"(with a 30% margin, analytic basis) is {_batch(analytic)}." in rep.findings[0].evidence
    calibration.measured_basis(rep, replay=False)
    measured = by_id(rep.fixes)["shrink-batch"]
    new = _batch(measured)
    # the measured basis, its band spanning the analytic one's high end below the cell's batch where that is higher
    # (prediction.judged_band): here the analytic basis decides, and names the same batch
    assert new == prediction.predict(rep).largest_batch
    assert "measured basis" in measured.why and f"Batch 256 → {new}" in measured.why
    assert measured.predicted_peak_bytes == prediction.predict(rep, batch_size=new).peak_bytes
    # the finding says the same batch as the fix, on the same basis, with the margin that batch was judged with
    (finding,) = [f for f in rep.findings if f.id == "large-batch"]
    margin = prediction.predict(rep, batch_size=new, tf_budget=prediction.budget_for_tf(rep)).fit_margin
    assert margin > prediction.predict(rep).error_band  # wider than the measured basis' own ±10%
    assert f"(with a {margin:.0%} margin, measured basis) is {new}." in finding.evidence
    assert model is not None


def test_the_panels_calibrate_button_shows_the_fixes_written_again(monkeypatch):
    import ipywidgets as widgets

    from tfmem_magic.advise import calibration, diagnose_model
    from tfmem_magic.show.panel import build_panel

    rep = report()
    model = _calibrating(rep, ctx(), monkeypatch)
    monkeypatch.setattr(
        calibration,
        "measured_basis",  # the panel's call, without the step replay's probes
        lambda r, progress=None, real=calibration.measured_basis: real(r, progress, replay=False),
    )

    def shown(widget):  # the HTML of every widget under `widget`
        if isinstance(widget, widgets.HTML):
            return widget.value
        return "".join(shown(c) for c in getattr(widget, "children", ()))

    def button(widget):
        if isinstance(widget, widgets.Button) and widget.description.startswith("Calibrate"):
            return widget
        return next((b for c in getattr(widget, "children", ()) if (b := button(c)) is not None), None)

    rep.findings = [diagnose_model.large_batch(rep)]
    panel = build_panel(rep, timeline=b"")
    tabs = next(w for w in panel.children if isinstance(w, widgets.Tab))
    assert "analytic basis" in shown(tabs.children[4]) and "analytic basis" in shown(tabs.children[2])
    button(tabs.children[3]).click()
    assert "measured basis" in shown(tabs.children[4]) and "analytic basis" not in shown(tabs.children[4])
    assert "measured basis" in shown(tabs.children[2]) and "analytic basis" not in shown(tabs.children[2])
    assert tabs.titles[4] == f"Fixes ({len(rep.fixes)})"
    assert model is not None


def _with_fixes(rep: Report) -> Report:
    from tfmem_magic.advise import prediction

    rep.whatif_basis = prediction.analytic_basis(rep)
    rep.fixes = fixes.build(rep, ctx())
    return rep


def test_auto_calibration_runs_where_the_report_names_the_largest_batch_that_fits(monkeypatch):
    # %tfmem calibrate auto (the default): a report that names a smaller batch calibrates, so that batch stands on
    # the step replay; a report without that fix never starts a probe process
    import psutil

    from tfmem_magic.advise import calibration

    class Memory:
        available = 16 * 1024 * MiB

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Memory)
    shrinking = _with_fixes(report())
    assert "shrink-batch" in by_id(shrinking.fixes)
    assert calibration.auto_calibration(shrinking) == (True, calibration.AUTO_REASON)
    finding_only = _with_fixes(report())  # the large-batch finding names the largest batch too, with no fix
    finding_only.fixes = [f for f in finding_only.fixes if f.id != "shrink-batch"]
    assert calibration.auto_calibration(finding_only) == (True, calibration.AUTO_REASON)
    quiet = _with_fixes(report(findings=("large-model",)))
    assert quiet.fixes and "shrink-batch" not in by_id(quiet.fixes)
    assert calibration.auto_calibration(quiet) is None
    failed = _with_fixes(report(status="oom"))
    assert "shrink-batch" in by_id(failed.fixes)
    assert calibration.auto_calibration(failed) is None  # no measured peak to anchor the replay on
    Memory.available = 1024 * MiB  # a probe process (~768 MiB of TensorFlow, plus the step) would not fit in half
    go, why = calibration.auto_calibration(shrinking)
    assert not go and "a probe process needs" in why and "has 1 GiB available" in why


def test_the_pipeline_calibrates_as_its_mode_says(monkeypatch):
    from tfmem_magic import pipeline
    from tfmem_magic.advise import calibration
    from tfmem_magic.core.session import SESSION

    asked = []
    monkeypatch.setattr(
        calibration, "auto_calibration", lambda rep: (True, calibration.AUTO_REASON) if rep.fixes else None
    )
    monkeypatch.setattr(calibration, "measured_basis", lambda rep: asked.append(rep.number) or rep.whatif_basis)
    monkeypatch.setattr(SESSION, "calibrate", "auto")
    shrinking, quiet = _with_fixes(report()), _with_fixes(report(findings=()))
    quiet.number = 8
    for rep, options in ((shrinking, {}), (quiet, {}), (shrinking, {"calibrate": False}), (quiet, {"calibrate": True})):
        pipeline.Profiler(pipeline.Options(**options))._calibrate(rep)
    assert asked == [7, 8]  # auto: the shrinking report only; --no-calibrate skips it; --calibrate runs any
    assert any(
        n.startswith(
            "Calibrated as the cell ended (auto: the report names the largest batch that fits; "
            "%tfmem calibrate off or calibrate=False skips it"
        )
        for n in shrinking.notes
    ), shrinking.notes
    monkeypatch.setattr(SESSION, "calibrate", "off")
    pipeline.Profiler()._calibrate(shrinking)
    monkeypatch.setattr(SESSION, "calibrate", "on")
    pipeline.Profiler()._calibrate(quiet)
    assert asked == [7, 8, 8]


def test_the_budget_for_tensorflow_leaves_out_what_the_process_grew_by_besides_it():
    # a --limit counts the process: NumPy arrays, traced graphs and oneDNN's scratch (31-46 MiB on three fits here)
    # grow it besides TensorFlow's allocator, and a run at another batch needs them again
    from tfmem_magic.advise import bands, prediction

    rep = report()  # RSS 400 -> 560 MiB, TF 0 -> 120 MiB: 40 MiB outside TF's allocator
    assert prediction.outside_tf_bytes(rep) == 40 * MiB
    assert prediction.budget_for_tf(rep) == (500 - 400 - 40) * MiB
    assert prediction.tf_budget_within(rep, 700 * MiB) == (700 - 400 - 40) * MiB
    what = prediction.predict(rep, batch_size=64)
    assert what.budget_bytes == 60 * MiB and any("40 MiB this cell's process grew by" in n for n in what.notes)
    # a peak above the cell's is judged with +40% (the process can grow by more than the allocator's bytes in use);
    # at or below the cell's peak, the band alone (that moment was measured)
    above = prediction.predict(rep, batch_size=512, tf_budget=10 * 1024 * MiB)
    at_cell = prediction.predict(rep, tf_budget=10 * 1024 * MiB)
    below = prediction.predict(rep, batch_size=64, tf_budget=10 * 1024 * MiB)
    assert above.peak_bytes > at_cell.peak_bytes and above.fit_margin == bands.PROCESS_MARGIN
    assert any("judged with +40%" in n for n in above.notes)
    assert at_cell.fit_margin == below.fit_margin == at_cell.error_band
    assert not any("judged with" in n for n in below.notes)
    # accumulation: batch 1024 in steps of 128 runs a smaller step than the cell's: no margin, no regions note
    micro = prediction.predict(rep, batch_size=1024, accumulation_steps=8, tf_budget=10 * 1024 * MiB)
    assert not any("From where the cell started" in n for n in micro.notes)
    from tfmem_magic.show import render

    assert render.fits_words(above) == "fits at +40%" and render.fits_words(below) == "fits"
    # tfmem's own profiler: its memory is not the user's, but its estimate is an upper one, so a budget takes off only
    # part of it (a traced GRU's estimate was 117 MiB where the profiler held about 84: docs/what-if.md)
    rep.trace = TraceInfo(profiler_rss_bytes=30 * MiB)
    assert prediction.grown_outside_tf(rep) == 10 * MiB  # the findings' view: the whole estimate is tfmem's
    assert prediction.outside_tf_bytes(rep) == 25 * MiB  # the budget's: half of it
    rep.rss.peak_bytes = 450 * MiB  # TF reused regions the process held already: nothing outside it to leave out
    assert prediction.outside_tf_bytes(rep) == 0 and prediction.budget_for_tf(rep) == 100 * MiB
    gpu = report(devices=("CPU:0", "GPU:0"))  # a GPU's budget is its own allocator's
    gpu.tf = {"GPU:0": DeviceMemory(0, 120 * MiB, 20 * MiB)}
    assert gpu.on_gpu and prediction.outside_tf_bytes(gpu) == 0


def test_a_cell_that_ran_out_is_never_told_that_its_batch_or_a_larger_one_fits():
    from tfmem_magic.advise import diagnose_model

    rep = report(status="oom", batch=256)
    rep.env.budget_bytes = 4096 * MiB  # the what-if says batch 256 fits with room: the run said otherwise
    finding = diagnose_model.large_batch(rep)
    fix = by_id(fixes.build(rep, ctx()))["shrink-batch"]
    assert "The batch to try is 128, half the batch" in finding.evidence, finding.evidence
    # the run stopped before its peak: the share is of the model's estimate, not of what the cell reached
    assert "of the step's estimated peak (" in finding.evidence and "of the cell's peak" not in finding.evidence
    assert fix.title == "Shrink the batch to 128"
    # the pre-flight let the call run (its prediction was within its band) and the guard stopped it: the largest
    # batch the pre-flight found for the process is the one to name, in the finding and the fix alike
    rep.preflight = PreflightInfo(
        call="fit", batch_size=256, verdict="uncertain", largest_batch=192, band=0.4, threshold_bytes=737 * MiB
    )
    finding = diagnose_model.large_batch(rep)
    fix = by_id(fixes.build(rep, ctx()))["shrink-batch"]
    assert "The batch to try is 192, the largest batch whose pre-flight prediction (+40%)" in finding.evidence
    assert fix.title == "Shrink the batch to 192" and "pre-flight prediction (+40%)" in fix.why
    rep.status = "ok"  # it ran: the pre-flight's answer is not needed, and no shrink where the batch fits
    assert "shrink-batch" not in by_id(fixes.build(rep, ctx()))


def test_the_cudnn_workspace_cap_is_never_offered_on_cpu():
    """TF_CUDNN_WORKSPACE_LIMIT_IN_MB does nothing without a GPU: its writer gives no cell for a CPU report, even one
    whose trace had a workspace group (a report loaded from elsewhere)."""
    from tfmem_magic.core.report import LiveGroup

    rep = report(findings=("cudnn-workspace",))
    rep.trace = TraceInfo(at_peak=[LiveGroup("Conv2DBackpropFilter", "conv", "workspace", 64 * MiB, 64 * MiB, 1)])
    assert fixes.WRITERS["cudnn-workspace-limit"](rep, ctx()) is None

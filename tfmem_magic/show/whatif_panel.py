"""The what-if tab of the panel: sliders and dropdowns that re-predict the cell's peak as they move (no re-run),
and a button that calibrates the prediction with probe runs of a clone. Every number comes from `predict`."""

from __future__ import annotations

from collections.abc import Callable
from html import escape

import ipywidgets as widgets

from tfmem_magic.advise import bases, calibration, prediction
from tfmem_magic.core.errors import TfmemUsageError
from tfmem_magic.core.report import Report
from tfmem_magic.core.sizes import format_bytes
from tfmem_magic.show.render import SPLIT_COLORS, band_text, fits_words, split_bar, whatif_html, whatif_summary
from tfmem_magic.show.view import ReportView, view_of

OPTIMIZER_CHOICES = [
    ("Adam / AdamW (2 slots)", "adam"),
    ("SGD with momentum (1 slot)", "sgd+momentum"),
    ("RMSprop (1 slot)", "rmsprop"),
    ("Adafactor (factored, ~1 slot)", "adafactor"),
    ("SGD (no slots)", "sgd"),
]


def _policies(report: Report, current: str) -> list[tuple[str, str]]:
    gpu = any("GPU" in d for d in report.env.devices)
    choices = [("float32", "float32"), ("mixed_bfloat16 (activations in 16 bits)", "mixed_bfloat16")]
    if gpu or current == "mixed_float16":  # 74-260x slower on CPU: never offered there
        choices.append(("mixed_float16 (GPU)", "mixed_float16"))
    return choices


def whatif_tab(
    report: Report, view: ReportView | None = None, on_calibrated: Callable[[], None] | None = None
) -> widgets.Widget:
    view = view or view_of(report)
    base = view.base
    if base is not None and report.model is None and view.whatifs:  # a saved trace's: the batch is its only knob
        return widgets.HTML(whatif_html(report, view.whatifs))
    if base is None or report.model is None:
        return widgets.HTML(f"<div class='tfmem-empty'>{escape(view.base_problem or '')}</div>")
    knobs = base.knobs
    batch = knobs.batch_size
    fit = base.largest_batch or 0
    refused = bases.anchored_on_preflight(report.whatif_basis)
    top = max(1024, 8 * batch, int(fit * 1.25) if fit <= 64 * batch else 0)  # the slider stays usable
    style = {"description_width": "130px"}
    wide = widgets.Layout(width="480px")
    batch_w = widgets.IntSlider(
        value=batch, min=1, max=top, description="Batch size", style=style, layout=wide, continuous_update=True
    )
    policy_w = widgets.Dropdown(
        options=_policies(report, knobs.policy), value=knobs.policy, description="Precision", style=style, layout=wide
    )
    optimizers = list(OPTIMIZER_CHOICES)
    if knobs.optimizer and knobs.optimizer not in [v for _, v in optimizers]:
        optimizers.insert(0, (knobs.optimizer, knobs.optimizer))
    optimizer_w = widgets.Dropdown(
        options=optimizers,
        value=knobs.optimizer or "adam",
        description="Optimizer",
        style=style,
        layout=wide,
        disabled=not report.model.training,
    )
    accumulation_w = widgets.IntSlider(
        value=1,
        min=1,
        max=16,
        description="Accumulation steps",
        style=style,
        layout=wide,
        disabled=not report.model.training,
    )
    scale_w = widgets.FloatLogSlider(
        value=1.0, base=2, min=-2, max=2, step=0.25, description="Input size ×", style=style, layout=wide
    )
    replicas_w = widgets.IntSlider(
        value=knobs.replicas,
        min=1,
        max=max(16, knobs.replicas),
        description="Replicas",
        style=style,
        layout=wide,
        tooltip="data-parallel GPUs or workers sharing the batch (tf.distribute): the prediction is one replica's",
    )
    result = widgets.HTML()
    calibrate_w = widgets.Button(
        description="Calibrate (probe runs)",
        icon="flask",
        tooltip="Train a clone of the model in fresh processes: three batch sizes, then two "
        "traced steps replayed through a simulation of TensorFlow's allocator (~15 s "
        "for a small model, minutes for a large one): ±10-15% instead of ±30%. A "
        "model with a train_step or loop of its own: the step the cell ran, saved "
        "and replayed (±30%). The fixes are written again on the result",
        layout=widgets.Layout(width="240px"),
    )
    progress = widgets.IntProgress(value=0, min=0, max=100, layout=widgets.Layout(width="200px", visibility="hidden"))

    def show(_: object = None) -> None:  # a slider's change, or None
        try:
            w = prediction.predict(
                report,
                batch_size=batch_w.value,
                policy=policy_w.value,
                optimizer=(optimizer_w.value if report.model is not None and report.model.training else None),
                accumulation_steps=min(accumulation_w.value, batch_w.value),
                input_scale=scale_w.value,
                replicas=replicas_w.value,
            )
        except TfmemUsageError as exc:
            result.value = f"<div class='tfmem-sev-warn'>{escape(str(exc))}</div>"
            return
        result.value = whatif_result_html(w, base, "as asked" if refused else "as run")

    def calibrate(_: object) -> None:  # the button
        calibrate_w.disabled = True
        progress.layout.visibility = "visible"

        def step(text: str, done: float) -> None:
            progress.value = int(done * 100)
            progress.description = text[:20]

        try:
            calibration.calibrate_asked(report, progress=step)
            calibrate_w.description = "Calibrated"
        except TfmemUsageError as exc:
            result.value = f"<div class='tfmem-sev-warn'>{escape(str(exc))}</div>"
            calibrate_w.disabled = False
            return
        finally:
            progress.layout.visibility = "hidden"
        show()
        if on_calibrated is not None:  # the panel shows the fixes written again on the measured basis
            on_calibrated()

    for control in (batch_w, policy_w, optimizer_w, accumulation_w, scale_w, replicas_w):
        control.observe(show, names="value")
    calibrate_w.on_click(calibrate)
    if view.calibrated:  # a refused call's basis is its pre-flight's probes, replayed: no other probes to run
        calibrate_w.description = "On the pre-flight's replay" if refused else "Calibrated"
        calibrate_w.disabled = True
    show()
    anchor = (
        "on what the pre-flight predicted for the batch it refused (nothing of it ran)"
        if refused
        else "on this cell's measured peak"
    )
    note = widgets.HTML(
        "<div class='tfmem-empty'>Batch size is the batch the model learns from; with accumulation "
        "steps k each step runs batch/k samples; with n replicas (tf.distribute over n GPUs or "
        f"workers) it is the global batch and the peak is one replica's. The prediction is anchored "
        f"{anchor} and moves only the parts a knob changes.</div>"
    )
    controls = widgets.VBox(
        [batch_w, policy_w, optimizer_w, accumulation_w, scale_w, replicas_w, widgets.HBox([calibrate_w, progress])]
    )
    box = widgets.VBox([controls, result, note])
    box.add_class("tfmem-whatif")
    return box


def whatif_result_html(w: prediction.WhatIf, base: prediction.WhatIf, asked: str = "as run") -> str:
    scale = max(w.peak_bytes, base.peak_bytes)
    far = w.budget_bytes is not None and w.budget_bytes > 4 * scale  # a budget line at 1% of the bar says nothing
    scale = scale if far or not w.budget_bytes else max(scale, w.budget_bytes)
    delta = w.peak_bytes - base.peak_bytes
    change = "" if delta == 0 else f" ({'+' if delta > 0 else '−'}{format_bytes(abs(delta))} vs. {asked})"
    verdict = (
        ""
        if w.fits is None
        else (
            f"<b class='tfmem-ok' style='color:#2e7d32'>{fits_words(w)}</b>"
            if w.fits
            else f"<b class='tfmem-sev-critical'>{fits_words(w, 'does not fit')}</b>"
        )
    )
    parts = "".join(
        f"<tr><td><span style='color:{SPLIT_COLORS[k]}'>■</span> {k}</td>"
        f"<td class='num'>{escape(format_bytes(max(0, v)))}</td></tr>"
        for k, v in w.split.items()
    )
    budget = ""
    if w.budget_bytes and not far:
        budget = (
            f"<div style='position:relative;height:0'><div title='budget' style='position:absolute;left:"
            f"{100 * w.budget_bytes / max(scale, 1):.2f}%;top:-12px;height:14px;border-left:2px dashed "
            "#c62828'></div></div>"
        )
    notes = "".join(f"<div class='tfmem-empty'>{escape(n)}</div>" for n in w.notes)
    return (
        f"<div style='margin:6px 0'><span style='font-size:18px;font-weight:600'>"
        f"{escape(format_bytes(w.peak_bytes))}</span> {band_text(w)}{escape(change)} {verdict}</div>"
        f"{split_bar(w, scale)}{budget}<div style='margin-top:6px'>{escape(whatif_summary(w))}</div>"
        f"<table>{parts}<tr><td>× fragmentation</td><td class='num'>{w.fragmentation_ratio:.2f}</td></tr>"
        f"</table>{notes}"
    )

"""Fix cells: for each cause a finding names, a ready code cell that a user reads before running it.

Each fix says what it changes, why, the peak the what-if model predicts after it (and what that saves), and whether
it needs a kernel restart (those go at the top of the notebook). Fix cells start with
`%%tfmem --before N --fix ID`, so running one shows before/after and whether the prediction held. Fix ids are
stable (docs/design.md, 'Fix ids'). Nothing here runs code: it only writes it.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from tfmem_magic.advise.diagnose_held import drop_lines
from tfmem_magic.advise.fitting import fitting_batch
from tfmem_magic.advise.prediction import budget_for_tf, predict
from tfmem_magic.advise.rewrite import call_arguments, rewrite_batch
from tfmem_magic.core.errors import TfmemUsageError
from tfmem_magic.core.report import BeforeAfter, Fix, ModelInfo, Report
from tfmem_magic.core.sizes import format_bytes

GPU_NOTE = "needs a kernel restart: TensorFlow reads it when it first touches the GPU"


@dataclass
class FixContext:
    """What the fix writer knows beyond the report: the cell's source and the names the user gave things."""

    source: str | None = None  # the profiled cell's body (without the %%tfmem line)
    model_name: str | None = None  # the variable that holds the model the cell used
    # the variables passed as x, y, sample_weight (role -> name; "": an expression; None: several arrays)
    array_names: dict[str, str | None] | tuple[str, str] | None = None
    number: int = 0  # the report's history number, for --before


def _header(ctx: FixContext, fix_id: str) -> str:
    return (
        f'%%tfmem --before {ctx.number} --fix {fix_id} --label "fix: {fix_id}"\n'
        if ctx.number
        else f'%%tfmem --label "fix: {fix_id}"\n'
    )


def _saving(report: Report, after: int) -> str:
    before = report.tf_peak_bytes
    if before is None or report.status != "ok":
        return f"predicted TF peak {format_bytes(after)}"
    delta = before - after
    if abs(delta) < max(2**20, 0.02 * before):  # within rounding of the prediction: say so, not "saves 12 KiB"
        return (
            f"predicted TF peak {format_bytes(after)}, about the {format_bytes(before)} measured: it saves "
            "nothing at this cell's peak"
        )
    word = "saves" if delta >= 0 else "adds"
    return (
        f"predicted TF peak {format_bytes(after)} instead of {format_bytes(before)} ({word} {format_bytes(abs(delta))})"
    )


def _model(ctx: FixContext) -> str:
    return ctx.model_name or "model"


def _keras(report: Report) -> str:
    """The module a fix writes Keras calls with: the Keras that made the model (tf_keras' policies, optimizers and
    session are its own, not Keras 3's), else the one `tf.keras` is."""
    if report.model is not None:
        return report.model.keras_package
    return report.env.keras_package


def _after_compile(source: str, lines: str) -> str:
    """`source` with `lines` inserted after its last `.compile(...)` statement (or before everything)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return lines + source
    ends = [
        node.end_lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Call)
        and isinstance(node.value.func, ast.Attribute)
        and node.value.func.attr in ("compile", "compile_from_config")
        and node.end_lineno
    ]
    if not ends:
        return lines + source
    rows = source.splitlines(keepends=True)
    at = max(ends)
    indent = rows[at - 1][: len(rows[at - 1]) - len(rows[at - 1].lstrip())] if at - 1 < len(rows) else ""
    block = "".join(indent + line + "\n" for line in lines.splitlines())
    if at <= len(rows) and not rows[at - 1].endswith("\n"):
        rows[at - 1] += "\n"
    return "".join(rows[:at]) + block + "".join(rows[at:])


def _with_batch(report: Report, ctx: FixContext, new: int) -> tuple[str | None, str]:
    batch = report.model.batch_size if report.model else None
    if ctx.source is None:
        return None, f"set the batch size to {new}"
    result = rewrite_batch(ctx.source, batch, new)
    return result.source, result.message


# ---- the fixes ------------------------------------------------------------------------------------------------------


def shrink_batch(report: Report, ctx: FixContext) -> Fix | None:
    model = report.model
    budget = budget_for_tf(report)
    if model is None or not model.batch_size or budget is None:
        return None
    # on the report's basis: the analytic one when the cell ends, the measured one (the step replay) once calibrated;
    # the pre-flight's answer where it measured this call
    named = fitting_batch(report, budget)
    if named is None or named.batch >= model.batch_size:
        return None
    new, chosen = named.batch, named.why
    source, message = _with_batch(report, ctx, new)
    after = predict(report, batch_size=new)
    why = (
        f"Batch {model.batch_size} → {new}, {chosen}: {_saving(report, after.peak_bytes)}. Smaller batches also "
        "mean more, noisier steps: you may want a lower learning rate."
    )
    if source is None:
        return Fix(
            "shrink-batch",
            f"Shrink the batch to {new}",
            why + f" Could not rewrite the cell: {message}.",
            f"# {message}\n",
            after.peak_bytes,
        )
    return Fix(
        "shrink-batch",
        f"Shrink the batch to {new}",
        why + f" Changed: {message}.",
        _header(ctx, "shrink-batch") + source,
        after.peak_bytes,
    )


NO_ACCUMULATION_IN_TF_KERAS = (
    "Gradient accumulation is not offered for this tf_keras (Keras 2) model: its "
    "optimizers have no gradient_accumulation_steps (Keras 3's have), and accumulating by "
    "hand needs a custom train_step. Shrinking the batch or mixed precision are the fixes "
    "here."
)


def grad_accumulation(report: Report, ctx: FixContext) -> Fix | None:
    model = report.model
    if model is None or not model.training or not model.batch_size or model.batch_size < 4:
        return None
    if model.legacy_keras:
        if NO_ACCUMULATION_IN_TF_KERAS not in report.notes:
            report.notes.append(NO_ACCUMULATION_IN_TF_KERAS)
        return None
    steps = 4 if model.batch_size % 4 == 0 else 2
    micro = model.batch_size // steps
    source, message = _with_batch(report, ctx, micro)
    after = predict(report, accumulation_steps=steps)
    lines = (
        f"# {steps} steps of {micro} samples, one weight update: the same effective batch of "
        f"{model.batch_size}\nconfig = {_model(ctx)}.get_compile_config()  # your loss and metrics, as compiled\n"
        f'config["optimizer"]["config"]["gradient_accumulation_steps"] = {steps}\n'
        f"{_model(ctx)}.compile_from_config(config)\n"
    )
    why = (
        f"Runs batches of {micro} and applies the averaged gradients every {steps} steps (Keras' "
        f"gradient_accumulation_steps), so the model learns as with batch {model.batch_size}; the optimizer keeps "
        f"one more copy of the weights for the sums: {_saving(report, after.peak_bytes)}."
    )
    if source is None:
        return Fix(
            "grad-accumulation",
            f"Accumulate gradients over {steps} batches of {micro}",
            why + f" Could not rewrite the cell's batch: {message}.",
            lines,
            after.peak_bytes,
        )
    return Fix(
        "grad-accumulation",
        f"Accumulate gradients over {steps} batches of {micro}",
        why,
        _header(ctx, "grad-accumulation") + _after_compile(source, lines),
        after.peak_bytes,
    )


def mixed_precision(report: Report, ctx: FixContext) -> Fix | None:
    model = report.model
    if model is None or not model.training or (model.dtype_policy or "float32") != "float32":
        return None
    gpu = any("GPU" in d for d in report.env.devices)
    policy = "mixed_float16" if gpu else "mixed_bfloat16"
    after = predict(report, policy=policy)
    where = (
        "on a GPU, float16 runs on its tensor cores"
        if gpu
        else "on CPU, bfloat16: float16 runs 74-260x slower there and is never suggested; steps can take 6-55% "
        "longer on CPUs without native bfloat16"
    )
    keras = _keras(report)
    set_policy = f'import {keras}\n{keras}.mixed_precision.set_global_policy("{policy}")  # before the model is built\n'
    why = (
        f"Computes activations in 16 bits while the weights stay float32 ({where}). The policy applies to "
        f"models built after it is set, so the model is rebuilt: {_saving(report, after.peak_bytes)}. It stays "
        f'set for the session: {keras}.mixed_precision.set_global_policy("float32") undoes it.'
    )
    if model.new_weight_bytes and ctx.source is not None:  # this cell builds the model: set the policy, re-run it
        code = _header(ctx, "mixed-precision") + set_policy + ctx.source
    else:
        code = set_policy + f"# now re-run the cell that builds {_model(ctx)}, then the training cell\n"
    return Fix("mixed-precision", f"Mixed precision ({policy})", why, code, after.peak_bytes)


def lighter_optimizer(report: Report, ctx: FixContext) -> Fix | None:
    model = report.model
    if model is None or not model.training or model.optimizer_slots < 2:
        return None
    after = predict(report, optimizer="sgd+momentum")
    keras = _keras(report)
    code = (
        f"import {keras}\nconfig = {_model(ctx)}.get_compile_config()  # your loss and metrics, as compiled\n"
        f'config["optimizer"] = {keras}.optimizers.serialize({keras}.optimizers.SGD(learning_rate=0.01, '
        "momentum=0.9))\n"
        f"{_model(ctx)}.compile_from_config(config)\n"
    )
    if ctx.source is not None and not model.optimizer_built_in_cell:
        code = _header(ctx, "lighter-optimizer") + code + ctx.source
    elif ctx.source is not None:
        code = _header(ctx, "lighter-optimizer") + _after_compile(ctx.source, code)
    why = (
        f"SGD with momentum keeps 1 slot per weight instead of {model.optimizer}'s {model.optimizer_slots} "
        f"({format_bytes(model.trainable_bytes)} less per slot): {_saving(report, after.peak_bytes)}. It usually "
        "needs a tuned learning rate (Adafactor is another low-memory choice)."
    )
    return Fix(
        "lighter-optimizer",
        "Use SGD with momentum instead of " + (model.optimizer or "Adam"),
        why,
        code,
        after.peak_bytes,
    )


def freeze_layers(report: Report, ctx: FixContext) -> Fix | None:
    model = report.model
    if model is None or not model.training or len(model.layers) < 3:
        return None
    trainable = [layer for layer in model.layers if layer.params]
    if len(trainable) < 2:
        return None
    frozen = trainable[:-1]
    frozen_bytes = sum(layer.params for layer in frozen) * 4
    per_weight = 1 + model.optimizer_slots  # a gradient and the optimizer's slots, per trainable weight
    saved = frozen_bytes * per_weight
    predicted = max(0, (report.tf_peak_bytes or 0) - saved) if model.optimizer_built_in_cell else None
    names = ", ".join(layer.name for layer in frozen[:4]) + (" ..." if len(frozen) > 4 else "")
    code = (
        f"for layer in {_model(ctx)}.layers[:-1]:  # keep the last layer trainable\n"
        "    layer.trainable = False\n"
        f"config = {_model(ctx)}.get_compile_config()\n{_model(ctx)}.compile_from_config(config)  # "
        "trainable changes take effect at compile\n"
    )
    why = (
        f"Stops training {names}: no gradients and no optimizer state for {format_bytes(frozen_bytes)} of "
        f"weights, about {format_bytes(saved)} less. Right when those layers are pretrained (fine-tuning); for "
        "a model trained from scratch, a smaller model is the fix instead."
    )
    return Fix("freeze-layers", "Freeze all but the last layer", why, code, predicted)


def tf_data_streaming(report: Report, ctx: FixContext) -> Fix | None:
    model = report.model
    if model is None or not model.input_array_bytes or not model.batch_size or model.feed not in ("arrays", "none"):
        return None  # ("none": a report from before the feed was recorded)
    call = next((c for c in ("fit", "evaluate", "predict") if c in model.calls), None)
    names = ctx.array_names or {}
    names = dict(zip(("x", "y"), names, strict=False)) if isinstance(names, tuple) else dict(names)
    roles = [r for r in ("x", "y", "sample_weight") if r in names] or ["x"]
    if call is None:
        return None
    batch = model.batch_size
    if (call == "predict" and roles != ["x"]) or any(names.get(r, "") is None for r in roles):
        # several arrays in one role (a list or dict of inputs, or fit and evaluate given different arrays): the
        # generator takes the call's arguments as the cell wrote them, and slices every array in their structure
        code = _structured_stream(ctx, call, batch)
        if code is None:
            return None
        return _stream_fix(report, model, call, code, ctx)
    chosen = {r: names.get(r) or r for r in roles}  # an unnamed array gets its role as a placeholder name
    missing = [r for r in roles if not names.get(r)]
    unnamed = "".join(
        f"# {chosen[r]}: your {r} array (the cell passed it as an expression, not a variable)\n" for r in missing
    )
    first = chosen[roles[0]]
    sliced = ", ".join(f"{chosen[r]}[i:i + {batch}]" for r in roles)
    specs = ", ".join(f"tf.TensorSpec((None, *{chosen[r]}.shape[1:]), {chosen[r]}.dtype)" for r in roles)
    signature = specs if len(roles) == 1 else f"({specs})"
    rest = _STREAM_REST[call]
    code = (
        f"import tensorflow as tf\n{unnamed}\n"
        "def batches():  # yields slices: TensorFlow never holds the whole array\n"
        f"    for i in range(0, len({first}), {batch}):\n        yield {sliced}\n\n"
        f"dataset = tf.data.Dataset.from_generator(batches, output_signature={signature})\n"
        f"dataset = dataset.apply(tf.data.experimental.assert_cardinality(-(-len({first}) // {batch})))"
        ".prefetch(2)\n"
        f"{_model(ctx)}.{call}(dataset, {rest}\n"
    )
    return _stream_fix(report, model, call, code, ctx)


_STREAM_REST = {
    "fit": "epochs=1)  # shuffle the index order in batches() for real training",
    "evaluate": ")",
    "predict": ")",
}


def _structured_stream(ctx: FixContext, call: str, batch: int) -> str | None:
    """The streaming cell for a call whose data is a structure of arrays (`[encoder_in, decoder_in]`, a dict of
    named inputs): None when the cell's source does not show the call's arguments."""
    args = call_arguments(ctx.source or "", call)
    if args is None or "x" not in args:
        return None
    roles = [r for r in ("x", "y", "sample_weight") if r in args and (call != "predict" or r == "x")]
    data = args["x"] if roles == ["x"] else "(" + ", ".join(args[r] for r in roles) + ")"
    return (
        "import tensorflow as tf\n\n"
        "def as_tuples(s):  # tf.data takes tuples and dicts as structures, not lists\n"
        "    if isinstance(s, (list, tuple)):\n        return tuple(as_tuples(v) for v in s)\n"
        "    if isinstance(s, dict):\n        return {k: as_tuples(v) for k, v in s.items()}\n"
        "    return s\n\n"
        f"data = as_tuples({data})  # what {call}() was given, as the cell wrote it\n"
        "rows = len(tf.nest.flatten(data)[0])\n\n"
        "def batches():  # yields slices: TensorFlow never holds the whole arrays\n"
        f"    for i in range(0, rows, {batch}):\n"
        f"        yield tf.nest.map_structure(lambda a: a[i:i + {batch}], data)\n\n"
        "signature = tf.nest.map_structure(lambda a: tf.TensorSpec((None, *a.shape[1:]), a.dtype), data)\n"
        "dataset = tf.data.Dataset.from_generator(batches, output_signature=signature)\n"
        f"dataset = dataset.apply(tf.data.experimental.assert_cardinality(-(-rows // {batch}))).prefetch(2)\n"
        f"{_model(ctx)}.{call}(dataset, {_STREAM_REST[call]}\n"
    )


def _stream_fix(report: Report, model: ModelInfo, call: str, code: str, ctx: FixContext) -> Fix:
    """The tf-data-streaming fix for `code`, with what the copy cost at this cell's peak."""
    copy = sum(c.bytes for c in report.trace.input_copies if c.live_at_peak) if report.trace else 0
    peak = report.tf_peak_bytes or 0
    measured = report.trace is not None and report.trace.events > 0 and report.status == "ok"
    predicted = max(0, peak - copy) if measured else None
    if measured and copy < 0.01 * max(peak, 1):
        saving = (
            "it does not lower this cell's TensorFlow peak (the copy was freed before the peak), but the "
            f"{format_bytes(model.copy_bytes)} copy no longer exists at all"
        )
    elif copy:
        saving = f"{format_bytes(copy)} of tensor copies were live at the peak: {_saving(report, predicted or 0)}"
    else:
        saving = f"{format_bytes(model.copy_bytes)} of arrays are copied whole"
    why = (
        f"{call}(numpy) turns the whole arrays into tensors first; a generator feeds one batch at a time "
        f"({saving}). For data that does not fit in RAM at all, read it from files (tf.data.TFRecordDataset, "
        "keras.utils.image_dataset_from_directory)."
    )
    return Fix(
        "tf-data-streaming",
        f"Stream the data with tf.data instead of {call}(numpy)",
        why,
        _header(ctx, "tf-data-streaming") + code,
        predicted,
    )


def clear_session(report: Report, ctx: FixContext) -> Fix | None:
    held = report.held
    names = list(dict.fromkeys(n for f in report.findings for n in f.holders))  # the holders the findings named
    holders = {h.name: h for h in (held.holders if held else [])}
    back = sum(holders[n].bytes for n in names if n in holders) + (held.runtime_bytes if held else 0)
    mem = report.main_device
    if mem is not None:  # two names may reach the same models: never more than TensorFlow held
        back = min(back, mem.end_bytes)
    if names:
        code = drop_lines(names, {n: h.kind for n, h in holders.items()})
        why = (
            f"Drops exactly the references that hold the memory ({', '.join(names)}), then %tfmem free clears the "
            "Keras session and the traced training steps TensorFlow keeps for models that are gone, and says what "
            f"its allocator gave back: up to {format_bytes(back)} measured at this cell's end (less where another "
            "name still reaches the same models). Models you still use keep working."
        )
    elif held is not None and held.runtime_bytes >= 2**20:
        code = "# gives back what only TensorFlow holds, and says how much came back\n%tfmem free\n"
        why = (
            f"Nothing in the notebook refers to these trained models, yet TensorFlow holds "
            f"{format_bytes(held.runtime_bytes)} of their weights and optimizer slots: its gradient registry keeps "
            "every traced training step (docs/held-memory.md). %tfmem free clears the Keras session and drops "
            "those registry entries, and says what the allocator gave back. Models you still use keep working."
        )
    else:
        code = (
            "# drop the names that still hold old models first (a list of models, a History kept in a dict), "
            "e.g.\n# %tfmem free models\n%tfmem free\n"
        )
        why = (
            "Models built again and again keep their weights and optimizer slots: a list, Out[...] or a callback "
            "may still refer to them, and on TensorFlow 2.21 every model that ran fit stays pinned by TensorFlow's "
            "gradient registry even after del and keras.backend.clear_session(). %tfmem free NAME ... drops the "
            "names you give, clears the Keras session and those registry entries, and says what TensorFlow's "
            "allocator gave back (docs/held-memory.md). Models you still use keep working."
        )
    return Fix("clear-session", "Give back the memory of models that are gone", why, code)


def cpu_memory_limit(report: Report, ctx: FixContext) -> Fix | None:
    if any("GPU" in d for d in report.env.devices) or (report.guard is not None and report.guard.allocator_limit_bytes):
        return None
    budget = report.env.budget_bytes
    limit = max(512 * 2**20, int(budget * 0.9))
    code = (
        "# first cell of the notebook, then Kernel > Restart and run all\n%load_ext tfmem_magic\n"
        f"%tfmem limit {format_bytes(limit).replace(' ', '')}\n"
    )
    why = (
        f"Caps TensorFlow's CPU allocator (TF_CPU_BFC_MEM_LIMIT_IN_MB, read at TensorFlow's first op) below "
        f"{format_bytes(limit)} and arms tfmem's guard, so an oversized step fails with a clean error instead "
        "of the machine swapping or the kernel being killed. It lowers no peak: it makes running out "
        "survivable. Needs a kernel restart."
    )
    return Fix("cpu-memory-limit", "Cap TensorFlow's memory (CPU)", why, code, None, needs_restart=True)


def memory_growth(report: Report, ctx: FixContext) -> Fix | None:
    if not any("GPU" in d for d in report.env.devices):
        return None  # CPU has no memory growth: set_memory_growth raises on CPU devices
    code = (
        "# first cell of the notebook, before any TensorFlow op; then restart the kernel and run all\n"
        "import tensorflow as tf\nfor gpu in tf.config.list_physical_devices('GPU'):\n"
        "    tf.config.experimental.set_memory_growth(gpu, True)\n"
    )
    why = (
        "TensorFlow reserves nearly all GPU memory at start; with growth on it takes what it needs, so other "
        f"processes and notebooks can share the GPU. It does not lower the model's own peak; {GPU_NOTE}."
    )
    return Fix("memory-growth", "Let the GPU memory grow on demand", why, code, None, needs_restart=True)


def gpu_memory_limit(report: Report, ctx: FixContext) -> Fix | None:
    if not any("GPU" in d for d in report.env.devices):
        return None
    name = report.main_device_name if report.on_gpu and report.main_device_name else "GPU:0"
    mem = report.tf.get(name)
    index = int(name.split(":")[1])
    limit = report.env.device_limit_bytes.get(name)
    if mem is not None and mem.peak_bytes > 0:  # the measured peak and a quarter more, in whole 512 MiB
        share = -(-int(mem.peak_bytes * 1.25) // (512 * 2**20)) * 512
        sized = f"MiB: this cell's peak on {name} ({format_bytes(mem.peak_bytes)}) and a quarter more"
        if limit and share * 2**20 > limit:  # near the GPU's own limit: a share of what it has, not more
            share = max(512, int(limit * 0.9) // (512 * 2**20) * 512)
            sized = f"MiB: 90% of what TensorFlow may use on {name} ({format_bytes(limit)}); lower it to share"
    else:
        share, sized = 8192, "MiB: set your share"
    code = (
        "# first cell of the notebook, before any TensorFlow op; then restart the kernel and run all\n"
        "import tensorflow as tf\ngpus = tf.config.list_physical_devices('GPU')\n"
        "tf.config.set_logical_device_configuration(\n"
        f"    gpus[{index}], [tf.config.LogicalDeviceConfiguration(memory_limit={share})])  # {sized}\n"
    )
    why = (
        f"Gives TensorFlow a fixed share of {name} ({share} MiB), so a runaway step fails inside it with a clean "
        f"OOM error instead of starving other processes; {GPU_NOTE}."
    )
    return Fix("gpu-memory-limit", "Cap TensorFlow's GPU memory", why, code, None, needs_restart=True)


def cudnn_workspace_limit(report: Report, ctx: FixContext) -> Fix | None:
    """Cap each convolution's cuDNN workspace at half the largest one live at the peak (docs/gpu.md, "Workspaces").
    No predicted peak: which algorithm fits a lower cap, and its workspace, only a GPU run tells."""
    trace = report.trace
    if trace is None or not report.on_gpu:
        return None
    from tfmem_magic.analyze.analysis import (
        WORKSPACE,
        is_cudnn_workspace,
    )  # NumPy: only for a trace that has workspaces

    cudnn = [g for g in trace.at_peak if g.phase == WORKSPACE and is_cudnn_workspace(g.op, g.layer)]
    if not cudnn:
        return None
    largest = max(g.bytes // max(g.count, 1) for g in cudnn)
    total = sum(g.bytes for g in cudnn)
    cap = max(1, largest // 2 // 2**20)
    code = (
        "# first cell of the notebook, before TensorFlow's first GPU convolution; then restart the kernel and run all\n"
        "import os\n"
        f'os.environ["TF_CUDNN_WORKSPACE_LIMIT_IN_MB"] = "{cap}"  # per convolution: half the largest at the peak '
        f"({format_bytes(largest)}); 4096 unset\n"
        '# os.environ["TF_CUDNN_USE_AUTOTUNE"] = "0"  # instead: no timing trials, cuDNN\'s heuristic algorithm\n'
    )
    why = (
        f"cuDNN's workspaces held {format_bytes(total)} at the peak, the largest {format_bytes(largest)}; capped, "
        f"each convolution's is at most {cap} MiB. The cost is speed: the autotuner then keeps the fastest algorithm "
        "whose workspace fits the cap, which can be slower than the one it chose, and TF_CUDNN_USE_AUTOTUNE=0 "
        "takes cuDNN's heuristic choice without timing any. How much memory either saves only a GPU run tells (no "
        "prediction). It needs a kernel restart: TensorFlow reads the cap once per process, at its first GPU "
        "convolution, and keeps the algorithm it chose for each convolution as long as the process lives."
    )
    return Fix("cudnn-workspace-limit", "Cap cuDNN's convolution workspace", why, code, None, needs_restart=True)


WRITERS: dict[str, Callable[[Report, FixContext], Fix | None]] = {
    "shrink-batch": shrink_batch,
    "grad-accumulation": grad_accumulation,
    "mixed-precision": mixed_precision,
    "lighter-optimizer": lighter_optimizer,
    "freeze-layers": freeze_layers,
    "tf-data-streaming": tf_data_streaming,
    "clear-session": clear_session,
    "cpu-memory-limit": cpu_memory_limit,
    "memory-growth": memory_growth,
    "gpu-memory-limit": gpu_memory_limit,
    "cudnn-workspace-limit": cudnn_workspace_limit,
}
# what an out-of-memory or near-budget cell gets besides the fixes its findings name
PRESSURE_FIXES = ("shrink-batch", "cpu-memory-limit", "memory-growth", "gpu-memory-limit")


def build(report: Report, ctx: FixContext) -> list[Fix]:
    """The fixes the report's findings point to, in the order they matter, each written once."""
    wanted: list[str] = []
    ids = {f.id for f in report.findings}
    for finding in report.findings:
        wanted += finding.fixes
    if ids & {"oom", "near-budget"}:
        wanted += PRESSURE_FIXES
    fixes, seen = [], set()
    for fix_id in wanted:
        if fix_id in seen or fix_id not in WRITERS:
            continue
        seen.add(fix_id)
        try:
            fix = WRITERS[fix_id](report, ctx)
        except TfmemUsageError:  # no model to predict from: this fix does not apply
            fix = None
        if fix is not None:
            fix.placement = "top" if fix.needs_restart else "below"
            fixes.append(fix)
    return fixes


def before_after(before: Report, after: Report, fix_id: str | None, since: Iterable[Report] = ()) -> BeforeAfter:
    """Compare a fix cell's report with the report it fixes; `held` says whether the fix's prediction held.
    `since`: the reports published meanwhile (other fix cells of the same report change the kernel)."""
    fix = next((f for f in before.fixes if f.id == fix_id), None) if fix_id else None
    predicted = fix.predicted_peak_bytes if fix is not None else None
    band = before.prediction.error_band if before.prediction is not None else None
    measured = after.tf_peak_bytes
    held = None
    changed = kernel_change(before, after, fix_id, since)
    if predicted is not None and band is not None and measured is not None and after.status == "ok" and not changed:
        held = abs(measured - predicted) <= band * max(predicted, 1)
    return BeforeAfter(
        number=before.number,
        label=before.label,
        status=before.status,
        tf_peak_bytes=before.tf_peak_bytes,
        rss_peak_bytes=before.rss.peak_bytes,
        wall_s=before.wall_s,
        fix_id=fix_id,
        predicted_peak_bytes=predicted,
        error_band=band,
        held=held,
        kernel_changed=changed,
    )


def kernel_change(before: Report, after: Report, fix_id: str | None, since: Iterable[Report]) -> str | None:
    """Why `after` does not start from the kernel `before` measured, or None.

    A fix's prediction is for the report's cell changed by that one fix, in the kernel as it was. Fix cells of the
    same report tried one after another break that: the earlier fix's models, weights and optimizer slots stay
    allocated (TensorFlow keeps them after the names are rebound), and a fix that recompiles an existing model
    leaves the next cell with slots already built. Judging the next prediction then compares unlike things."""
    others = [
        r
        for r in since
        if r is not after
        and r.number > before.number
        and r.before is not None
        and r.before.number == before.number
        and r.before.fix_id not in (None, fix_id)
    ]
    if not others:
        return None
    ran = ", ".join(dict.fromkeys(f"{r.before.fix_id} (report {r.number})" for r in others if r.before is not None))
    old, new = before.main_device, after.main_device
    moved = (
        f"; TensorFlow held {format_bytes(new.baseline_bytes)} at this cell's start against "
        f"{format_bytes(old.baseline_bytes)} then"
        if old is not None and new is not None
        else ""
    )
    return (
        f"the kernel changed since report {before.number}: fix {ran} ran in between{moved}. The prediction "
        "is for the kernel as it was; restart the kernel and run this fix cell alone to judge it."
    )

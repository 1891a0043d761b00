"""Findings about memory a cell left held: by a name in the notebook, or by TensorFlow itself, and the loops that
leave more behind with each call (measure/holders.py finds the names; release.registry_pinned what only
TensorFlow's gradient registry keeps). Each fires on measured bytes only, and names the holder it measured.
"""

from __future__ import annotations

from statistics import median

from tfmem_magic.core.report import CallRecord, Finding, Holder, Report
from tfmem_magic.core.sizes import format_bytes

HELD_MIN = 2**20  # bytes a holder must hold to be named in a finding
LINE_MIN = 256 * 1024  # bytes a line of code must have made of what a cell left live to be named in a leak finding
MAX_LEAK_LINES = 3  # lines named per leak finding
# why an eager op's bytes left at a cell's end are named by no line (a leak finding and the Held-after view say it)
EAGER_NO_LINE = "the trace keeps no stack for an eager op"
LOOP_CALLS = 3  # calls of one kind in one cell that make a loop
PREDICT_LOOP_CALLS = 5  # predict calls needed to tell RSS growth from noise
PREDICT_RSS_STEP = 2**20  # RSS growth per predict call (the median) that counts as growing
CONTAINERS = ("list", "dict", "set")
# a name bound to one of these is the user's working object (the model they train, their data): a fix never drops it
KEPT_KINDS = ("Keras model", "Keras layer", "tensor", "variable", "optimizer", "function")
_KIND_WORDS = {
    "list": "a list",
    "dict": "a dict",
    "tuple": "a tuple",
    "set": "a set",
    "Keras model": "a Keras model",
    "Keras layer": "a Keras layer",
    "tensor": "a tensor",
    "variable": "a variable",
    "function": "a function",
    "optimizer": "an optimizer",
    "History": "the History that fit returned",
}


def holder_words(h: Holder) -> str:
    """ "`models` — a list in your namespace — holds 3 Keras models, 6.9 MiB each"."""
    kind = _KIND_WORDS.get(h.kind, "a " + h.kind)
    where = "IPython's output cache" if h.name == "Out" else f"{kind} in your namespace"
    n = len(h.models)
    if n:
        what = f"{n} Keras model{'s' if n > 1 else ''} ({', '.join(h.models[:4])}{', …' if n > 4 else ''})"
        sizes = h.model_bytes or [h.bytes // n]
        alike = max(sizes) <= 1.1 * min(sizes)
        what += f", {format_bytes(h.bytes / n)} each" if n > 1 and alike else f", {format_bytes(h.bytes)}"
    elif h.tensors:
        what = f"{h.tensors} tensor{'s' if h.tensors > 1 else ''}, {format_bytes(h.bytes)}"
    else:
        what = f"{h.variables} variable{'s' if h.variables > 1 else ''}, {format_bytes(h.bytes)}"
    via = f" (e.g. {h.paths[0]})" if h.paths and h.paths[0] != h.name else ""
    return f"`{h.name}` — {where} — holds {what}{via}"


def drop_lines(names: list[str], kinds: dict[str, str]) -> str:
    """The lines that drop exactly these holders, then give the memory back: a container is emptied (the loop that
    fills it keeps working), IPython's output cache reset, any other name deleted by `%tfmem free NAME`."""
    lines = []
    deleted = []
    for name in names:
        if name == "Out":  # a comment on the %reset line would reach its option parser: it goes above
            lines += ["# IPython's output cache (Out, _, __, ___)", "%reset -f out"]
        elif kinds.get(name) in CONTAINERS:
            lines.append(f"{name}.clear()")
        elif kinds.get(name) not in KEPT_KINDS:
            deleted.append(name)
    lines.append("# clears the Keras session and what TensorFlow keeps for models that are gone; says what came back")
    lines.append("%tfmem free" + "".join(f" {n}" for n in deleted))
    return "\n".join(lines) + "\n"


def held_lines_words(report: Report) -> str:
    """The lines of the user's code that made what the cell still had live when it ended (TraceInfo.
    held_at_end_by_line, docs/leaks.md), as a sentence of a leak finding: " Still live at the cell's end, by the line
    of code that made it: In [2] line 3 (`return tf.random.normal([1024, 1024])`) 4 MiB." Only where the trace
    covered the whole cell (one that stopped early ends with a step's temporaries) and only lines the trace resolved:
    an eager op's bytes are said to be eager ops', never given a line. "" where no line made LINE_MIN."""
    trace = report.trace
    if trace is None or not trace.complete or not trace.held_at_end_by_line:
        return ""
    groups = trace.held_at_end_by_line
    named = [g for g in groups if g.kind == "line" and g.bytes >= LINE_MIN][:MAX_LEAK_LINES]
    if not named:
        return ""
    parts = [f"{g.label}" + (f" (`{g.code}`)" if g.code else "") + f" {format_bytes(g.bytes)}" for g in named]
    eager = sum(g.bytes for g in groups if g.kind == "eager")
    if eager >= LINE_MIN:
        parts.append(f"eager ops {format_bytes(eager)} (no line: {EAGER_NO_LINE})")
    return " Still live at the cell's end, by the line of code that made it: " + "; ".join(parts) + "."


def held_by_tensorflow(report: Report) -> Finding | None:
    """Memory of trained models that no name reaches any more, kept by TensorFlow's gradient registry."""
    held = report.held
    if held is None or held.runtime_new_bytes < HELD_MIN:
        return None
    return Finding(
        id="held-by-tensorflow",
        severity="warn",
        title=f"{format_bytes(held.runtime_bytes)} of trained models nothing refers to is still held by TensorFlow",
        evidence=(
            f"No Python object holds these variables any more ({format_bytes(held.runtime_new_bytes)} "
            f"more than when tfmem last looked), but {held.runtime_entries} traced training step(s) in "
            "TensorFlow's gradient registry still capture them: on TensorFlow 2.21 every model that ran fit (or "
            "optimizer.apply in a tf.function) stays pinned after del, keras.backend.clear_session() and "
            "gc.collect() (tensorflow#97697, docs/held-memory.md). %tfmem free gives it back without a restart."
        ),
        bytes=held.runtime_bytes,
        fixes=["clear-session"],
    )


def _holders_of_the_loop(report: Report, total: int) -> list[Holder]:
    """The names that hold what a loop of calls left: several of its models, or about all it left. A name bound to
    one model (the loop's last `model`) holds one model, not the loop's leftovers: it is not named."""
    held = report.held
    return [
        h
        for h in (held.holders if held else [])
        if h.new_bytes >= HELD_MIN and (len(h.models) >= 2 or h.new_bytes >= total // 2) and h.kind not in KEPT_KINDS
    ]


def _loop_calls(calls: list[CallRecord], kind: str) -> list[CallRecord]:
    return [c for c in calls if c.call == kind]


def leak_in_cell(report: Report) -> Finding | None:
    """A loop of fit/evaluate/predict calls in one cell, each leaving TensorFlow memory behind that is still held."""
    held = report.held
    for kind in ("fit", "predict", "evaluate"):
        calls = _loop_calls(report.calls, kind)
        left = [
            c.tf_after_bytes - c.tf_before_bytes
            for c in calls
            if c.tf_after_bytes is not None and c.tf_before_bytes is not None
        ]
        if len(left) < LOOP_CALLS or len(left) != len(calls) or not all(x >= HELD_MIN for x in left):
            continue
        total = sum(left)
        if held is None or held.left_bytes is None or held.left_bytes < total // 2:
            continue  # the cell gave most of it back before it ended
        named = _holders_of_the_loop(report, total)
        parts = ["Held by " + "; ".join(holder_words(h) for h in named[:3]) + "."] if named else []
        if held.runtime_new_bytes >= HELD_MIN:
            parts.append(
                f"{format_bytes(held.runtime_new_bytes)} of it no Python object holds: TensorFlow's gradient "
                "registry keeps each trained model's variables (docs/held-memory.md)."
            )
        who = " ".join(parts) or (
            "tfmem found no name that holds it (a global of a module, or a name it could not walk into)."
        )
        return Finding(
            id="leak-in-cell",
            severity="warn",
            title=f"Each of the {len(left)} {kind}() calls in this cell left ~{format_bytes(total / len(left))} behind",
            evidence=(
                f"TensorFlow's allocator held {', '.join('+' + format_bytes(x) for x in left)} more after each "
                f"{kind}() call than before it, and {format_bytes(held.left_bytes)} more at the cell's end. "
                f"{who}{held_lines_words(report)} To train many models in one kernel, keep only what you need of "
                "each (its score, model.get_weights()), or reuse one model and set_weights() its initial weights per "
                "trial."
            ),
            bytes=total,
            fixes=["clear-session"],
            holders=[h.name for h in named[:3]],
        )
    return None


def predict_loop_growth(report: Report) -> Finding | None:
    """`predict` in a loop whose process memory grows with each call while TensorFlow's does not (tensorflow#33009):
    only when the growth is measured, call by call."""
    calls = _loop_calls(report.calls, "predict")
    if len(calls) < PREDICT_LOOP_CALLS:
        return None
    # what each call returned is the user's (an array appended to a list grows the process too): not the leak
    steps = [
        b.rss_before_bytes - a.rss_before_bytes - a.output_bytes for a, b in zip(calls[1:], calls[2:], strict=False)
    ]
    tf_steps = [
        c.tf_after_bytes - c.tf_before_bytes
        for c in calls[1:]
        if c.tf_after_bytes is not None and c.tf_before_bytes is not None
    ]
    if not steps or median(steps) < PREDICT_RSS_STEP or sum(1 for s in steps if s > 0) < 0.8 * len(steps):
        return None
    if tf_steps and median(tf_steps) >= PREDICT_RSS_STEP:
        return None  # TensorFlow's own memory grows: leak-in-cell speaks of it
    per_call = median(steps)
    grown = calls[-1].rss_before_bytes - calls[1].rss_before_bytes
    return Finding(
        id="predict-loop",
        severity="warn",
        title=f"The process grew ~{format_bytes(per_call)} with each predict() call of a loop of {len(calls)}",
        evidence=(
            f"Process memory before each predict() call after the first grew by a median of "
            f"{format_bytes(per_call)} per call beyond the arrays it returned ({format_bytes(grown)} in all), "
            "while TensorFlow's allocator "
            "did not: predict() builds a data adapter and iterator per call (tensorflow#33009). In a loop "
            "over small inputs call the model directly, model(x, training=False), or model.predict_on_batch(x)."
        ),
        bytes=int(per_call * len(steps)),
    )


HELD_RULES = [held_by_tensorflow, leak_in_cell, predict_loop_growth]

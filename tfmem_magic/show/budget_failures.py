"""What the pytest plugin's memory budgets say when a test fails one or cannot be judged: the largest tensors at
the peak, and why TensorFlow's allocator was not (fully) measured, with what a pytest user does about it."""

from __future__ import annotations

import os

from tfmem_magic.core.report import Report
from tfmem_magic.core.sizes import format_bytes


def largest_tensors(report: Report, top: int) -> list[str]:
    """The `top` largest tensors live at the peak, one line each, or one line saying why they are not known."""
    if report.trace is None or not report.trace.at_peak:
        reason = (
            "(the test was measured in quick mode)"
            if report.mode == "quick"
            else (report.trace.note if report.trace is not None and report.trace.note else "(the trace saw no tensors)")
        )
        return [f"The largest tensors at the peak are not known {reason}."]
    rows = sorted(report.trace.at_peak, key=lambda g: g.bytes, reverse=True)[:top]
    out = ["Largest tensors live at the peak:"]
    for g in rows:
        where = ", ".join(x for x in (g.layer, g.phase) if x)
        shape = f"{g.dtype or ''}{g.shape or ''}"
        out.append(
            f"  {format_bytes(g.bytes):>10}  {g.op or '?'}{f' ({where})' if where else ''}"
            f"{f'  {shape}' if shape else ''}{f'  x{g.count}' if g.count > 1 else ''}"
        )
    return out


def unmeasured(report: Report, marker: str, device: str | None = None, rss_instead: bool = False) -> str:
    """Why `marker` could not judge the test: the device it names keeps no statistics, or the CPU allocator was
    not measured. `rss_instead`: the marker can limit the process's memory instead (rss=True)."""
    if device is not None and (report.tf or report.env.devices):
        have = ", ".join(sorted(report.tf)) or "none"
        return (
            f"{marker}(device={device!r}): TensorFlow has no allocator statistics for {device} in this process "
            f"(its devices: {', '.join(report.env.devices) or 'none'}; with statistics: {have}). Limit a device "
            "this machine has, or skip the test where it has none, e.g. @pytest.mark.skipif(not "
            "tf.config.list_physical_devices('GPU'), reason='needs a GPU')."
        )
    instead = "; or limit the process memory instead with rss=True" if rss_instead else ""
    if report.env.partial_allocator:
        note = allocator_note(report).rstrip(".")
        return f"{marker}: tfmem could not measure TensorFlow's allocator in this test: {note}{instead}."
    why = report.env.allocator_note or "TensorFlow did not run in the test body, or its allocator keeps no statistics"
    return (
        f"{marker}: tfmem could not measure TensorFlow's allocator in this test ({why}). Set "
        "TF_CPU_ALLOCATOR_USE_BFC=1 in the environment before pytest starts, or make sure no TensorFlow op runs "
        f"while test modules are imported{instead}."
    )


def allocator_note(report: Report) -> str:
    """What TensorFlow's CPU allocator missed in this run, why, and what a pytest user does about it (the report's
    own note gives a notebook's advice: restart the kernel)."""
    from tfmem_magic.measure.environment import BFC_ENV, allocator_setup  # pytest loads the plugin in every run

    env = report.env
    if allocator_setup().loaded_after_first_op:
        why = (
            "a TensorFlow op ran before the plugin could switch it to BFC (when a test module or conftest.py was "
            "imported)"
        )
    elif BFC_ENV in os.environ:  # the plugin respects a value the user set
        why = f"{BFC_ENV}={os.environ[BFC_ENV]!r} in the environment turned BFC off"
    else:
        why = "BFC was not on before TensorFlow's first op"
    return (
        f"TensorFlow's CPU allocator ({env.allocator}) {env.allocator_misses}: {why}. Run pytest with "
        f"{BFC_ENV}=1 in the environment, or run no TensorFlow op at import (make tensors in fixtures or tests)."
    )

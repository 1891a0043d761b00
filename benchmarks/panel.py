"""Panel build time and what is sent to the browser, for a report of a ~100k-memory-event trace.

The trace of a long eager loop is recorded in full (the plateau rule is switched off for this measurement only),
then the script times the static bundle and the panel (charts included), and sums what the front end receives:
the static bundle (HTML + text + report JSON) and every widget's state (JSON + binary buffers such as the PNGs).

    python benchmarks/panel.py [--steps 10000]

Targets (docs/panel.md): panel build < 0.5 s, everything sent < 1 MB.
"""

from __future__ import annotations

import argparse
import json
import time

import tfmem_magic

tfmem_magic.prepare()

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfmem_magic.measure import tracer  # noqa: E402
from tfmem_magic.show.panel import build_panel  # noqa: E402
from tfmem_magic.show.render import mime_bundle  # noqa: E402


def widget_bytes(widget) -> int:
    """JSON size of a widget tree's state plus its binary buffers, as the comm would carry them."""
    from ipywidgets.widgets.widget import _remove_buffers

    total = 0
    seen = set()
    stack = [widget]
    while stack:
        w = stack.pop()
        if id(w) in seen:
            continue
        seen.add(id(w))
        state, _, buffers = _remove_buffers(w.get_state())
        total += len(json.dumps(state, default=str)) + sum(len(b) for b in buffers)
        for value in w.keys:
            child = getattr(w, value, None)
            if isinstance(child, (list, tuple)):
                stack.extend(c for c in child if hasattr(c, "get_state"))
            elif hasattr(child, "get_state"):
                stack.append(child)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000)
    args = parser.parse_args()
    layer = keras.layers.Dense(128, name="dense_eager")
    x = tf.random.uniform((32, 128))
    layer(x)
    tracer.PLATEAU_S = 1e9  # record the whole loop: the worst case for the analysis and the report size
    tracer.TRACE_BUDGET_BYTES = 0  # and no memory budget (a full trace of the loop)
    with tfmem_magic.profile(label="panel benchmark", trace_seconds=600) as p:
        h = x
        for _ in range(args.steps):
            h = tf.nn.relu(layer(h)) * 0.5 + x
    report = p.report
    print(
        f"trace: {report.trace.events:,} memory events, {len(report.trace.timeline)} timeline points, "
        f"{len(report.rss.samples)} RSS samples"
    )
    start = time.perf_counter()
    bundle = mime_bundle(report)
    static_s = time.perf_counter() - start
    start = time.perf_counter()
    panel = build_panel(report)
    panel_s = time.perf_counter() - start
    static_bytes = sum(len(v if isinstance(v, str) else json.dumps(v)) for v in bundle.values())
    sent_panel = widget_bytes(panel)
    print(
        f"static bundle: built in {static_s:.3f} s, {static_bytes / 1e3:,.0f} kB "
        f"(report JSON {len(json.dumps(bundle[tfmem_magic.MIME_TYPE])) / 1e3:,.0f} kB)"
    )
    print(f"panel: built in {panel_s:.3f} s, widget state {sent_panel / 1e3:,.0f} kB")
    total = static_bytes + sent_panel
    print(f"sent to the browser in all: {total / 1e6:.2f} MB   targets: panel < 0.5 s, sent < 1 MB")


if __name__ == "__main__":
    main()

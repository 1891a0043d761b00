"""Stop means stop, measured: press the kernel's stop button once at each of many moments of a long Keras `fit`, in a
real kernel, and count how each press ended the cell: with a KeyboardInterrupt error output (what Jupyter shows as a
failed cell), with a bare "KeyboardInterrupt" text and no error output (IPython's display cut short), or not at all
(the press was swallowed and fit went on). Under `%%tfmem` and without it (plain Keras), side by side.

    .venv/bin/python benchmarks/stop_presses.py [--presses 50] [--modes tfmem,plain]

A press after which the cell's code has not ended within GIVE_UP_S counts as lost; the script then presses again
until it ends (so one run never waits for the 1000-epoch fit). docs/interrupts.md has the results and the causes.
"""

from __future__ import annotations

import argparse
import queue
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration"))

import test_kernel_faults as faults  # noqa: E402  the tests' real-kernel driver: one way to press stop

GIVE_UP_S = 8.0
# the user's code says when it ends (before tfmem's own work at the cell's end): a press is lost when that takes
# longer than GIVE_UP_S
CELL = (
    f"print({faults.STARTED!r}, flush=True)\ntry:\n"
    "    model.fit(x, y, epochs=1000, batch_size=32, verbose=0)\nfinally:\n    print('ENDED', flush=True)"
)


def press(kernel: faults.Kernel, code: str, offset: float) -> dict:
    """Run `code`, press stop `offset` s after it prints STARTED, and again every GIVE_UP_S until its code ends."""
    msg_id = kernel.kc.execute(code)
    presses, out, error, next_press, ended = 0, [], None, None, False
    while True:
        if next_press is not None and not ended and time.time() >= next_press:
            kernel.km.interrupt_kernel()
            presses += 1
            next_press = time.time() + GIVE_UP_S
        try:
            msg = kernel.kc.get_iopub_msg(timeout=0.02)
        except queue.Empty:  # nothing yet
            continue
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            out.append(content["text"])
            if faults.STARTED in content["text"] and next_press is None:
                next_press = time.time() + offset
            ended = ended or "ENDED" in content["text"]
        elif kind == "error":
            error = content["ename"]
        elif kind == "status" and content["execution_state"] == "idle":
            return {"presses": presses, "error": error, "stdout": "".join(out)}


def run(modes: list[str], presses: int) -> dict[str, dict[str, int]]:
    kernel = faults.Kernel(Path(tempfile.mkdtemp(prefix="stop-presses-")))
    counts: dict[str, dict[str, int]] = {}
    try:
        assert kernel.run(faults.SETUP)["error"] is None
        kernel.run(faults.NEXT)  # TensorFlow's profiler starts its threads once per process
        for mode in modes:
            prefix = "%%tfmem\n" if mode == "tfmem" else ""
            seen = counts[mode] = {"error output": 0, "text only": 0, "lost": 0}
            for i in range(presses):
                offset = 0.05 + (4.0 * i / max(1, presses - 1))  # spread over the first 4 s of the fit
                began = time.time()
                cell = press(kernel, prefix + CELL, offset)
                if cell["presses"] > 1:
                    seen["lost"] += 1
                elif cell["error"] == "KeyboardInterrupt":
                    seen["error output"] += 1
                else:
                    seen["text only"] += 1
                print(
                    f"{mode:>6} press {i + 1:>2} at +{offset:4.2f} s: presses {cell['presses']}, error "
                    f"{cell['error']}, {time.time() - began:5.1f} s",
                    flush=True,
                )
    finally:
        kernel.close()
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presses", type=int, default=50)
    parser.add_argument("--modes", default="tfmem,plain")
    args = parser.parse_args()
    began = time.time()
    counts = run(args.modes.split(","), args.presses)
    print(
        f"\n{'':>6} {'error output':>13} {'text only':>10} {'lost':>5}   ({args.presses} presses each, "
        f"{time.time() - began:.0f} s)"
    )
    for mode, seen in counts.items():
        print(f"{mode:>6} {seen['error output']:>13} {seen['text only']:>10} {seen['lost']:>5}")


if __name__ == "__main__":
    main()

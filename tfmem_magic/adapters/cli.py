"""Command line: `python -m tfmem_magic demo`, `tfmem run script.py`, `tfmem show report.json`.

The measurement options are the very ones `%%tfmem` takes (one parser, options.build_parser).
"""

from __future__ import annotations

import argparse
import gzip
import runpy
import sys
from dataclasses import replace
from pathlib import Path

from tfmem_magic import pipeline
from tfmem_magic.adapters.arguments import args_from_namespace, build_parser, write_outputs
from tfmem_magic.analyze import saved_trace
from tfmem_magic.core.errors import TfmemUsageError
from tfmem_magic.core.report import Report
from tfmem_magic.measure import environment
from tfmem_magic.show.render import render_text
from tfmem_magic.show.saving import save_report


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tfmem", description="Where TensorFlow's memory goes.")
    sub = parser.add_subparsers(dest="command", required=True)
    measure = build_parser("tfmem", notebook=False)
    demo = sub.add_parser("demo", parents=[measure], help="profile a small Keras CNN on synthetic data")
    demo.add_argument("--out", metavar="DIR", default=".", help="where to write tfmem-demo.html/.json (.)")
    demo.add_argument("--batch", type=int, default=128, help="batch size of the demo fit (128)")
    demo.add_argument("--epochs", type=int, default=1, help="epochs of the demo fit (1)")
    run = sub.add_parser("run", parents=[measure], help="profile a Python script: tfmem run train.py [args]")
    run.add_argument(
        "--serve",
        metavar="PORT",
        type=int,
        help="also start TensorFlow's profiler server on PORT, so that `tfmem capture HOST:PORT` can trace this worker",
    )
    run.add_argument("script", help="the script to run")
    run.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    capture = sub.add_parser("capture", help="trace every worker of a training job at once, side by side")
    capture.add_argument("workers", help="HOST:PORT[,HOST:PORT...]: workers started with tfmem_magic.serve(PORT)")
    capture.add_argument("--seconds", type=float, default=2.0, help="how long to trace (2)")
    capture.add_argument("--logdir", help="where the workers write their traces (a folder all can reach)")
    capture.add_argument("--html", metavar="PATH", help="also write the side-by-side table as HTML")
    cluster = sub.add_parser("cluster", help="the side-by-side view of the reports workers saved in a folder")
    cluster.add_argument("folder", help="a folder of *.json reports and *.xplane.pb traces, one per worker")
    cluster.add_argument("--html", metavar="PATH", help="also write the side-by-side table as HTML")
    show = sub.add_parser("show", help="print a saved report (and optionally write it as HTML)")
    show.add_argument(
        "report",
        help="a report saved with --save x.json, or a trace recorded elsewhere: a "
        ".xplane.pb (gzipped too), or a folder of them (TensorBoard's plugins/profile)",
    )
    show.add_argument(
        "--device",
        metavar="NAME",
        help="of a trace: the device whose allocator to read (GPU:1); default: the busiest GPU, else the CPU",
    )
    show.add_argument(
        "--batch-size",
        metavar="N",
        type=int,
        help="of a trace: the batch one step of its device "
        "ran, per replica, for the what-if from it "
        "(default: read from the tensors' shapes)",
    )
    show.add_argument("--html", metavar="PATH", help="also write a static HTML page")
    show.add_argument(
        "--tensorboard",
        metavar="LOGDIR",
        help="also write it for TensorBoard (scalars and text; "
        "a trace goes along for the Profile tab, a saved "
        "report keeps none)",
    )
    return parser


def _cluster(ns: argparse.Namespace) -> int:
    from tfmem_magic.show.cluster_render import cluster_html, cluster_text

    view = (
        pipeline.capture(ns.workers, ns.seconds, ns.logdir)
        if ns.command == "capture"
        else pipeline.cluster_from(ns.folder)
    )
    print(cluster_text(view))
    if ns.html:
        Path(ns.html).write_text("<!doctype html><meta charset='utf-8'>" + cluster_html(view))
        print(f"wrote {ns.html}")
    return 0 if view.measured else 1


def _show(ns: argparse.Namespace) -> int:
    """A saved report, or a saved trace (a .xplane.pb, or a folder of them: one report per file)."""
    if saved_trace.is_xspace_path(ns.report):
        files: list[Path | None] = []
        reports = []
        for f in saved_trace.xspace_files(ns.report):
            try:
                reports.append(pipeline.analyze_xplane(f, ns.device, label=f.name, batch_size=ns.batch_size))
            except saved_trace.NoMemoryEvents:
                if Path(ns.report).is_file():
                    raise
                print(f"{f.name}: no memory events (a trace segment can record none): skipped")
                continue
            files.append(f)
        if not reports:
            raise TfmemUsageError(f"no trace under {ns.report} has memory events: record one with the profiler")
    else:
        if ns.device or ns.batch_size:
            raise TfmemUsageError(
                "--device and --batch-size are for a saved trace (.xplane.pb); a saved report "
                "already has its device and its batch"
            )
        files = [None]
        reports = [Report.load(ns.report)]
    for i, (report, file) in enumerate(zip(reports, files, strict=True)):
        print(render_text(report))
        if ns.html:
            html = Path(ns.html) if len(reports) == 1 else Path(ns.html).with_suffix(f".{i + 1}.html")
            print(f"wrote {save_report(report, html)}")
        if ns.tensorboard:
            from tfmem_magic.show.tensorboard import summary_line, write

            # a trace goes along as read, for the Profile tab (a saved report keeps none); without TensorBoard: a
            # usage error
            xspaces = [(_raw_xspace(file), 0.0)] if file is not None else None
            host = file.name.split(".xplane.pb")[0] if file is not None else None
            print(summary_line(write(report, ns.tensorboard, xspaces, host=host)))
    return 0


def _raw_xspace(path: Path) -> bytes:
    """A saved trace's XSpace as TensorBoard's profile plugin reads it: `<host>.xplane.pb`, never gzipped."""
    data = path.read_bytes()
    return gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    ns = parser.parse_args(argv)
    try:
        if ns.command == "show":
            return _show(ns)
        if ns.command in ("capture", "cluster"):
            return _cluster(ns)
        args = args_from_namespace(ns)
    except (TfmemUsageError, OSError, ValueError) as exc:
        parser.error(str(exc))
    environment.prepare_allocator()  # before any TF op: every allocation visible
    options = args.options
    if getattr(ns, "serve", None) is not None and options.mode == "trace":
        # TensorFlow runs one profiler session per process: a local trace would refuse the remote capture
        options = replace(options, mode="quick")
        print(
            "tfmem run --serve: the script is measured in quick mode here; `tfmem capture` traces it", file=sys.stderr
        )
    profiler = pipeline.Profiler(options)
    if ns.command == "demo":
        from tfmem_magic.adapters.demo import run_demo

        if ns.batch < 1 or ns.epochs < 1:
            parser.error("--batch and --epochs must be at least 1")
        out = Path(ns.out)
        out.mkdir(parents=True, exist_ok=True)
        print(
            f"tfmem demo: training a small CNN (batch {ns.batch}, {ns.epochs} epoch(s)) under the profiler...",
            flush=True,
        )
        run_demo(profiler, ns.batch, ns.epochs)
        report = profiler.report
        assert report is not None
        print(render_text(report))
        for path in (out / "tfmem-demo.html", out / "tfmem-demo.json"):
            save_report(report, path)
            print(f"wrote {path}")
        for line in write_outputs(report, args, profiler.xspaces):
            print(line)
        return 0
    # run
    if ns.serve is not None:
        from tfmem_magic.measure import remote

        try:
            remote.serve(ns.serve)
        except TfmemUsageError as exc:
            parser.error(str(exc))
    sys.argv = [ns.script, *ns.script_args]
    status = 0
    try:
        with profiler:
            # kept until the block ends: --calibrate needs the script's model alive (the report links it weakly)
            script_globals = runpy.run_path(ns.script, run_name="__main__")  # noqa: F841
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except Exception:  # noqa: BLE001 - the script's own error: show its traceback, then the report, and fail like it would
        import traceback

        traceback.print_exc()
        status = 1
    report = profiler.report
    assert report is not None
    print(render_text(report), file=sys.stderr)
    for line in write_outputs(report, args, profiler.xspaces):
        print(line, file=sys.stderr)
    return status


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())

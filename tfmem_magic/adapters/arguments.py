"""The one argument parser for `%%tfmem` and the command line, so that both accept exactly the same options.

Everything is validated before the cell runs: a typo must not cost a ten-minute training run.
"""

from __future__ import annotations

import argparse
import keyword
import logging
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tfmem_magic.core.errors import TfmemUsageError
from tfmem_magic.core.fallbacks import fallback
from tfmem_magic.core.options import Options
from tfmem_magic.core.report import Report
from tfmem_magic.core.sizes import parse_size
from tfmem_magic.show.saving import save_report

_log = logging.getLogger(__name__)

SAVE_SUFFIXES = (".json", ".html", ".htm")


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing and exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise TfmemUsageError(f"%%tfmem: {message}\n{self.format_usage().strip()}")

    def exit(self, status: int = 0, message: str | None = None) -> None:  # type: ignore[override]
        raise TfmemUsageError(message or self.format_help())


def build_parser(prog: str = "%%tfmem", notebook: bool = True) -> argparse.ArgumentParser:
    """The measurement options; `notebook=False` leaves out those that only make sense in a notebook."""
    parser = _Parser(
        prog=prog,
        add_help=False,
        description="Measure the memory of a cell: TF allocator, profiler trace and process RSS.",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--trace",
        dest="mode",
        action="store_const",
        const="trace",
        help="trace allocations with the TF profiler: breakdown by op/layer/phase and timeline (default)",
    )
    mode.add_argument(
        "--quick",
        dest="mode",
        action="store_const",
        const="quick",
        help="allocator stats and RSS only: near-zero overhead",
    )
    parser.add_argument("--limit", metavar="SIZE", help="this cell's memory budget, e.g. 6GB, 512MiB, 2G")
    _switch(
        parser,
        "preflight",
        "before each fit/evaluate/predict, predict its step from two small probe steps (another process, "
        "seconds) and refuse one that will not fit the limit (default: on when a limit is set and TensorFlow's "
        "allocator could not be capped)",
        "never run the pre-flight (the guard still watches the cell)",
    )
    _switch(
        parser,
        "calibrate",
        "after the cell, replay its step in probe processes (seconds for a small model, minutes for a large "
        "one) so its what-if stands on the step replay (default: %%tfmem calibrate auto|on|off, "
        "auto: when the report names the largest batch that fits)",
        "keep the analytic what-if even where %%tfmem calibrate would calibrate",
    )
    if notebook:
        parser.add_argument("--as", dest="as_name", metavar="NAME", help="also bind the report to NAME")
        parser.add_argument("--no-panel", action="store_true", help="show the static report, no interactive widgets")
        parser.add_argument(
            "--before",
            metavar="REF",
            help="compare with an earlier report (history number, label or --as name): before/after",
        )
        parser.add_argument(
            "--fix", metavar="ID", help="this cell applies that fix of the --before report: check its prediction"
        )
    parser.add_argument("--label", metavar="TEXT", default="", help="a name for this report")
    parser.add_argument("--save", metavar="PATH", help="write the report to PATH (.json, or .html for a page)")
    parser.add_argument(
        "--tensorboard",
        metavar="LOGDIR",
        help="also write the report for TensorBoard: scalars over time, the text report, and the "
        "trace for its Profile tab (needs tensorboard; xprof for the Profile tab)",
    )
    parser.add_argument(
        "--interval",
        metavar="MS",
        type=float,
        default=50.0,
        help="RSS and TF sampling period for the timeline (50 ms); the RSS peak is exact anyway",
    )
    parser.add_argument(
        "--trace-steps", metavar="N", type=int, default=10, help="steps of each fit/evaluate/predict call to trace (10)"
    )
    parser.add_argument(
        "--trace-seconds", metavar="S", type=float, default=20.0, help="stop tracing after S seconds of the cell (20)"
    )
    if notebook:
        parser.add_argument("-h", "--help", action="help", help="show this help")
    return parser


def _switch(parser: argparse.ArgumentParser, name: str, on_help: str, off_help: str) -> None:
    """--NAME / --no-NAME, exclusive: True, False, or None when neither is given (the default decides)."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument(f"--{name}", dest=name, action="store_const", const=True, default=None, help=on_help)
    group.add_argument(f"--no-{name}", dest=name, action="store_const", const=False, help=off_help)


@dataclass(frozen=True)
class CellArgs:
    options: Options
    as_name: str | None
    save: Path | None
    panel: bool
    before: str | None = None
    fix_id: str | None = None
    tensorboard: Path | None = None  # TensorBoard logdir to write the report (and its trace) into


_cell_parser: argparse.ArgumentParser | None = None


def parse_cell_args(line: str) -> CellArgs:
    global _cell_parser
    try:
        argv = shlex.split(line)
    except ValueError as exc:
        raise TfmemUsageError(f"%%tfmem: cannot read the options {line!r} ({exc}); close your quotes") from None
    if _cell_parser is None:  # built once: argparse objects are a web of cycles, not worth making per cell
        _cell_parser = build_parser()
    return args_from_namespace(_cell_parser.parse_args(argv))


def args_from_namespace(ns: argparse.Namespace) -> CellArgs:
    limit = parse_size(ns.limit) if ns.limit else None
    as_name = getattr(ns, "as_name", None)
    if as_name is not None and (not as_name.isidentifier() or keyword.iskeyword(as_name)):
        raise TfmemUsageError(f"--as {as_name!r} is not a Python name: use letters, digits and _, such as --as report")
    save = Path(ns.save).expanduser() if ns.save else None
    if save is not None:
        if save.suffix.lower() not in SAVE_SUFFIXES:
            raise TfmemUsageError(f"--save {ns.save!r}: end the name with .json (the report) or .html (a page)")
        if not save.parent.exists():
            raise TfmemUsageError(f"--save {ns.save!r}: the folder {str(save.parent)!r} does not exist")
    tensorboard = Path(ns.tensorboard).expanduser() if ns.tensorboard else None
    if tensorboard is not None:
        from tfmem_magic.show.tensorboard import require_tensorboard

        require_tensorboard()
        if tensorboard.exists() and not tensorboard.is_dir():
            raise TfmemUsageError(f"--tensorboard {ns.tensorboard!r} is a file: give a folder (TensorBoard's logdir)")
    options = Options(
        mode=ns.mode or "trace",
        label=ns.label,
        interval_ms=ns.interval,
        limit_bytes=limit,
        preflight=ns.preflight,
        calibrate=ns.calibrate,
        trace_steps=ns.trace_steps,
        trace_seconds=ns.trace_seconds,
        keep_xspaces=tensorboard is not None,
    )
    fix_id = getattr(ns, "fix", None)
    before = getattr(ns, "before", None)
    if fix_id is not None:
        from tfmem_magic.advise.fixes import WRITERS

        if fix_id not in WRITERS:
            raise TfmemUsageError(f"--fix {fix_id!r}: not a fix id; use one of {', '.join(WRITERS)}")
        if before is None:
            raise TfmemUsageError(f"--fix {fix_id} needs --before N: the report whose prediction it checks")
    return CellArgs(
        options=options,
        as_name=as_name,
        save=save,
        panel=not getattr(ns, "no_panel", False),
        before=before,
        fix_id=fix_id,
        tensorboard=tensorboard,
    )


def write_outputs(report: Report, args: CellArgs, xspaces: list[Any] | None = None) -> list[str]:
    """--save and --tensorboard: the files a measurement writes besides what it shows; lines saying where."""
    said = []
    if args.save is not None:
        save_report(report, args.save)
    if args.tensorboard is not None:
        from tfmem_magic.show.tensorboard import summary_line, write

        try:
            said.append(summary_line(write(report, args.tensorboard, xspaces if xspaces is not None else [])))
        except Exception as exc:  # noqa: BLE001 - the cell ran and its report stands: a logdir we cannot write only says so
            fallback(_log, "the TensorBoard logdir could not be written", exc)
            said.append(f"TensorBoard: could not write to {args.tensorboard} ({type(exc).__name__}: {exc})")
    return said

"""IPython adapter: `%%tfmem` (measure a cell) and `%tfmem` (status, history, last). Parsing, measuring and
rendering live in the core; this module only connects them to the shell."""

from __future__ import annotations

from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.display import display

from . import engine, environment, guard
from .errors import TfmemUsageError
from .figures import timeline_png
from .options import build_parser, parse_cell_args, save_report
from .render import mime_bundle
from .report import Report
from .sizes import format_bytes, parse_size

LINE_COMMANDS = {
    "status": "what the extension sees: allocator, budget, TensorFlow state",
    "limit": "limit SIZE [--keep-onednn] | limit off: a memory limit for every cell (set before TensorFlow's "
             "first op, it also caps TensorFlow's allocator)",
    "history": "one line per profiled cell of this session",
    "last": "show the last report again",
    "help": "this list and the %%tfmem options",
}


@magics_class
class TfmemMagics(Magics):
    @line_cell_magic
    def tfmem(self, line: str, cell: str | None = None) -> Any:
        """%%tfmem [options]: run the cell and report its memory. %tfmem status|history|last|help."""
        if cell is None:
            return self._line(line.strip())
        return self._cell(line, cell)

    # ---- %%tfmem ------------------------------------------------------------------------------------------------
    def _cell(self, line: str, cell: str) -> None:
        try:
            args = parse_cell_args(line)
        except TfmemUsageError as exc:
            raise UsageError(str(exc)) from None
        shell = self.shell
        profiler = engine.Profiler(args.options)
        hook = shell.displayhook
        outer = hook.exec_result  # the ExecutionResult of the cell that holds this magic
        profiler.start()
        # IPython decides `;`-silencing from the last history entry, which is the magic call, not this body
        had_quiet = "quiet" in vars(hook)
        hook.quiet = lambda: hook.semicolon_at_end_of_expression(cell)
        error: BaseException | None = None
        try:
            # run_cell, not exec: the last expression is displayed, tracebacks are the user's own
            result = shell.run_cell(cell, store_history=False)
            error = result.error_before_exec or result.error_in_exec
        except BaseException as exc:  # run_cell itself failed (rare): still stop the probes
            error = exc
            raise
        finally:
            hook.exec_result = outer
            if not had_quiet:
                del hook.quiet
            report = profiler.finish(error)
        self._publish(report, args)
        if error is not None and outer is not None:
            # the traceback is already shown: mark the outer cell failed (kernel reply, nbclient) without a second one
            outer.error_in_exec = error

    def _publish(self, report: Report, args: Any) -> None:
        if args.as_name:
            self.shell.user_ns[args.as_name] = report
        if args.save is not None:
            save_report(report, args.save)
        self._show(report, panel=args.panel)

    def _show(self, report: Report, panel: bool = True) -> None:
        """The static report (kept in saved notebooks), then the live panel where a kernel serves widgets."""
        timeline = timeline_png(report)  # one rendering serves both
        display(mime_bundle(report, timeline), raw=True)
        if panel and getattr(self.shell, "kernel", None) is not None:
            from .panel import build_panel

            display(build_panel(report, timeline))

    # ---- %tfmem -----------------------------------------------------------------------------------------------
    def _line(self, command: str) -> Any:
        word = command.split()[0] if command else "help"
        if word == "status":
            print(status_text())
        elif word == "limit":
            print(limit_command(command.split()[1:]))
        elif word == "history":
            print(history_text())
        elif word == "last":
            report = engine.last_report()
            if report is None:
                raise UsageError("%tfmem last: no cell has been profiled yet; put %%tfmem on the first line of a cell")
            self._show(report)
        elif word in ("help", "-h", "--help"):
            print(help_text())
        else:
            choices = ", ".join(LINE_COMMANDS)
            raise UsageError(f"%tfmem {word}: unknown command; use one of {choices}, or %%tfmem on a cell")


def limit_command(words: list[str]) -> str:
    keep_onednn = "--keep-onednn" in words
    words = [w for w in words if w != "--keep-onednn"]
    if len(words) != 1:
        current = guard.session_limit()
        state = f"now {format_bytes(current.bytes)}" if current else "none is set"
        raise UsageError(f"%tfmem limit: give a size such as 6GB or 512MiB, or 'off' ({state})")
    if words[0] == "off":
        return guard.clear_session_limit()
    try:
        size = parse_size(words[0])
    except TfmemUsageError as exc:
        raise UsageError(f"%tfmem limit: {exc}") from None
    return guard.set_session_limit(size, keep_onednn=keep_onednn)[1]


def help_text() -> str:
    commands = "\n".join(f"  %tfmem {name:<8} {what}" for name, what in LINE_COMMANDS.items())
    return f"{commands}\n\n{build_parser().format_help()}"


def status_text() -> str:
    setup = environment.allocator_setup()
    view = environment.allocator_view()
    budget = environment.memory_budget()
    lines = [
        f"TensorFlow   {'imported' if environment.tensorflow_imported() else 'not imported yet'}"
        f"{', running' if environment.tensorflow_initialized() else ''}",
        f"Allocator    {view.name}{' (sees every allocation)' if view.complete else ''}"
        f"{'; BFC switched on by tfmem' if setup.bfc_set_by_us else ''}",
        f"Budget       {format_bytes(budget.budget_bytes)} ({budget.budget_source}); RAM "
        f"{format_bytes(budget.ram_total_bytes)}, available {format_bytes(budget.ram_available_bytes)}"
        + (f", container limit {format_bytes(budget.cgroup_limit_bytes)}" if budget.cgroup_limit_bytes else ""),
        f"Reports      {len(engine.history)} this session",
    ]
    session = guard.session_limit()
    if session is not None:
        cap = guard.allocator_limit_bytes() or (session.allocator_mb * 2**20 if session.allocator_mb else None)
        lines.append(f"Limit        {format_bytes(session.bytes)} (%tfmem limit)"
                     + (f"; TensorFlow's allocator capped at {format_bytes(cap)}" if cap else ""))
    if view.note:
        lines.append(f"Note         {view.note}")
    return "\n".join(lines)


def history_text() -> str:
    if not engine.history:
        return "No cell has been profiled yet."
    rows = [f"{'#':>3}  {'label':<20} {'status':<11} {'mode':<5} {'TF peak +':>10} {'RSS peak':>10} {'time':>8}"]
    for i, r in enumerate(engine.history, 1):
        tf_peak = format_bytes(r.tf_peak_bytes) if r.tf else "n/a"
        rows.append(f"{i:>3}  {(r.label or '-')[:20]:<20} {r.status:<11} {r.mode:<5} {tf_peak:>10} "
                    f"{format_bytes(r.rss.peak_bytes):>10} {r.wall_s:>7.2f}s")
    return "\n".join(rows)


def load(ipython: Any) -> None:
    setup = environment.prepare_allocator()
    ipython.register_magics(TfmemMagics)
    if setup.loaded_after_first_op:
        note = environment.allocator_view().note
        if note:
            print(f"tfmem_magic: TensorFlow was already running when the extension loaded. {note}")

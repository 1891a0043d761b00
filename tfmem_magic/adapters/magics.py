"""IPython adapter: `%%tfmem` (measure a cell) and `%tfmem` (status, history, last). Parsing, measuring and
rendering live in the core; this module only connects them to the shell."""

from __future__ import annotations

import hashlib
import sys
import types
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.display import display

from tfmem_magic import pipeline
from tfmem_magic.adapters.arguments import build_parser, parse_cell_args, write_outputs
from tfmem_magic.advise import fixes
from tfmem_magic.core.errors import TfmemUsageError
from tfmem_magic.core.report import Report
from tfmem_magic.core.session import SESSION
from tfmem_magic.core.sizes import format_bytes, parse_size
from tfmem_magic.measure import capabilities, environment, guard, release
from tfmem_magic.measure.sampling import AllocatorStats
from tfmem_magic.measure.tracer import remove_leftovers
from tfmem_magic.show import frontend
from tfmem_magic.show.figures import timeline_png
from tfmem_magic.show.render import compare_html, compare_text, mime_bundle, watch_html, watch_line
from tfmem_magic.show.view import view_of

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell

LINE_COMMANDS = {
    "watch": "watch on [--interval MS] | watch off: profile every cell in quick mode, one line each",
    "compare": "compare A B: two reports side by side (history numbers, labels, or names bound with --as)",
    "status": "what the extension sees: allocator, budget, TensorFlow state",
    "limit": "limit SIZE [--keep-onednn] | limit off: a memory limit for every cell (set before TensorFlow's "
             "first op, it also caps TensorFlow's allocator)",
    "history": "one line per profiled cell of this session",
    "fix": "fix [K|ID] [--report N]: put fix K (or the fix with that id) of the last report (or report N) into "
           "the next cell; no argument lists the fixes",
    "last": "show the last report again",
    "capture": "capture HOST:PORT[,HOST:PORT...] [--seconds S] [--logdir DIR] [--as NAME]: trace every worker of a "
               "training job at once (each started with tfmem_magic.serve(PORT)) and show them side by side",
    "cluster": "cluster DIR [--as NAME]: the same side-by-side view from the reports the workers saved in DIR",
    "free": "free [NAME ...]: drop those names, clear the Keras session and the traced gradients TensorFlow keeps "
            "for models that are gone, say what its allocator gave back (no restart) and which names still hold "
            "TensorFlow memory",
    "help": "this list and the %%tfmem options",
}


@magics_class
class TfmemMagics(Magics):
    shell: InteractiveShell  # Magics allows None; load() registers this class with the running shell

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
        before = resolve_report(shell, args.before, "--before") if args.before else None  # fail before running
        profiler = pipeline.Profiler(replace(args.options, cell_key=cell_key(shell, cell), source=cell,
                                           namespace=shell.user_ns))
        hook = shell.displayhook
        outer = hook.exec_result  # the ExecutionResult of the cell that holds this magic
        try:
            profiler.start()  # all or nothing: a failure leaves nothing of tfmem armed
        except TfmemUsageError as exc:  # e.g. a --limit the process already passes: the cell does not run
            raise UsageError(str(exc)) from None
        except Exception as exc:  # our failure must not cost the user their cell: run it unmeasured
            print(f"tfmem could not start measuring ({type(exc).__name__}: {exc}); the cell runs unmeasured.",
                  file=sys.stderr)
            shell.run_cell(cell, store_history=False)
            hook.exec_result = outer
            return
        # IPython decides `;`-silencing from the last history entry, which is the magic call, not this body
        had_quiet = "quiet" in vars(hook)
        hook.quiet = lambda: hook.semicolon_at_end_of_expression(cell)  # type: ignore[method-assign]  # undone below
        error: BaseException | None = None
        show_traceback, own_showtraceback = shell.showtraceback, vars(shell).get("showtraceback")

        def showtraceback(exc_tuple: Any = None, *rest: Any, **kwargs: Any) -> Any:
            etype, value, tb = exc_tuple or sys.exc_info()
            clean = profiler.untangle(value)  # the guard's exception, not pybind11's RuntimeError tangle
            shown = numbered_traceback(tb)
            with profiler.showing_error(value):  # a second press of stop must not cut the display short
                if clean is value and shown is tb:
                    return show_traceback(exc_tuple, *rest, **kwargs)
                assert clean is not None  # untangle gives None only for None, and then tb and shown are None too
                return show_traceback((type(clean), clean, shown), *rest, **kwargs)

        shell.showtraceback = showtraceback  # type: ignore[method-assign]  # on the instance, for this cell only
        try:
            # run_cell, not exec: the last expression is displayed, tracebacks are the user's own
            with profiler.user_code():
                result = shell.run_cell(cell, store_history=False)
            error = profiler.untangle(result.error_before_exec or result.error_in_exec)
            if error is None:
                error = profiler.swallowed_stop()  # stop was pressed and the cell's code swallowed it
                if error is not None:
                    showtraceback((KeyboardInterrupt, error, None))
        except BaseException as exc:  # run_cell itself failed (rare): still stop the instruments
            error = exc
            raise
        finally:
            if own_showtraceback is None:
                del shell.showtraceback  # the class's own method again
            else:
                shell.showtraceback = own_showtraceback  # type: ignore[method-assign]  # an earlier instance patch, put back
            hook.exec_result = outer
            if not had_quiet:
                del hook.quiet
            report = profiler.finish(error)
        if before is not None:
            report.before = fixes.before_after(before, report, args.fix_id, since=SESSION.history)
        self._publish(report, args, profiler.xspaces)
        if error is not None and outer is not None:
            # the traceback is already shown: mark the outer cell failed (kernel reply, nbclient) without a second one
            outer.error_in_exec = error

    def _publish(self, report: Report, args: Any, xspaces: list | None = None) -> None:
        if args.as_name:
            self.shell.user_ns[args.as_name] = report
        said = write_outputs(report, args, xspaces)
        self._show(report, panel=args.panel)
        for line in said:
            print(line)

    def _show(self, report: Report, panel: bool = True) -> None:
        """The static report (kept in saved notebooks), then the live panel where a kernel serves widgets."""
        timeline = timeline_png(report)  # one rendering, and one view of the report, serve both
        view = view_of(report)
        display(mime_bundle(report, timeline, view), raw=True)
        if panel and getattr(self.shell, "kernel", None) is not None:
            from tfmem_magic.show.panel import build_panel

            display(build_panel(report, timeline, frontend.current_cell_id(self.shell), view))

    # ---- %tfmem -----------------------------------------------------------------------------------------------
    def _fix(self, words: list[str]) -> None:
        """`%tfmem fix [K|ID] [--report N]`: the fix's code becomes the next cell (set_next_input), never run."""
        report = pipeline.last_report()
        if "--report" in words:
            at = words.index("--report")
            if at + 1 >= len(words):
                raise UsageError("%tfmem fix --report N: give a report number from %tfmem history")
            report = resolve_report(self.shell, words[at + 1], "%tfmem fix --report")
            words = words[:at] + words[at + 2:]
        if report is None:
            raise UsageError("%tfmem fix: no cell has been profiled yet; put %%tfmem on the first line of a cell")
        if not report.fixes:
            print(f"Report {report.number} has no fix to suggest.")
            return
        if not words:
            for i, each in enumerate(report.fixes, 1):
                print(f"{i}. [{each.id}] {each.title}: {each.why}")
            print(f"%tfmem fix K puts fix K into the next cell (report {report.number}).")
            return
        key = words[0]
        fix = (report.fixes[int(key) - 1] if key.isdigit() and 1 <= int(key) <= len(report.fixes)
               else next((f for f in report.fixes if f.id == key), None))
        if fix is None:
            choices = ", ".join(f"{i} ({f.id})" for i, f in enumerate(report.fixes, 1))
            raise UsageError(f"%tfmem fix {key}: report {report.number} has fixes {choices}")
        self.shell.set_next_input(fix.code, replace=False)
        where = "Put it at the top of the notebook and restart the kernel." if fix.needs_restart else ""
        print(f"Fix [{fix.id}] is in the next cell: read it, then run it. {where}".strip())

    def _free(self, names: list[str]) -> None:
        try:
            done = release.free(self.shell.user_ns, names)
        except KeyError as unknown:  # checked before anything is dropped
            raise UsageError(f"%tfmem free: no variable named {unknown.args[0]} in the notebook; give the names that "
                             "hold the models or tensors to drop (or none, to drop only what nothing holds)") from None
        print(done.text())

    def _cluster(self, word: str, words: list[str]) -> None:
        from tfmem_magic.show.cluster_render import cluster_html, cluster_text

        args = cluster_arguments(word, words)
        try:
            view = (pipeline.capture(args.target, args.seconds, args.logdir) if word == "capture"
                    else pipeline.cluster_from(args.target))
        except TfmemUsageError as exc:
            raise UsageError(f"%tfmem {word}: {exc}") from None
        if args.name:
            self.shell.user_ns[args.name] = view
        display({"text/plain": cluster_text(view), "text/html": cluster_html(view)}, raw=True)
        if getattr(self.shell, "kernel", None) is not None:  # the live panel: a worker selector over full panels
            from tfmem_magic.show.panel import cluster_panel

            display(cluster_panel(view))

    def _watch(self, words: list[str]) -> str:
        if words[:1] == ["on"]:
            interval = 50.0
            if words[1:2] == ["--interval"] and len(words) == 3:
                try:
                    interval = float(words[2])
                except ValueError:
                    raise UsageError(f"%tfmem watch on --interval {words[2]!r}: give milliseconds, e.g. 100") from None
            elif len(words) != 1:
                raise UsageError("%tfmem watch on [--interval MS]")
            if SESSION.watcher is not None:
                SESSION.watcher.stop()
            try:
                SESSION.watcher = Watcher(self.shell, pipeline.Options(mode="quick", interval_ms=interval))
            except TfmemUsageError as exc:
                raise UsageError(f"%tfmem watch: {exc}") from None
            return ("Watching every cell (quick mode): one line of memory figures below each. "
                    "%%tfmem cells keep their own report. %tfmem watch off to stop.")
        if words == ["off"]:
            if SESSION.watcher is None:
                return "Watch mode was not on."
            SESSION.watcher.stop()
            SESSION.watcher = None
            return "Watch mode off: no hook is left on the shell."
        raise UsageError("%tfmem watch on [--interval MS] | %tfmem watch off")

    def _line(self, command: str) -> Any:
        word = command.split()[0] if command else "help"
        if word == "status":
            print(status_text())
        elif word == "watch":
            print(self._watch(command.split()[1:]))
        elif word == "compare":
            a, b = (resolve_report(self.shell, w) for w in _two(command.split()[1:]))
            display({"text/plain": compare_text(a, b), "text/html": compare_html(a, b)}, raw=True)
        elif word == "fix":
            self._fix(command.split()[1:])
        elif word == "limit":
            print(limit_command(command.split()[1:]))
        elif word == "history":
            print(history_text())
        elif word == "last":
            report = pipeline.last_report()
            if report is None:
                raise UsageError("%tfmem last: no cell has been profiled yet; put %%tfmem on the first line of a cell")
            self._show(report)
        elif word in ("capture", "cluster"):
            self._cluster(word, command.split()[1:])
        elif word == "free":
            self._free(command.split("#", 1)[0].split()[1:])  # a comment after the names is not a name
        elif word in ("help", "-h", "--help"):
            print(help_text())
        else:
            choices = ", ".join(LINE_COMMANDS)
            raise UsageError(f"%tfmem {word}: unknown command; use one of {choices}, or %%tfmem on a cell")


def cluster_arguments(word: str, words: list[str]) -> Any:
    """The arguments of %tfmem capture / %tfmem cluster; a UsageError that names the fix for anything else."""
    import argparse

    parser = argparse.ArgumentParser(prog=f"%tfmem {word}", add_help=False, exit_on_error=False)
    parser.add_argument("target")
    parser.add_argument("--as", dest="name")
    if word == "capture":
        parser.add_argument("--seconds", type=float, default=2.0)
        parser.add_argument("--logdir")
    try:
        args, extra = parser.parse_known_args(words)
    except (argparse.ArgumentError, SystemExit) as exc:
        raise UsageError(f"%tfmem {LINE_COMMANDS[word]} ({exc})") from None
    if extra:
        raise UsageError(f"%tfmem {word}: unknown {' '.join(extra)}; usage: %tfmem {LINE_COMMANDS[word]}")
    return args


def _two(words: list[str]) -> list[str]:
    if len(words) != 2:
        raise UsageError("%tfmem compare A B: give two reports: history numbers (%tfmem history), labels, or "
                         "names bound with %%tfmem --as NAME")
    return words


def resolve_report(shell: Any, ref: str, what: str = "%tfmem compare") -> Report:
    """A report by history number (%tfmem history), by a name in the namespace, or by label (newest first)."""
    reports = list(SESSION.history)
    if ref.isdigit():
        for report in reports:
            if report.number == int(ref):
                return report
    value = shell.user_ns.get(ref)
    if isinstance(value, Report):
        return value
    for report in reversed(reports):
        if report.label == ref:
            return report
    numbers = f"{reports[0].number}-{reports[-1].number}" if reports else "none yet"
    raise UsageError(f"{what}: no report {ref!r}; use a number from %tfmem history ({numbers}), "
                     "a label, or a name bound with --as")


def numbered_traceback(tb: types.TracebackType | None) -> types.TracebackType | None:
    """`tb`, with a line number on every entry. A Ctrl-C that lands on an instruction without a line (Python 3.11+)
    leaves `tb_lineno` None, and IPython's traceback formatter then fails on an assert: the user would see
    IPython's internal error instead of their KeyboardInterrupt, and the kernel would not report the cell failed."""
    entries = []
    while tb is not None:
        entries.append(tb)
        tb = tb.tb_next
    if all(isinstance(entry.tb_lineno, int) for entry in entries):
        return entries[0] if entries else None
    rebuilt = None
    for entry in reversed(entries):
        line = entry.tb_lineno
        if not isinstance(line, int):  # the frame's current line, else the function's first line
            line = entry.tb_frame.f_lineno if isinstance(entry.tb_frame.f_lineno, int) else \
                entry.tb_frame.f_code.co_firstlineno
        rebuilt = types.TracebackType(rebuilt, entry.tb_frame, entry.tb_lasti, line)
    return rebuilt


def cell_key(shell: Any, source: str, cell_id: str | None = None) -> str:
    """The same cell across re-runs: Jupyter's cell id (given, or sent by the front end), else the source's hash."""
    cell_id = cell_id or frontend.current_cell_id(shell)
    return f"cell:{cell_id}" if cell_id else "source:" + hashlib.sha1(source.encode()).hexdigest()[:16]


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
    try:
        return guard.set_session_limit(size, keep_onednn=keep_onednn)[1]
    except TfmemUsageError as exc:  # a limit the process already passes
        raise UsageError(str(exc)) from None


def help_text() -> str:
    commands = "\n".join(f"  %tfmem {name:<8} {what}" for name, what in LINE_COMMANDS.items())
    return f"{commands}\n\n{build_parser().format_help()}"


def status_text() -> str:
    setup = environment.allocator_setup()
    view = environment.allocator_view()
    budget = environment.memory_budget()
    found = environment.versions()
    imported = environment.tensorflow_imported()
    lines = [
        f"TensorFlow   {(found['tensorflow'] or 'imported') if imported else 'not imported yet'}"
        f"{', running' if environment.tensorflow_initialized() else ''}",
        f"Keras        {keras_line(found)}",
        f"Allocator    {view.name}{' (sees every allocation)' if view.complete else ''}"
        f"{'; BFC switched on by tfmem' if setup.bfc_set_by_us else ''}",
        f"Budget       {format_bytes(budget.budget_bytes)} ({budget.budget_source}); RAM "
        f"{format_bytes(budget.ram_total_bytes)}, available {format_bytes(budget.ram_available_bytes)}"
        + (f", container limit {format_bytes(budget.cgroup_limit_bytes)}" if budget.cgroup_limit_bytes else ""),
        f"Reports      {len(SESSION.history)} this session",
    ]
    session = guard.session_limit()
    if session is not None:
        cap = guard.allocator_limit_bytes() or (session.allocator_mb * 2**20 if session.allocator_mb else None)
        lines.append(f"Limit        {format_bytes(session.bytes)} (%tfmem limit)"
                     + (f"; TensorFlow's allocator capped at {format_bytes(cap)}" if cap else ""))
    if view.note:
        lines.append(f"Note         {view.note}")
    lines += capabilities_lines()
    return "\n".join(lines)


def keras_line(found: dict) -> str:
    """Which Keras `tf.keras` is, and its version."""
    if found["keras_package"] == "tf_keras":
        return f"tf_keras {found['keras'] or '(not imported yet)'}: tf.keras is Keras 2 (TF_USE_LEGACY_KERAS=1)"
    return f"Keras 3 {found['keras'] or '(not imported yet)'}"


def capabilities_lines() -> list[str]:
    """The private APIs tfmem relies on (measure/capabilities.py): how many are there, each one missing with what
    degrades, and those not checked yet (the Keras they belong to is not imported)."""
    if not environment.tensorflow_imported():
        return ["Capabilities checked once TensorFlow is imported"]
    absent, done, waiting = capabilities.missing(), capabilities.judged(), capabilities.pending()
    names = ", ".join(c.name for c in done if c not in absent)
    if not absent:
        lines = [f"Capabilities all {len(done)} available on {capabilities.versions_text()}: {names}"]
    else:
        lines = [f"Capabilities {len(done) - len(absent)} of {len(done)} available on "
                 f"{capabilities.versions_text()}: {names or 'none'}"]
        lines += [f"Capability   {c.name}: {capabilities.unavailable_text(c)}: {c.degraded}" for c in absent]
    if waiting:
        needs = " or ".join(sorted({c.needs for c in waiting}))
        lines.append(f"Capabilities checked when {needs} is imported: " + ", ".join(c.name for c in waiting))
    return lines


def history_text() -> str:
    if not SESSION.history:
        return "No cell has been profiled yet."
    rows = [f"{'#':>3}  {'label':<20} {'status':<11} {'mode':<5} {'run':>3} {'TF peak +':>10} {'TF left':>9} "
            f"{'RSS peak':>10} {'RSS +':>9} {'time':>8}  findings"]
    for r in SESSION.history:
        i = r.number
        mem = r.main_device
        tf_peak = format_bytes(r.tf_peak_bytes) if mem else "n/a"
        delta = mem.end_bytes - mem.baseline_bytes if mem else 0
        left = "n/a" if mem is None else format_bytes(delta) if delta >= 0 else "-" + format_bytes(-delta)
        warnings = " ".join(f.id for f in r.findings if f.severity != "info")
        rows.append(f"{i:>3}  {(r.label or '-')[:20]:<20} {r.status:<11} {r.mode:<5} {r.run:>3} {tf_peak:>10} "
                    f"{left:>9} {format_bytes(r.rss.peak_bytes):>10} "
                    f"{format_bytes(r.rss.peak_bytes - r.rss.baseline_bytes):>9} {r.wall_s:>7.2f}s  {warnings}")
    return "\n".join(rows)


class Watcher:
    """Watch mode: a quick measurement around every cell, through IPython's pre/post_run_cell events.

    Cells that start with %%tfmem are skipped (they report themselves), and so are the inner runs of the magic
    (a measurement is already active then). Events come in nested pairs, hence the stack.
    """

    def __init__(self, shell: Any, options: pipeline.Options) -> None:
        self.shell, self.options = shell, options
        self._stack: list[pipeline.Profiler | None] = []
        self._own_showtraceback: list[Any] = []  # per measured cell: an instance showtraceback set before ours
        shell.events.register("pre_run_cell", self.pre)
        shell.events.register("post_run_cell", self.post)

    def pre(self, info: Any) -> None:
        raw = getattr(info, "raw_cell", "") or ""
        if raw.lstrip().startswith("%%tfmem") or raw.lstrip().startswith("%tfmem watch") or \
                AllocatorStats.nesting_depth() > 0:
            self._stack.append(None)
            return
        key = cell_key(self.shell, raw, getattr(info, "cell_id", None))
        label = next((line.strip() for line in raw.splitlines() if line.strip()), "")[:40]
        profiler = pipeline.Profiler(replace(self.options, label=label, cell_key=key))
        try:
            profiler.start()
        except Exception:  # never in the way of the user's cell: this one goes unwatched
            self._stack.append(None)
            return
        profiler.enter_user_code()
        self._stack.append(profiler)
        show = self.shell.showtraceback
        self._own_showtraceback.append(vars(self.shell).get("showtraceback"))

        def showtraceback(*args: Any, **kwargs: Any) -> Any:  # a second press of stop must not cut it short
            with profiler.showing_error(sys.exc_info()[1] if not args or args[0] is None else args[0][1]):
                return show(*args, **kwargs)

        self.shell.showtraceback = showtraceback

    def post(self, result: Any) -> None:
        if not self._stack:
            return  # the cell that turned watch mode on
        profiler = self._stack.pop()
        if profiler is None:
            return
        self._restore_showtraceback()
        report = profiler.finish(result.error_before_exec or result.error_in_exec)
        display({"text/plain": watch_line(report), "text/html": watch_html(report)}, raw=True)

    def _restore_showtraceback(self) -> None:
        own = self._own_showtraceback.pop() if self._own_showtraceback else None
        if own is None:
            vars(self.shell).pop("showtraceback", None)  # the class's own method again
        else:
            self.shell.showtraceback = own

    def stop(self) -> None:
        self.shell.events.unregister("pre_run_cell", self.pre)
        self.shell.events.unregister("post_run_cell", self.post)
        for profiler in self._stack:  # the cell running `watch off` was being measured: end that cleanly
            if profiler is not None:
                self._restore_showtraceback()
                profiler.finish(None)
        self._stack.clear()


def load(ipython: Any) -> None:
    setup = environment.prepare_allocator()
    remove_leftovers()  # trace folders of kernels that were killed
    # the private APIs, probed once: those of what is imported now (nothing is imported for it), the rest when
    # TensorFlow or a Keras is (capabilities.check, at the first report or %tfmem status after); answers are kept
    absent = capabilities.missing()
    ipython.register_magics(TfmemMagics)
    if absent:
        print(f"tfmem_magic: {len(absent)} of the private APIs it reads are missing here "
              f"({', '.join(c.name for c in absent)}): what each costs is in %tfmem status and in every report.")
    if setup.loaded_after_first_op:
        note = environment.allocator_view().note
        if note:
            print(f"tfmem_magic: TensorFlow was already running when the extension loaded. {note}")

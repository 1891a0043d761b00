"""IPython adapter: `%%tfmem` (measure a cell), the `%tfmem` commands of COMMANDS, and watch mode. Parsing,
measuring and rendering live in the layers below; this module only connects them to the shell."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.display import display

from tfmem_magic import pipeline
from tfmem_magic.adapters.arguments import CellArgs, build_parser, parse_cell_args, write_outputs
from tfmem_magic.advise import fixes, probe_runs
from tfmem_magic.analyze import lines
from tfmem_magic.core.errors import TfmemUsageError
from tfmem_magic.core.fallbacks import fallback
from tfmem_magic.core.report import Report
from tfmem_magic.core.session import CALIBRATE_MODES, HISTORY_BYTES, HISTORY_SIZE, SESSION, WHOLE_REPORTS
from tfmem_magic.core.sizes import format_bytes, parse_size
from tfmem_magic.core.types import IPythonShell
from tfmem_magic.measure import capabilities, code_sites, environment, guard, kerases, release
from tfmem_magic.measure.cells import cell_key, cell_label, watched
from tfmem_magic.measure.tracer import remove_leftovers
from tfmem_magic.show import frontend
from tfmem_magic.show.figures import timeline_png
from tfmem_magic.show.render import compare_html, compare_text, mime_bundle, watch_html, watch_line
from tfmem_magic.show.status import fallbacks_text, fixes_text, history_text, status_text
from tfmem_magic.show.tracebacks import number_chained, numbered_traceback
from tfmem_magic.show.view import view_of

_log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from IPython.core.interactiveshell import ExecutionInfo, ExecutionResult, InteractiveShell

    from tfmem_magic.analyze.cluster import ClusterView

NOTHING_YET = "no cell has been profiled yet; put %%tfmem on the first line of a cell"


@dataclass(frozen=True)
class Command:
    """One `%tfmem` command: the dispatch, `%tfmem help` and the README's table all come from COMMANDS."""

    usage: str  # what follows `%tfmem`
    help: str  # one line
    run: Callable[[TfmemMagics, list[str]], object]  # gets the words after the name; returns what -o gives back
    returns: str = ""  # what -o gives back, for the help; empty: the command takes no -o


@magics_class
class TfmemMagics(Magics):
    shell: InteractiveShell  # Magics allows None; load() registers this class with the running shell

    @line_cell_magic
    def tfmem(self, line: str, cell: str | None = None) -> object:
        """%%tfmem [options]: run the cell and report its memory. %tfmem COMMAND [-o]: see %tfmem help."""
        if cell is None:
            return self._line(line)
        self._cell(line, cell)
        return None

    # ---- %%tfmem ------------------------------------------------------------------------------------------------
    def _cell(self, line: str, cell: str) -> None:
        shell = self.shell
        try:
            args = parse_cell_args(line)
            before = resolve_report(args.before, "--before", shell.user_ns) if args.before else None  # fail first
        except TfmemUsageError as exc:
            raise UsageError(str(exc)) from None
        profiler = pipeline.Profiler(
            replace(
                args.options,
                cell_key=cell_key(cell, frontend.current_cell_id(shell)),
                source=cell,
                namespace=shell.user_ns,
            )
        )
        hook = shell.displayhook
        outer = hook.exec_result  # the ExecutionResult of the cell that holds this magic
        try:
            profiler.start()  # all or nothing: a failure leaves nothing of tfmem armed
        except TfmemUsageError as exc:  # e.g. a --limit the process already passes: the cell does not run
            raise UsageError(str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - our failure must not cost the user their cell: run it unmeasured
            fallback(_log, "measuring could not start: the cell runs unmeasured", exc)
            print(
                f"tfmem could not start measuring ({type(exc).__name__}: {exc}); the cell runs unmeasured.",
                file=sys.stderr,
            )
            shell.run_cell(cell, store_history=False)  # type: ignore[no-untyped-call]
            hook.exec_result = outer
            return
        # IPython decides `;`-silencing from the last history entry, which is the magic call, not this body
        had_quiet = "quiet" in vars(hook)
        hook.quiet = lambda: hook.semicolon_at_end_of_expression(cell)  # type: ignore[method-assign,no-untyped-call]
        error: BaseException | None = None
        restore_showtraceback = show_tracebacks_through(shell, profiler, repair=True)
        files = set(lines.cell_numbers())
        try:
            # run_cell, not exec: the last expression is displayed, tracebacks are the user's own
            with profiler.user_code():
                result = shell.run_cell(cell, store_history=False)  # type: ignore[no-untyped-call]
            error = profiler.untangle(result.error_before_exec or result.error_in_exec)
            if error is None:
                error = profiler.swallowed_stop()  # stop was pressed and the cell's code swallowed it
                if error is not None:
                    shell.showtraceback((KeyboardInterrupt, error, None))
        except BaseException as exc:  # run_cell itself failed (rare): still stop the instruments
            error = exc
            raise
        finally:
            restore_showtraceback()
            hook.exec_result = outer
            lines.note_cell_body(files, getattr(outer, "execution_count", None))
            if not had_quiet:
                del hook.quiet
            report = profiler.finish(error)
        if before is not None:
            report.before = fixes.before_after(before, report, args.fix_id, since=SESSION.history)
        self._publish(report, args, profiler.xspaces)
        if error is not None and outer is not None:
            # the traceback is already shown: mark the outer cell failed (kernel reply, nbclient) without a second one
            outer.error_in_exec = error

    def _publish(self, report: Report, args: CellArgs, xspaces: list[Any] | None = None) -> None:
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
        bundle = mime_bundle(report, timeline, view)
        _display(bundle, raw=True)
        _slim_older(bundle)
        if panel and getattr(self.shell, "kernel", None) is not None:
            from tfmem_magic.show.panel import build_panel, keep_live

            panel = build_panel(report, timeline, frontend.current_cell_id(self.shell), view)
            _display(panel)
            keep_live(report, panel)  # older panels are closed: ipywidgets keeps them otherwise

    # ---- %tfmem -----------------------------------------------------------------------------------------------
    def _line(self, line: str) -> object:
        words = line.split("#", 1)[0].split()  # a comment after the command is not an argument
        wants_object = "-o" in words  # IPython's convention (%timeit -o): return the result, not only show it
        words = [w for w in words if w != "-o"]
        name = {"-h": "help", "--help": "help"}.get(words[0], words[0]) if words else "help"
        command = COMMANDS.get(name)
        if command is None:
            raise UsageError(f"%tfmem {name}: unknown command; use one of {', '.join(COMMANDS)}, or %%tfmem on a cell")
        if wants_object and not command.returns:
            giving = ", ".join(n for n, c in COMMANDS.items() if c.returns)
            raise UsageError(f"%tfmem {name} has no object to return with -o; these do: {giving}")
        try:
            result = command.run(self, words[1:])
        except TfmemUsageError as exc:  # the command's own message names the fix; it gets the command's name
            said = str(exc)
            raise UsageError(said if said.startswith("%") else f"%tfmem {name}: {said}") from None
        return result if wants_object else None  # without -o nothing is returned, so nothing shows twice

    def _status(self, words: list[str]) -> None:
        if words and words != ["--log"]:
            raise TfmemUsageError(f"unknown {' '.join(words)}; usage: %tfmem {COMMANDS['status'].usage}")
        print(fallbacks_text() if words else status_text())

    def _history(self, words: list[str]) -> list[Report]:
        print(history_text(SESSION.history))
        return list(SESSION.history)

    def _last(self, words: list[str]) -> Report:
        report = pipeline.last_report()
        if report is None:
            raise TfmemUsageError(NOTHING_YET)
        self._show(report)
        return report

    def _compare(self, words: list[str]) -> tuple[Report, Report]:
        if len(words) != 2:
            raise TfmemUsageError(
                "%tfmem compare A B: give two reports: history numbers (%tfmem history), labels, "
                "or names bound with %%tfmem --as NAME"
            )
        a, b = (resolve_report(word, "%tfmem compare", self.shell.user_ns) for word in words)
        _display({"text/plain": compare_text(a, b), "text/html": compare_html(a, b)}, raw=True)
        return a, b

    def _fix(self, words: list[str]) -> None:
        """`%tfmem fix [K|ID] [--report N]`: the fix's code becomes the next cell (set_next_input), never run."""
        report = pipeline.last_report()
        if "--report" in words:
            at = words.index("--report")
            if at + 1 >= len(words):
                raise TfmemUsageError("%tfmem fix --report N: give a report number from %tfmem history")
            report = resolve_report(words[at + 1], "%tfmem fix --report", self.shell.user_ns)
            words = words[:at] + words[at + 2 :]
        if report is None:
            raise TfmemUsageError(NOTHING_YET)
        if not words or not report.fixes:
            print(fixes_text(report))
            return
        key = words[0]
        fix = (
            report.fixes[int(key) - 1]
            if key.isdigit() and 1 <= int(key) <= len(report.fixes)
            else next((f for f in report.fixes if f.id == key), None)
        )
        if fix is None:
            choices = ", ".join(f"{i} ({f.id})" for i, f in enumerate(report.fixes, 1))
            raise TfmemUsageError(f"%tfmem fix {key}: report {report.number} has fixes {choices}")
        self.shell.set_next_input(fix.code, replace=False)
        where = "Put it at the top of the notebook and restart the kernel." if fix.needs_restart else ""
        print(f"Fix [{fix.id}] is in the next cell: read it, then run it. {where}".strip())

    def _limit(self, words: list[str]) -> None:
        keep_onednn = "--keep-onednn" in words
        words = [w for w in words if w != "--keep-onednn"]
        if len(words) != 1:
            current = guard.session_limit()
            state = f"now {format_bytes(current.bytes)}" if current else "none is set"
            raise TfmemUsageError(f"give a size such as 6GB or 512MiB, or 'off' ({state})")
        if words[0] == "off":
            print(guard.clear_session_limit())
            probe_runs.end_warm()  # no limit, no pre-flight to start probes ahead for
        else:  # a limit the process already passes is refused here, with one that would do
            print(guard.set_session_limit(parse_size(words[0]), keep_onednn=keep_onednn)[1])
            if guard.allocator_limit_bytes() is None and environment.tensorflow_initialized():
                probe_runs.warm_up(kerases.in_use())  # the cells' pre-flights will be on: their probes start now

    def _calibrate(self, words: list[str]) -> None:
        if len(words) != 1 or words[0] not in CALIBRATE_MODES:
            raise TfmemUsageError(f"%tfmem {COMMANDS['calibrate'].usage} (now {SESSION.calibrate})")
        SESSION.calibrate = words[0]
        cost = (
            ""
            if SESSION.calibrate == "off"
            else " (probe processes replay its step: seconds for a small model, minutes for a large one); "
            "--no-calibrate skips one cell"
        )
        print(
            f"Calibration {SESSION.calibrate}: what-ifs calibrated as their cell ends: "
            f"{CALIBRATE_MODES[SESSION.calibrate]}{cost}."
        )

    def _free(self, names: list[str]) -> release.Released:
        try:
            done = release.free(self.shell.user_ns, names)
        except KeyError as unknown:  # checked before anything is dropped
            raise TfmemUsageError(
                f"no variable named {unknown.args[0]} in the notebook; give the names that hold "
                "the models or tensors to drop (or none, to drop only what nothing holds)"
            ) from None
        print(done.text())
        return done

    def _cluster(self, word: str, words: list[str]) -> ClusterView:
        from tfmem_magic.show.cluster_render import cluster_html, cluster_text

        args = cluster_arguments(word, words)
        view: ClusterView = (
            pipeline.capture(args.target, args.seconds, args.logdir)
            if word == "capture"
            else pipeline.cluster_from(args.target)
        )
        if args.name:
            self.shell.user_ns[args.name] = view
        _display({"text/plain": cluster_text(view), "text/html": cluster_html(view)}, raw=True)
        if getattr(self.shell, "kernel", None) is not None:  # the live panel: a worker selector over full panels
            from tfmem_magic.show.panel import cluster_panel

            _display(cluster_panel(view))
        return view

    def _watch(self, words: list[str]) -> None:
        if words == ["off"]:
            watcher, SESSION.watcher = SESSION.watcher, None
            if watcher is not None:
                watcher.stop()
            print("Watch mode off: no hook is left on the shell." if watcher is not None else "Watch mode was not on.")
            return
        if not (words == ["on"] or (len(words) == 3 and words[:2] == ["on", "--interval"])):
            raise TfmemUsageError(f"%tfmem {COMMANDS['watch'].usage}")
        try:
            interval = float(words[2]) if len(words) == 3 else 50.0
        except ValueError:
            raise TfmemUsageError(f"%tfmem watch on --interval {words[2]!r}: give milliseconds, e.g. 100") from None
        # checked before the old watcher stops; never calibrated (%tfmem calibrate on is for %%tfmem cells: a
        # watched cell's line must stay near-free)
        options = pipeline.Options(mode="quick", interval_ms=interval, calibrate=False)
        if SESSION.watcher is not None:
            SESSION.watcher.stop()
        SESSION.watcher = Watcher(self.shell, options)
        print(
            "Watching every cell (quick mode): one line of memory figures below each. %%tfmem cells keep their "
            "own report. %tfmem watch off to stop."
        )

    def _help(self, words: list[str]) -> None:
        print(help_text())


COMMANDS: dict[str, Command] = {
    "status": Command(
        "status [--log]",
        "what the extension sees: allocator, budget, TensorFlow state, the history's caps, fallbacks taken (--log: "
        "the last ones)",
        TfmemMagics._status,
    ),
    "limit": Command(
        "limit SIZE [--keep-onednn] | limit off",
        "a memory limit for every cell (set before TensorFlow's first op, it also caps TensorFlow's allocator)",
        TfmemMagics._limit,
    ),
    "calibrate": Command(
        "calibrate auto | calibrate on | calibrate off",
        "which %%tfmem cells calibrate their "
        "what-if as they end (the step replay in two probe processes), as --calibrate does for one "
        "cell: auto (the default) those whose report names the largest batch that fits, on every "
        "cell that runs a Keras model, off none",
        TfmemMagics._calibrate,
    ),
    "watch": Command(
        "watch on [--interval MS] | watch off", "profile every cell in quick mode, one line each", TfmemMagics._watch
    ),
    "history": Command(
        "history",
        f"one line per profiled cell of this session (the newest {HISTORY_SIZE} reports, within "
        f"{format_bytes(HISTORY_BYTES)})",
        TfmemMagics._history,
        returns="the list of reports",
    ),
    "compare": Command(
        "compare A B",
        "two reports side by side (history numbers, labels, or names bound with --as)",
        TfmemMagics._compare,
        returns="the two reports",
    ),
    "fix": Command(
        "fix [K|ID] [--report N]",
        "put fix K (or the fix with that id) of the last report (or report N) "
        "into the next cell; no argument lists the fixes",
        TfmemMagics._fix,
    ),
    "last": Command("last", "show the last report again", TfmemMagics._last, returns="the report"),
    "free": Command(
        "free [NAME ...]",
        "drop those names, clear the Keras session and the traced gradients "
        "TensorFlow keeps for models that are gone, say what its allocator gave back (no restart) and "
        "which names still hold TensorFlow memory",
        TfmemMagics._free,
        returns="what was given back",
    ),
    "capture": Command(
        "capture HOST:PORT[,HOST:PORT...] [--seconds S] [--logdir DIR] [--as NAME]",
        "trace every "
        "worker of a training job at once (each started with tfmem_magic.serve(PORT)) and show them "
        "side by side",
        lambda magics, words: magics._cluster("capture", words),
        returns="the cluster view",
    ),
    "cluster": Command(
        "cluster DIR [--as NAME]",
        "the same side-by-side view from the reports the workers saved in DIR",
        lambda magics, words: magics._cluster("cluster", words),
        returns="the cluster view",
    ),
    "help": Command("help", "this list and the %%tfmem options", TfmemMagics._help),
}


def help_text() -> str:
    commands = "\n".join(
        f"  %tfmem {c.usage}{' [-o]' if c.returns else ''}\n      {c.help}"
        + (f"; -o returns {c.returns}" if c.returns else "")
        for c in COMMANDS.values()
    )
    return f"{commands}\n\n{build_parser().format_help()}"


def cluster_arguments(word: str, words: list[str]) -> argparse.Namespace:
    """The arguments of %tfmem capture / %tfmem cluster; a usage error that names the fix for anything else."""
    parser = argparse.ArgumentParser(prog=f"%tfmem {word}", add_help=False, exit_on_error=False)
    parser.add_argument("target")
    parser.add_argument("--as", dest="name")
    if word == "capture":
        parser.add_argument("--seconds", type=float, default=2.0)
        parser.add_argument("--logdir")
    try:
        args, extra = parser.parse_known_args(words)
    except (argparse.ArgumentError, SystemExit) as exc:
        raise TfmemUsageError(f"%tfmem {COMMANDS[word].usage} ({exc})") from None
    if extra:
        raise TfmemUsageError(f"unknown {' '.join(extra)}; usage: %tfmem {COMMANDS[word].usage}")
    return args


def resolve_report(ref: str, what: str, namespace: dict[str, Any]) -> Report:
    """A report by history number (%tfmem history), by a name in the namespace, or by label (newest first)."""
    reports: list[Report] = list(SESSION.history)
    if ref.isdigit():
        for report in reports:
            if report.number == int(ref):
                return report
    value = namespace.get(ref)
    if isinstance(value, Report):
        return value
    for report in reversed(reports):
        if report.label == ref:
            return report
    numbers = f"{reports[0].number}-{reports[-1].number}" if reports else "none yet"
    raise TfmemUsageError(
        f"{what}: no report {ref!r}; use a number from %tfmem history ({numbers}), a label, or a name bound with --as"
    )


def show_tracebacks_through(shell: IPythonShell, profiler: pipeline.Profiler, repair: bool) -> Callable[[], None]:
    """Route the shell's tracebacks through `profiler` while its cell runs, so that a second press of stop does not
    cut the display short, and so that the guard closes before the error that ends the cell is shown (not before a
    nested cell's, after which the cell's code goes on). `repair` (the magic's cells) also shows the guard's own
    exception instead of pybind11's tangle, and gives every traceback entry a line number, the chained exceptions'
    too (see numbered_traceback). Returns what undoes it."""
    show: Callable[..., None]  # IPython's showtraceback, called with the arguments IPython gave ours
    show, own = shell.showtraceback, vars(shell).get("showtraceback")
    depth = _cells_running()  # the cell that runs this one's code (the magic's), or none (watch mode's hook)

    def showtraceback(
        exc_tuple: tuple[type[BaseException], BaseException, TracebackType | None] | None = None,
        *rest: object,
        **kwargs: object,
    ) -> None:
        etype, value, tb = exc_tuple or sys.exc_info()
        if kwargs.get("running_compiled_code") and _cells_running() == depth + 1:  # the error that ends the cell
            profiler.leave_user_code(value)  # first: nothing of the guard's may land in the display
        clean, shown = (profiler.untangle(value), numbered_traceback(tb)) if repair else (value, tb)
        if repair:
            number_chained(value)
        with profiler.showing_error(value):
            if clean is value and shown is tb:
                return show(exc_tuple, *rest, **kwargs)
            assert clean is not None  # untangle gives None only for None, and then tb and shown are None too
            return show((type(clean), clean, shown), *rest, **kwargs)

    shell.showtraceback = showtraceback  # on the instance, for this cell only

    def restore() -> None:
        if own is None:
            # the class's own method again (vars() of the instance: mypy reads an Any alias's vars() as a class's)
            vars(shell).pop("showtraceback", None)  # type: ignore[attr-defined]
        else:
            shell.showtraceback = own  # an earlier instance patch, put back

    return restore


def _cells_running() -> int:
    """How many cells IPython is running at this point of the stack (its `run_code` frames: a cell's code run from
    another cell's is one more). The error that ends the profiled cell is shown one level below where its tracebacks
    were routed; a nested cell's error is shown deeper (and the profiled cell's code goes on after it)."""
    depth = 0
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "run_code" and frame.f_globals.get("__name__") == "IPython.core.interactiveshell":
            depth += 1
        frame = frame.f_back
    return depth


def _slim_older(bundle: dict[str, Any]) -> None:
    """Remember `bundle`, a static report just displayed, and slim the older ones to their text. IPython 9 and
    ipykernel keep every displayed bundle, by reference and for the kernel's life (history_manager.outputs, for
    %notebook); a report's bundle holds its JSON and its HTML with the charts, about 0.3 MB in all. Only the newest
    WHOLE_REPORTS keep theirs (docs/session.md): the front end has them already."""
    SESSION.shown.append(bundle)
    while len(SESSION.shown) > WHOLE_REPORTS:
        older = SESSION.shown.popleft()
        for mime in [m for m in older if m != "text/plain"]:
            del older[mime]


def _display(obj: object, raw: bool = False) -> None:
    display(obj, raw=raw)  # type: ignore[no-untyped-call]  # IPython's display has no annotations


class Watcher:
    """Watch mode: a quick measurement around every cell (measure/cells.py says which, and its label), through
    IPython's pre/post_run_cell events. Events come in nested pairs (the magic runs its body as a cell), hence the
    stack: a profiler and what undoes its traceback hook per measured cell, None per cell left alone."""

    def __init__(self, shell: InteractiveShell, options: pipeline.Options) -> None:
        self.shell, self.options = shell, options
        self._stack: list[tuple[pipeline.Profiler, Callable[[], None]] | None] = []
        shell.events.register("pre_run_cell", self.pre)
        shell.events.register("post_run_cell", self.post)

    def pre(self, info: ExecutionInfo) -> None:
        raw = getattr(info, "raw_cell", "") or ""
        if not watched(raw):
            self._stack.append(None)
            return
        key = cell_key(raw, getattr(info, "cell_id", None) or frontend.current_cell_id(self.shell))
        profiler = pipeline.Profiler(replace(self.options, label=cell_label(raw), cell_key=key))
        try:
            profiler.start()
        except Exception as exc:  # noqa: BLE001 - never in the way of the user's cell: this one goes unwatched
            fallback(_log, "watch mode could not start measuring a cell: it goes unwatched", exc)
            self._stack.append(None)
            return
        profiler.enter_user_code()
        self._stack.append((profiler, show_tracebacks_through(self.shell, profiler, repair=False)))

    def post(self, result: ExecutionResult) -> None:
        entry = self._stack.pop() if self._stack else None  # an empty stack: the cell that turned watch mode on
        if entry is None:
            return
        profiler, restore_showtraceback = entry
        restore_showtraceback()
        report = profiler.finish(result.error_before_exec or result.error_in_exec)
        _display({"text/plain": watch_line(report), "text/html": watch_html(report)}, raw=True)

    def stop(self) -> None:
        self.shell.events.unregister("pre_run_cell", self.pre)
        self.shell.events.unregister("post_run_cell", self.post)
        for entry in reversed(self._stack):  # the cell running `watch off` was being measured: end that cleanly
            if entry is not None:
                entry[1]()
                entry[0].finish(None)
        self._stack.clear()


def load(ipython: InteractiveShell) -> None:
    setup = environment.prepare_allocator()
    remove_leftovers()  # trace folders of kernels that were killed
    # the private APIs, probed once: those of what is imported now (nothing is imported for it), the rest when
    # TensorFlow or a Keras is (capabilities.check, at the first report or %tfmem status after); answers are kept
    absent = capabilities.missing()
    ipython.register_magics(TfmemMagics)
    code_sites.hold(code_sites.EXTENSION)  # the line that makes each Keras layer from now on (the by-line view)
    if absent:
        print(
            f"tfmem_magic: {len(absent)} of the private APIs it reads are missing here "
            f"({', '.join(c.name for c in absent)}): what each costs is in %tfmem status and in every report."
        )
    if setup.loaded_after_first_op:
        note = environment.allocator_view().note
        if note:
            print(f"tfmem_magic: TensorFlow was already running when the extension loaded. {note}")

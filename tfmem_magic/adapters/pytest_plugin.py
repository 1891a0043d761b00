"""pytest plugin: memory budgets for TensorFlow code, as markers, and a table of the tests that use the most.

Registered through the `pytest11` entry point, so installing tfmem_magic makes it available; it does nothing unless
a test carries one of its markers or pytest runs with `--tfmem`:

    @pytest.mark.tfmem_limit("300MiB")            # TF's peak over the test's baseline, on the main device
    @pytest.mark.tfmem_limit("2GiB", rss=True)    # the process's RSS peak over its baseline instead
    @pytest.mark.tfmem_no_leak("1MiB", runs=3)    # the body runs 3 times; TF's live bytes must not keep growing
    @pytest.mark.tfmem_no_leak("1MiB")            # with the `tfmem_leak_check` fixture: the body runs once and
    def test_loop(tfmem_leak_check): ...          # the iterations of its own loop are judged (`.step()` each)

    pytest --tfmem [--tfmem-top 10] [--tfmem-save DIR] [--tfmem-trace]

Only the test body is measured, not its fixtures (as pytest-memray does): the body is wrapped in `tfmem_magic`'s
Profiler at `pytest_pyfunc_call`. Under pytest-xdist each worker measures its own tests; the figures travel to the
controller in the test reports' `user_properties`, which is where the end-of-run table reads them.
"""

from __future__ import annotations

import functools
import gc
import hashlib
import re
import tempfile
import unittest
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tfmem_magic.analyze.growth import leak_per_run
from tfmem_magic.core.errors import TfmemUsageError
from tfmem_magic.core.report import DeviceMemory, Report, file_stem, main_device_name
from tfmem_magic.core.sizes import format_bytes, parse_size
from tfmem_magic.show.budget_failures import allocator_note, largest_tensors, unmeasured

LIMIT, NO_LEAK = "tfmem_limit", "tfmem_no_leak"
# user_properties keys: the figures travel with the test's report (to the xdist controller, into junitxml)
TF_PEAK, RSS_PEAK, ALLOCATOR_NOTE = "tfmem_tf_peak_bytes", "tfmem_rss_peak_bytes", "tfmem_allocator_note"
TOP_TENSORS = 5
TOP_LINES = 3  # the lines of code with the most live at the peak, in a failed limit's message
LEAK_FIXTURE = "tfmem_leak_check"


@dataclass(frozen=True)
class Limit:
    bytes: int
    device: str | None = None  # None: the report's main device (the first GPU, else CPU:0)
    rss: bool = False


@dataclass(frozen=True)
class NoLeak:
    bytes: int
    runs: int = 3
    loop: bool = False  # the test requests LEAK_FIXTURE: its own loop's steps are judged, the body runs once


class LeakCheck:
    """What the `tfmem_leak_check` fixture gives a test: call `step()` at the end of each iteration of its loop.

    TensorFlow's live bytes are read at each step (after a full garbage collection) and judged by the test's
    `tfmem_no_leak` marker as its repeated runs would be: the first step warms up, the later ones must not keep
    growing by more than the size.
    """

    def __init__(self) -> None:
        self.device: str | None = None  # set by the plugin before the body runs: the device the rule is about
        self.ends: list[int | None] = []  # TF's live bytes after each step; None: the allocator keeps no stats

    def step(self) -> None:
        """Mark the end of one iteration of the test's loop."""
        gc.collect()  # as between repeated runs: what an iteration keeps is what survives a full collection
        self.ends.append(_live_bytes(self.device))


@pytest.fixture
def tfmem_leak_check() -> LeakCheck:
    """Judge `@pytest.mark.tfmem_no_leak(size)` over the test's own loop: call `tfmem_leak_check.step()` once per
    iteration; the body runs once instead of `runs` times."""
    return LeakCheck()


# ---- hooks ----------------------------------------------------------------------------------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("tfmem", "TensorFlow memory (tfmem_magic)")
    group.addoption(
        "--tfmem",
        action="store_true",
        default=False,
        help="measure every test's TensorFlow and process memory and list the largest at the end",
    )
    group.addoption(
        "--tfmem-top", type=int, default=10, metavar="N", help="how many tests the --tfmem table lists (default 10)"
    )
    group.addoption(
        "--tfmem-save",
        metavar="DIR",
        default=None,
        help="write each measured test's report as JSON in DIR (read it with `tfmem show FILE`)",
    )
    group.addoption(
        "--tfmem-trace",
        action="store_true",
        default=False,
        help="measure with the profiler's trace (per-op/per-layer breakdown; slower) instead of quick mode",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{LIMIT}(size, device=None, rss=False): fail when TensorFlow's peak over the "
        "test's baseline (or the process's RSS peak, rss=True) exceeds size, e.g. '300MiB'",
    )
    config.addinivalue_line(
        "markers",
        f"{NO_LEAK}(size, runs=3): run the test body `runs` times (or judge its own "
        f"loop, with the {LEAK_FIXTURE} fixture) and fail when TensorFlow's live bytes grow by "
        "more than size per run after the first, on average, leaving out the largest single "
        "growth",
    )
    config.pluginmanager.register(_Plugin(config), "tfmem-measure")


class _Plugin:
    """The session's state and the hooks that use it (one per pytest run, on each xdist worker and controller)."""

    def __init__(self, config: pytest.Config) -> None:
        self.trace_all = bool(config.getoption("tfmem_trace"))
        self.top = int(config.getoption("tfmem_top"))
        save = config.getoption("tfmem_save")
        self.save_dir = Path(save) if save else None
        self.measure_all = bool(config.getoption("tfmem")) or self.trace_all or self.save_dir is not None
        self.config = config
        self.prepared = False
        self.rows: list[tuple[int | None, int, str]] = []  # (tf peak, rss peak, nodeid) of each measured test
        self.incomplete_allocator: str | None = None  # why TF's small allocations were not all seen
        if self.top < 0:
            raise pytest.UsageError(f"--tfmem-top {self.top}: give a count of 0 or more")
        if self.measure_all:
            self.prepare()  # before the test modules are imported: TF's first op must find BFC set

    def prepare(self) -> None:
        if not self.prepared:
            from tfmem_magic.measure.environment import prepare_allocator

            prepare_allocator()
            self.prepared = True

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            try:
                wanted = _limit_of(item), _no_leak_of(item)
            except TfmemUsageError as exc:
                raise pytest.UsageError(f"{item.nodeid}: {exc}") from None
            cls = getattr(item, "cls", None)  # a pytest.Function's class, None for a module-level test
            if any(wanted) and isinstance(cls, type) and issubclass(cls, unittest.TestCase):
                # unittest runs the method itself: pytest's pyfunc_call, where the body is measured, never runs
                raise pytest.UsageError(
                    f"{item.nodeid}: tfmem markers measure pytest test functions; this is a "
                    "unittest.TestCase method. Write it as a plain test function, or use "
                    "`with tfmem_magic.profile() as p:` in the method and check p.report."
                )
            if any(wanted):
                self.prepare()  # the test modules imported TF, but it has usually not run an op yet

    @pytest.hookimpl(hookwrapper=True)
    def pytest_pyfunc_call(self, pyfuncitem: pytest.Function) -> Generator[None, object, None]:
        limit, no_leak = _limit_of(pyfuncitem), _no_leak_of(pyfuncitem)
        if not (limit or no_leak or self.measure_all):
            yield
            return
        original = pyfuncitem.obj
        pyfuncitem.obj = _measured(original, pyfuncitem, self, limit, no_leak)
        try:
            yield
        finally:
            pyfuncitem.obj = original

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """Collect the figures (here, or on the xdist controller from the workers' reports)."""
        props: dict[str, Any] = dict(report.user_properties)  # ours: ints and strings (see _record)
        if report.when == "call" and (TF_PEAK in props or RSS_PEAK in props):
            self.rows.append((props.get(TF_PEAK), props.get(RSS_PEAK, 0), report.nodeid))
            self.incomplete_allocator = self.incomplete_allocator or props.get(ALLOCATOR_NOTE)

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        tr = terminalreporter
        if self.rows and self.measure_all and self.top > 0:
            self._write_table(tr)
        elif self.incomplete_allocator:  # markers only: no table, but a limit judged on a partial view says so
            tr.write_sep("=", "tfmem")
        if self.incomplete_allocator:
            tr.write_line(f"note: {self.incomplete_allocator}")

    def _write_table(self, tr: pytest.TerminalReporter) -> None:
        n = min(self.top, len(self.rows))
        tr.write_sep("=", f"tfmem: the {n} test{'s' if n != 1 else ''} with the highest TensorFlow peak")
        tr.write_line(f"{'TF peak':>10}  {'RSS peak':>10}  test   (peaks over each test body's baseline)")
        ranked = sorted(self.rows, key=lambda r: (r[0] or 0, r[1]), reverse=True)[: self.top]
        for tf_peak, rss_peak, nodeid in ranked:
            tf_text = format_bytes(tf_peak) if tf_peak is not None else "-"
            tr.write_line(f"{tf_text:>10}  {format_bytes(rss_peak):>10}  {nodeid}")
        if self.save_dir is not None:
            tr.write_line(f"reports: {self.save_dir}/ (read one with `tfmem show FILE`)")


# ---- markers --------------------------------------------------------------------------------------------------------


def _limit_of(item: pytest.Item) -> Limit | None:
    mark = item.get_closest_marker(LIMIT)
    if mark is None:
        return None
    size, kwargs = _one_size(mark, {"device", "rss"})
    device = kwargs.get("device")
    if device is not None and not (isinstance(device, str) and re.fullmatch(r"(CPU|GPU):\d+", device)):
        raise TfmemUsageError(
            f"@pytest.mark.{LIMIT}(device={device!r}): name a TensorFlow device such as 'GPU:0' or 'CPU:0'"
        )
    rss = kwargs.get("rss", False)
    if not isinstance(rss, bool):
        raise TfmemUsageError(f"@pytest.mark.{LIMIT}(rss={rss!r}): rss is True or False")
    if rss and device is not None:
        raise TfmemUsageError(f"@pytest.mark.{LIMIT}: rss=True limits the process's memory; device= does not apply")
    return Limit(size, device, rss)


def _no_leak_of(item: pytest.Item) -> NoLeak | None:
    mark = item.get_closest_marker(NO_LEAK)
    loop = LEAK_FIXTURE in getattr(item, "fixturenames", ())
    if mark is None:
        if loop:
            raise TfmemUsageError(
                f"the {LEAK_FIXTURE} fixture judges the test's loop by its "
                f"@pytest.mark.{NO_LEAK}(size) marker; add the marker, e.g. "
                f"@pytest.mark.{NO_LEAK}('1MiB')"
            )
        return None
    size, kwargs = _one_size(mark, {"runs"})
    if loop and "runs" in kwargs:
        raise TfmemUsageError(
            f"@pytest.mark.{NO_LEAK}(runs=...): with the {LEAK_FIXTURE} fixture the body runs "
            "once and its loop's steps are judged; leave runs out"
        )
    runs = kwargs.get("runs", 3)
    if not isinstance(runs, int) or isinstance(runs, bool) or runs < 2:
        raise TfmemUsageError(
            f"@pytest.mark.{NO_LEAK}(runs={runs!r}): runs is a whole number of at least 2 (the "
            "first run warms up: graphs are traced and caches filled)"
        )
    return NoLeak(size, runs, loop)


def _one_size(mark: pytest.Mark, allowed: set[str]) -> tuple[int, Mapping[str, Any]]:
    unknown = set(mark.kwargs) - allowed - {"size"}
    if unknown:
        raise TfmemUsageError(
            f"@pytest.mark.{mark.name}: unknown argument(s) {', '.join(sorted(unknown))}; it "
            f"takes a size and {', '.join(sorted(allowed))}"
        )
    sizes = list(mark.args) + ([mark.kwargs["size"]] if "size" in mark.kwargs else [])
    if len(sizes) != 1:
        raise TfmemUsageError(
            f"@pytest.mark.{mark.name} takes one size, e.g. @pytest.mark.{mark.name}('300MiB'); got {len(sizes)}"
        )
    size = sizes[0]
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        raise TfmemUsageError(
            f"@pytest.mark.{mark.name}({size!r}): give the size as a string such as '300MiB' or as bytes (an int)"
        )
    try:
        value = size if isinstance(size, int) else parse_size(size)
    except (TfmemUsageError, ValueError) as exc:
        raise TfmemUsageError(f"@pytest.mark.{mark.name}({size!r}): {exc}") from None
    if value < 0:
        raise TfmemUsageError(f"@pytest.mark.{mark.name}({size!r}): a size cannot be negative")
    return value, mark.kwargs


# ---- measuring one test body ----------------------------------------------------------------------------------------


def _measured(
    func: Callable[..., Any], item: pytest.Function, state: _Plugin, limit: Limit | None, no_leak: NoLeak | None
) -> Callable[..., Any]:
    @functools.wraps(func)
    def wrapper(*args: object, **kwargs: object) -> object:
        from tfmem_magic.core.options import Options
        from tfmem_magic.pipeline import Profiler

        # the trace names the largest tensors when a TF limit fails; an RSS limit stays in quick mode (the
        # profiler's own memory would count in the process's RSS)
        traced = state.trace_all or (limit is not None and not limit.rss)
        options = Options(mode="trace" if traced else "quick", label=item.nodeid, publish=False)
        runs = no_leak.runs if no_leak and not no_leak.loop else 1
        device = limit.device if limit else None
        leak_check = _leak_check_of(item, device) if no_leak and no_leak.loop else None
        if no_leak is not None and no_leak.loop and leak_check is None:
            pytest.fail(
                f"{item.nodeid}: the {LEAK_FIXTURE} fixture was overridden (by a conftest?): the no-leak "
                "check over a test's own loop needs tfmem's fixture",
                pytrace=False,
            )
        ends: list[int | None] = []
        result, profiler = None, None
        try:
            for _ in range(runs):
                profiler = Profiler(options)
                with profiler:
                    result = func(*args, **kwargs)  # the test's own exception propagates (after the finally)
                    if no_leak is not None:
                        # a model or optimizer built per call is held by reference cycles until a full
                        # collection: what a run keeps is what survives one
                        gc.collect()
                measured = _device_memory(profiler.report, device)
                ends.append(None if measured is None else measured[1].end_bytes)
        finally:  # a test that raised (an OOM) is measured too: the table and --tfmem-save show it
            if profiler is not None and profiler.report is not None:
                _record(item, state, profiler.report)
        report = profiler.report if profiler is not None else None
        assert report is not None  # runs >= 1, and each run's `with profiler` made its report (or raised)
        if limit is not None:
            _check_limit(item, state, report, limit)
        if no_leak is not None:
            _check_no_leak(item, state, report, no_leak, leak_check.ends if leak_check is not None else ends)
        return result

    return wrapper


def _leak_check_of(item: pytest.Function, device: str | None) -> LeakCheck | None:
    """The test's `tfmem_leak_check`, told which device to read (None: a conftest overrode the fixture)."""
    leak_check = item.funcargs.get(LEAK_FIXTURE)
    if not isinstance(leak_check, LeakCheck):
        return None
    leak_check.device = device
    return leak_check


def _record(item: pytest.Function, state: _Plugin, report: Report) -> None:
    item.user_properties.append((TF_PEAK, report.tf_peak_bytes))
    item.user_properties.append((RSS_PEAK, _rss_growth(report)))
    if report.env.partial_allocator:
        item.user_properties.append((ALLOCATOR_NOTE, allocator_note(report)))
    if state.save_dir is not None:
        _save(state, item, report, state.save_dir)


def _rss_growth(report: Report) -> int:
    """The process's RSS peak over the test body's baseline."""
    return max(0, report.rss.peak_bytes - report.rss.baseline_bytes)


def _save(state: _Plugin, item: pytest.Function, report: Report, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    name = file_stem(item.nodeid, "test")
    digest = hashlib.sha1(item.nodeid.encode()).hexdigest()[:8]  # cleaned and cut names can collide
    return report.save(directory / f"{name}-{digest}.json")


def _failure_dir(state: _Plugin) -> Path:
    if state.save_dir is not None:
        return state.save_dir
    cache = getattr(state.config, "cache", None)
    if cache is not None:
        return Path(cache.mkdir("tfmem"))
    return Path(tempfile.mkdtemp(prefix="tfmem-pytest-"))


def _live_bytes(device: str | None) -> int | None:
    """TensorFlow's live bytes on `device` (None: the main one) now; 0 before TensorFlow ran an op (nothing is
    allocated through it), None when its allocator keeps no statistics."""
    from tfmem_magic.measure import environment, sampling

    if not environment.tensorflow_initialized():
        return 0
    info = sampling.memory_info(device or sampling.main_tf_device() or "CPU:0")
    return None if info is None else int(info["current"])


def _device_memory(report: Report | None, device: str | None) -> tuple[str, DeviceMemory] | None:
    """The device the limit is about and its figures; None when its allocator was not measured. A body in which
    TensorFlow never ran an op allocated nothing through it: zero."""
    if report is None:
        return None
    name = device or main_device_name(report.tf)
    if name is not None and name in report.tf:
        return name, report.tf[name]
    if not report.tf and report.env.allocator == "none" and device is None:
        return "TensorFlow's allocator (no op ran)", DeviceMemory()
    return None


def _check_limit(item: pytest.Function, state: _Plugin, report: Report, limit: Limit) -> None:
    if limit.rss:
        peak = _rss_growth(report)
        what = "the process's RSS peak"
    else:
        measured = _device_memory(report, limit.device)
        if measured is None:
            pytest.fail(unmeasured(report, LIMIT, limit.device, rss_instead=True), pytrace=False)
        name, mem = measured
        peak = mem.peak_bytes - mem.baseline_bytes
        what = f"TensorFlow's peak on {name}"
    if peak <= limit.bytes:
        return
    path = _save(state, item, report, _failure_dir(state))
    lines = [
        f"{LIMIT}: {what} was {format_bytes(peak)} over the test body's baseline, over its "
        f"{format_bytes(limit.bytes)} limit (by {format_bytes(peak - limit.bytes)})."
    ]
    lines += largest_tensors(report, TOP_TENSORS)
    if report.trace is not None and report.trace.by_line_named_bytes:  # the lines of the test's code that made them
        from tfmem_magic.show.render import by_line_text  # the report's words; imported when a limit fails

        lines += by_line_text(report.trace, TOP_LINES)
    if report.env.partial_allocator:  # the peak above misses allocations: say so where the user reads it
        lines.append(f"note: {allocator_note(report)}")
    lines.append(f"report: {path}  (read it with `tfmem show {path} --html page.html`)")
    pytest.fail("\n".join(lines), pytrace=False)


def _check_no_leak(
    item: pytest.Function, state: _Plugin, report: Report, no_leak: NoLeak, ends: list[int | None]
) -> None:
    if no_leak.loop and len(ends) < 2:
        pytest.fail(
            f"{NO_LEAK}: the test called {LEAK_FIXTURE}.step() {len(ends)} time(s); call it once per "
            "iteration of its loop, at least twice (the first step warms up and is not judged)",
            pytrace=False,
        )
    if any(e is None for e in ends):
        pytest.fail(unmeasured(report, NO_LEAK), pytrace=False)
    known = [e for e in ends if e is not None]
    per_run, one_off = leak_per_run(known)
    if per_run <= no_leak.bytes:
        return
    path = _save(state, item, report, _failure_dir(state))
    unit, runs = (
        ("step", f"{len(known)} steps of the test's loop ({LEAK_FIXTURE}.step())")
        if no_leak.loop
        else ("run", f"{len(known)} runs of the body")
    )
    left_out = (
        f"; the largest single growth, {format_bytes(one_off)}, is left out as a one-off" if len(known) > 2 else ""
    )
    lines = [
        f"{NO_LEAK}: TensorFlow's live bytes grew by {format_bytes(per_run)} per {unit} on average, more than "
        f"the {format_bytes(no_leak.bytes)} allowed. After each of the {runs}: "
        f"{', '.join(format_bytes(e) for e in known)} (the first warms up and is not judged{left_out}).",
        f"Tensors kept alive from {unit} to {unit}: a list that collects outputs, a model or optimizer built "
        "per call, a tf.function retraced for new Python values, or a tf.Variable made in a loop.",
    ]
    lines.append(f"report: {path}" if no_leak.loop else f"report of the last run: {path}")
    pytest.fail("\n".join(lines), pytrace=False)

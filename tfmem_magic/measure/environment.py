"""What machine and TensorFlow setup a measurement runs in: allocator, devices, RAM and container budget.

Nothing here imports TensorFlow: it is looked at only when the user's code has already imported it, so that
loading the extension or profiling a cell that never touches TF costs nothing.
"""

from __future__ import annotations

import logging
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from tfmem_magic.core.fallbacks import fallback
from tfmem_magic.core.session import SESSION
from tfmem_magic.measure import kerases

_log = logging.getLogger(__name__)

BFC_ENV = "TF_CPU_ALLOCATOR_USE_BFC"
# The BFC allocator's cap. Unset, TensorFlow caps the CPU BFC allocator at 1 << 16 MB (64 GiB; process_state.cc,
# `ReadInt64FromEnvVar("TF_CPU_BFC_MEM_LIMIT_IN_MB", 1LL << 16, ...)`): on a larger server, host tensors that fit
# with TensorFlow's default allocator would fail once tfmem switched BFC on. So tfmem sets the cap to what the
# machine can hold (RAM + swap, or the container's limit), unless the user set one.
BFC_CAP_ENV = "TF_CPU_BFC_MEM_LIMIT_IN_MB"
LOG_LEVEL_ENV = "TF_CPP_MIN_LOG_LEVEL"
BFC_ALLOCATOR = "bfc_cpu_allocator_for_gpu"

# The cgroup figures are only a budget when they are a real limit, not the "no limit" sentinel (2**63 rounded
# down to a page) that cgroup v1 reports.
_NO_LIMIT = 2**60


@dataclass
class AllocatorSetup:
    """How the CPU allocator was chosen: recorded when the extension loads, read by every report."""

    bfc_set_by_us: bool = False
    bfc_cap_mb_by_us: int | None = None  # the BFC cap tfmem set from the machine's memory (see BFC_CAP_ENV)
    loaded_after_first_op: bool = False
    quiet_logs_at_import: bool = False  # TF_CPP_MIN_LOG_LEVEL >= 1 was in force when TensorFlow was imported


def tensorflow_imported() -> bool:
    return sys.modules.get("tensorflow") is not None


def tensorflow_initialized() -> bool:
    """True once TensorFlow's eager context exists, i.e. the first op has run and the allocator is chosen."""
    if not tensorflow_imported():
        return False
    try:
        from tensorflow.python.eager import context
    except ImportError:  # a broken or partial install: treat as no TF
        return False
    return getattr(context.context(), "_context_handle", None) is not None  # private: see capabilities.py


def tensorflow_installed() -> bool:
    if tensorflow_imported():
        return True
    import importlib.util

    try:
        return importlib.util.find_spec("tensorflow") is not None
    except (ImportError, ValueError):  # blocked (sys.modules entry None) or broken
        return False


SESSION.allocator_setup = SESSION.allocator_setup or AllocatorSetup()


def prepare_allocator() -> AllocatorSetup:
    """Switch the CPU allocator to BFC (every allocation visible) if it is still possible.

    TensorFlow reads these variables when it creates the CPU device (the first op), not at import, so this works
    after `import tensorflow` too. A value the user set is respected. Also turns off TF's INFO logs (the profiler
    writes several lines per start/stop to fd 2, which Jupyter shows in the cell) unless the user chose a level.
    """
    if not tensorflow_imported() and LOG_LEVEL_ENV not in os.environ:
        os.environ[LOG_LEVEL_ENV] = "1"
    if not tensorflow_imported():
        SESSION.allocator_setup.quiet_logs_at_import = _log_level() >= 1
    if tensorflow_initialized():
        SESSION.allocator_setup.loaded_after_first_op = True
    elif BFC_ENV not in os.environ:
        os.environ[BFC_ENV] = "1"
        SESSION.allocator_setup.bfc_set_by_us = True
    if SESSION.allocator_setup.bfc_set_by_us and not tensorflow_initialized() and BFC_CAP_ENV not in os.environ:
        SESSION.allocator_setup.bfc_cap_mb_by_us = machine_memory_mb()
        os.environ[BFC_CAP_ENV] = str(SESSION.allocator_setup.bfc_cap_mb_by_us)
    return allocator_setup()


def machine_memory_mb() -> int:
    """What this process could ever hold, in MiB: RAM + swap, or the container's limit if smaller."""
    total: int = psutil.virtual_memory().total + psutil.swap_memory().total
    cgroup = cgroup_memory()
    if cgroup is not None:
        total = min(total, cgroup[0])
    return max(1, total // 2**20)


def allocator_setup() -> AllocatorSetup:
    setup: AllocatorSetup = SESSION.allocator_setup  # the session holds it untyped (core imports nothing of measure)
    return setup


def _log_level() -> int:
    try:
        return int(os.environ.get(LOG_LEVEL_ENV, "0"))
    except ValueError:
        return 0


def note_tensorflow_import() -> None:
    """Called before we import TF ourselves: remember whether its C++ INFO logs will be quiet."""
    if not tensorflow_imported():
        SESSION.allocator_setup.quiet_logs_at_import = _log_level() >= 1


def profiler_logs_quiet() -> bool:
    return allocator_setup().quiet_logs_at_import


@dataclass
class AllocatorView:
    name: str  # "bfc_cpu_allocator_for_gpu" | "mklcpu" | "cpu" | "none"
    complete: bool  # every allocation is seen by get_memory_info and the trace
    stats_available: bool
    note: str | None


def allocator_view() -> AllocatorView:
    """Which CPU allocator TF runs with, and what it lets us see. Only meaningful once TF is initialized."""
    if not tensorflow_imported():
        return AllocatorView("none", False, False, "TensorFlow is not imported: only process memory (RSS) is measured.")
    if not tensorflow_initialized():
        return AllocatorView("none", False, False, "TensorFlow has not run an op yet: no allocator exists.")
    import tensorflow as tf

    try:
        tf.config.experimental.get_memory_info("CPU:0")
    except ValueError:
        return AllocatorView(
            "cpu",
            False,
            False,
            "TensorFlow's plain CPU allocator keeps no statistics (oneDNN off or an older CPU, and BFC was not on "
            "before the first op): only process memory (RSS) is measured. Restart the kernel and run "
            "`%load_ext tfmem_magic` before any TensorFlow code to see every allocation.",
        )
    if os.environ.get(BFC_ENV) in ("1", "true", "True"):
        return AllocatorView(BFC_ALLOCATOR, True, True, None)
    return AllocatorView(
        "mklcpu",
        False,
        True,
        "TensorFlow's oneDNN CPU allocator tracks only allocations of 256 KiB or more: biases, small batches and "
        "tf.data elements are invisible. Restart the kernel and run `%load_ext tfmem_magic` before any TensorFlow "
        "code (it turns on the BFC allocator, which sees every allocation).",
    )


def tf_devices() -> list[str]:
    if not tensorflow_initialized():
        return []
    import tensorflow as tf

    # "/device:CPU:0" -> "CPU:0"; in a tf.distribute worker the names carry the task too
    # ("/job:worker/replica:0/task:0/device:CPU:0"), and its allocators are still asked for as "CPU:0"
    return list(dict.fromkeys(local_device_name(d.name) for d in tf.config.list_logical_devices()))


def local_device_name(name: str) -> str:
    """'CPU:0' for '/device:CPU:0', '/job:worker/replica:0/task:1/device:CPU:0' or 'CPU:0'."""
    return name.rsplit("device:", 1)[-1]


def versions() -> dict[str, Any]:
    out: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform(terse=True)}
    tf = sys.modules.get("tensorflow")
    out["tensorflow"] = getattr(tf, "__version__", None)
    package = kerases.in_use()
    out["keras"], out["keras_package"] = kerases.version(package), package
    return out


def mixed_precision_policy(package: str | None = None) -> str | None:
    """The global dtype policy of that Keras (default: the one `tf.keras` is); None when it is not imported."""
    keras = kerases.module(package or kerases.in_use())
    if keras is None:
        return None
    try:
        return str(keras.mixed_precision.global_policy().name)
    except Exception as exc:  # noqa: BLE001 - an old or partial keras: the policy is informative only
        fallback(_log, "Keras' dtype policy could not be read", exc)
        return None


# ---- budget ---------------------------------------------------------------------------------------------------


@dataclass
class Budget:
    ram_total_bytes: int
    ram_available_bytes: int
    cgroup_limit_bytes: int | None
    budget_bytes: int  # the most memory (RSS) this process can hold in total
    budget_source: str  # "cgroup" | "ram" | "user"


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _read_stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def cgroup_memory(
    root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")
) -> tuple[int, int] | None:
    """(limit, non-reclaimable usage) of this process's memory cgroup, v2 or v1; None without a real limit.

    Usage leaves out inactive page cache, which the kernel reclaims before it kills anyone (as `docker stats`).
    """
    v2_dir = _cgroup_v2_dir(root, proc_cgroup)
    if v2_dir is not None and (v2_dir / "memory.max").exists():
        limit = _read_int(v2_dir / "memory.max")
        usage = _read_int(v2_dir / "memory.current") or 0
        usage -= _read_stat(v2_dir / "memory.stat", "inactive_file")
    else:
        v1 = root / "memory"
        limit = _read_int(v1 / "memory.limit_in_bytes")
        usage = _read_int(v1 / "memory.usage_in_bytes") or 0
        usage -= _read_stat(v1 / "memory.stat", "total_inactive_file")
    if limit is None or limit >= _NO_LIMIT:
        return None
    return limit, max(usage, 0)


def _cgroup_v2_dir(root: Path, proc_cgroup: Path) -> Path | None:
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("0::"):
            return root / line[3:].lstrip("/")
    return None


def memory_budget(user_limit: int | None = None, rss_now: int | None = None) -> Budget:
    """How much memory this process may hold in total: the smallest of RAM, the container's limit and the user's.

    RAM gives what is available now plus what the process already holds; a cgroup gives its limit minus what the
    other processes in it hold. A user limit (`--limit`, `%tfmem limit`) replaces both.
    """
    vm = psutil.virtual_memory()
    rss = rss_now if rss_now is not None else psutil.Process().memory_info().rss
    budget, source = rss + vm.available, "ram"
    cgroup = cgroup_memory()
    cgroup_limit = None
    if cgroup is not None:
        cgroup_limit, usage = cgroup
        from_cgroup = cgroup_limit - max(usage - rss, 0)
        if from_cgroup < budget:
            budget, source = from_cgroup, "cgroup"
    if user_limit is not None:
        budget, source = user_limit, "user"
    return Budget(vm.total, vm.available, cgroup_limit, budget, source)

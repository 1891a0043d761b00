from pathlib import Path

from tfmem_magic.measure import environment


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_limit_minus_inactive_cache(tmp_path):
    proc = tmp_path / "proc_cgroup"
    write(proc, "0::/user.slice/app\n")
    base = tmp_path / "cg" / "user.slice" / "app"
    write(base / "memory.max", "1073741824\n")
    write(base / "memory.current", "600000000\n")
    write(base / "memory.stat", "anon 400000000\ninactive_file 100000000\n")
    assert environment.cgroup_memory(tmp_path / "cg", proc) == (1073741824, 500000000)


def test_cgroup_v2_without_limit(tmp_path):
    proc = tmp_path / "proc_cgroup"
    write(proc, "0::/\n")
    write(tmp_path / "cg" / "memory.max", "max\n")
    assert environment.cgroup_memory(tmp_path / "cg", proc) is None


def test_cgroup_v1_limit_and_no_limit_sentinel(tmp_path):
    proc = tmp_path / "proc_cgroup"
    write(proc, "4:memory:/docker/abc\n")
    mem = tmp_path / "cg" / "memory"
    write(mem / "memory.limit_in_bytes", "2147483648\n")
    write(mem / "memory.usage_in_bytes", "1000\n")
    write(mem / "memory.stat", "total_inactive_file 10\n")
    assert environment.cgroup_memory(tmp_path / "cg", proc) == (2147483648, 990)
    write(mem / "memory.limit_in_bytes", "9223372036854771712\n")
    assert environment.cgroup_memory(tmp_path / "cg", proc) is None


def test_budget_user_limit_wins():
    budget = environment.memory_budget(user_limit=123456789)
    assert budget.budget_bytes == 123456789 and budget.budget_source == "user"
    ram = environment.memory_budget()
    assert ram.budget_source in ("ram", "cgroup") and 0 < ram.budget_bytes <= ram.ram_total_bytes + 2**30


def test_a_container_limit_arms_the_guard_and_says_so(monkeypatch):
    """Where a cgroup limit is the tightest budget, every cell gets the batch-end check and the watchdog."""
    import psutil

    import tfmem_magic
    from tfmem_magic.measure import environment

    limit = psutil.Process().memory_info().rss + 2**30
    monkeypatch.setattr(environment, "cgroup_memory", lambda *a, **k: (limit, psutil.Process().memory_info().rss))
    with tfmem_magic.profile(mode="quick") as p:
        pass
    guard = p.report.guard
    assert guard is not None and guard.source == "container limit" and guard.limit_bytes == limit
    assert "watchdog" in guard.layers and p.report.env.budget_source == "cgroup"
    assert any(label == "Memory limit" for label, _, _ in tfmem_magic.show.render.summary_items(p.report))


def test_limit_off_before_tensorflow_takes_back_every_variable_it_set(monkeypatch):
    """%tfmem limit sets TF_CPU_BFC_MEM_LIMIT_IN_MB and TF_ENABLE_ONEDNN_OPTS=0; off must remove both, and a
    user's own oneDNN choice is never touched."""
    import os

    from tfmem_magic.measure import environment, guard

    monkeypatch.setattr(environment, "tensorflow_initialized", lambda: False)
    monkeypatch.setenv(environment.BFC_ENV, "1")
    monkeypatch.delenv(guard.LIMIT_ENV, raising=False)
    monkeypatch.delenv(guard.ONEDNN_ENV, raising=False)
    from tfmem_magic.core.session import SESSION

    monkeypatch.setattr(SESSION, "onednn_off_by_us", False)
    monkeypatch.setattr(environment.allocator_setup(), "bfc_cap_mb_by_us", None)
    guard.set_session_limit(8 * 2**30)
    guard.set_session_limit(6 * 2**30)  # a second limit must still know that oneDNN=0 is ours
    assert os.environ[guard.ONEDNN_ENV] == "0" and guard.LIMIT_ENV in os.environ
    guard.clear_session_limit()
    assert guard.LIMIT_ENV not in os.environ and guard.ONEDNN_ENV not in os.environ
    guard.set_session_limit(8 * 2**30)
    guard.set_session_limit(8 * 2**30, keep_onednn=True)  # changing one's mind gives oneDNN back at once
    assert guard.ONEDNN_ENV not in os.environ
    guard.clear_session_limit()
    monkeypatch.setenv(guard.ONEDNN_ENV, "1")  # the user's own choice
    _, message = guard.set_session_limit(8 * 2**30)
    assert os.environ[guard.ONEDNN_ENV] == "1" and "oneDNN stays on" in message
    guard.clear_session_limit()
    assert os.environ[guard.ONEDNN_ENV] == "1"

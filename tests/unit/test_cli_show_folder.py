"""`tfmem show FOLDER` reads every trace in it; a trace segment that recorded no allocation (a paused trace's later
segment can hold none: a CI run wrote one with `to_tensorboard`) is named as skipped, not the end of the others."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tfmem_magic.adapters import cli
from tfmem_magic.analyze import saved_trace

PUBLIC = Path(__file__).parent.parent / "data" / "gpu_multi_worker_bert.xplane.pb.gz"


def test_a_segment_without_memory_events_is_skipped_among_the_folders_others(tmp_path, capsys):
    shutil.copy(PUBLIC, tmp_path / "worker.xplane.pb.gz")
    (tmp_path / "vm_segment2.xplane.pb").write_bytes(b"")  # an XSpace with no plane at all
    assert cli.main(["show", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "vm_segment2.xplane.pb: no memory events (a trace segment can record none): skipped" in out
    assert "worker.xplane.pb.gz" in out
    # alone, it is the usage error it always was; a folder with nothing else says so
    with pytest.raises(saved_trace.NoMemoryEvents):
        saved_trace.bare_report(tmp_path / "vm_segment2.xplane.pb")
    (tmp_path / "worker.xplane.pb.gz").unlink()
    for where, says in ((tmp_path / "vm_segment2.xplane.pb", "has no memory events"), (tmp_path, "has memory events")):
        with pytest.raises(SystemExit) as stopped:  # the CLI's usage error: exit code 2, the message on stderr
            cli.main(["show", str(where)])
        assert stopped.value.code == 2 and says in capsys.readouterr().err

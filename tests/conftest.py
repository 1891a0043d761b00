"""Shared fixtures. The BFC allocator must be chosen before TensorFlow's first op, so it is set at import time."""

from __future__ import annotations

import gc
import os
import sys

import pytest

import tfmem_magic

tfmem_magic.prepare()  # TF_CPU_ALLOCATOR_USE_BFC=1 and quiet TF INFO logs, before any test imports TensorFlow
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")


@pytest.fixture
def shell(tmp_path):
    """A real IPython shell with the extension loaded and every displayed bundle captured."""
    from IPython.core.displaypub import CapturingDisplayPublisher
    from IPython.core.interactiveshell import InteractiveShell

    InteractiveShell.clear_instance()
    sh = InteractiveShell.instance(display_pub_class=CapturingDisplayPublisher, history_length=0)
    sh.history_manager.enabled = False
    sh.run_line_magic("load_ext", "tfmem_magic")
    cwd = os.getcwd()
    os.chdir(tmp_path)
    yield sh
    os.chdir(cwd)
    # drop the test's variables (models, tensors, fit's History in `_`): the shell object itself can outlive the
    # test (sys.displayhook), and 400 MB of a wide model would count as "pre-existing" in every later test
    sh.reset(new_session=False)
    InteractiveShell.clear_instance()
    # the last traceback keeps the failed cell's frames, and through them this shell's namespace (models, tensors)
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            setattr(sys, name, None)
    gc.collect()


@pytest.fixture
def displayed(shell):
    """A function returning the data dicts the shell has displayed so far."""
    return lambda: [out["data"] for out in shell.display_pub.outputs]


@pytest.fixture(autouse=True)
def every_report_matches_the_shipped_schema(monkeypatch):
    """Every report a test publishes in this process is checked against the JSON Schema the package ships
    (tfmem_magic/report.schema.json, made from core/report.py): a key of the wrong type (a float where bytes are
    ints) or one the schema does not list fails the test that made it."""
    from tfmem_magic.core.session import SESSION

    validator = _schema_validator()
    wrong: list[str] = []
    publish = SESSION.publish

    def checked(report):
        for error in validator.iter_errors(report.to_dict()):
            wrong.append(
                f"report {report.number} ({report.label or 'no label'}): {'/'.join(map(str, error.path))}: "
                f"{error.message[:300]}"
            )
        publish(report)

    monkeypatch.setattr(SESSION, "publish", checked)
    yield
    _dump_reports(SESSION)
    assert not wrong, "reports that do not match report.schema.json:\n" + "\n".join(wrong[:10])


_VALIDATOR = []


def _schema_validator():
    if not _VALIDATOR:
        from jsonschema import Draft202012Validator

        from tfmem_magic.core.schema import shipped_schema

        _VALIDATOR.append(Draft202012Validator(shipped_schema()))
    return _VALIDATOR[0]


def _dump_reports(session) -> None:
    """TFMEM_DUMP_REPORTS=DIR: every report in the session's history as the test left it (calibration and the
    what-if change a report after it was published), one JSON file each, for recording the prediction zoo
    (tests/unit/test_prediction_zoo.py)."""
    folder = os.environ.get("TFMEM_DUMP_REPORTS")
    if not folder:
        return
    import hashlib
    import pathlib

    for report in session.history:
        text = report.to_json()
        name = hashlib.sha1(text.encode()).hexdigest()[:16]
        pathlib.Path(folder).mkdir(parents=True, exist_ok=True)
        (pathlib.Path(folder) / f"{name}.json").write_text(text)

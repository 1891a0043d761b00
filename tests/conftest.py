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

"""The lab extension's TypeScript logic (insert request parsing, where the fix cell goes, the report renderer) is
tested with jest; this runs that suite as part of the one test command, and checks the built extension is
installed where JupyterLab looks for it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXT = ROOT / "labextension"


@pytest.mark.skipif(shutil.which("npm") is None, reason="node/npm not installed (the extension cannot be built)")
def test_jest_suite_passes():
    if not (EXT / "node_modules").exists():
        subprocess.run(["npm", "install", "--no-audit", "--no-fund"], cwd=EXT, check=True, capture_output=True,
                       timeout=600)
    run = subprocess.run(["npx", "jest", "--ci"], cwd=EXT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "Tests:" in run.stderr and "failed" not in run.stderr.split("Tests:")[1].splitlines()[0]


def test_prebuilt_extension_is_installed_and_enabled():
    share = Path(sys.prefix) / "share" / "jupyter" / "labextensions" / "tfmem_magic"
    assert json.loads((share / "package.json").read_text())["name"] == "tfmem_magic"
    out = subprocess.run([sys.executable, "-m", "jupyter", "labextension", "list"], capture_output=True, text=True,
                         timeout=120)
    line = next(line for line in (out.stdout + out.stderr).splitlines() if "tfmem_magic" in line)
    assert "enabled" in line and "OK" in line

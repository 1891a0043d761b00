"""Installs like a normal package: the wheel carries the prebuilt JupyterLab extension, and installs and works in a
fresh virtual environment with no node on PATH (users of a pip package have none; node is a contributor's tool)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
EXTENSION = "share/jupyter/labextensions/tfmem_magic/"


def run(args: list[str], env: dict[str, str], timeout: int = 600) -> str:
    out = subprocess.run(args, capture_output=True, text=True, env=env, timeout=timeout)
    assert out.returncode == 0, f"{args}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    return out.stdout + out.stderr


def without_node() -> dict[str, str]:
    """This environment with only the Python's own bin folder on PATH: no node, no npm (as on a user's machine)."""
    env = {k: v for k, v in os.environ.items() if k != "PATH"}
    env["PATH"] = str(Path(sys.executable).parent)
    assert shutil.which("node", path=env["PATH"]) is None and shutil.which("npm", path=env["PATH"]) is None
    return env


@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> dict[str, Path]:
    """`python -m build` as a release is made: an sdist from the checkout, then the wheel built from that sdist (as
    pip builds one on a machine with no wheel for it), with no node on PATH: the sdist carries the built extension."""
    if not (ROOT / "tfmem_magic" / "labextension" / "static" / "style.js").exists():
        if os.environ.get("CI"):
            pytest.fail("the lab extension is not built: CI must build it (./dev) before the tests")
        pytest.skip("the lab extension is not built in this checkout (./dev builds it)")
    dist = tmp_path_factory.mktemp("dist")
    run([sys.executable, "-m", "build", "--outdir", str(dist), str(ROOT)], without_node(), timeout=900)
    return {"sdist": next(dist.glob("tfmem_magic-*.tar.gz")), "wheel": next(dist.glob("tfmem_magic-*.whl"))}


@pytest.fixture(scope="module")
def wheel(dists) -> Path:
    return dists["wheel"]


def test_the_sdist_carries_the_built_extension_and_its_sources(dists):
    with tarfile.open(dists["sdist"]) as sdist:
        names = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    assert "tfmem_magic/labextension/static/style.js" in names and "tfmem_magic/labextension/package.json" in names
    assert "labextension/src/index.ts" in names and "labextension/package.json" in names  # to rebuild it
    assert not any(name.startswith(("labextension/node_modules/", ".venv/")) for name in names)


def test_the_wheel_carries_the_prebuilt_extension(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert "tfmem_magic/py.typed" in names  # PEP 561: type checkers read the package's own annotations
    assert "tfmem_magic/report.schema.json" in names  # the report's JSON Schema, for readers in other languages
    data = [n for n in names if EXTENSION in n]
    assert any(n.endswith(EXTENSION + "package.json") for n in data)
    assert any(n.endswith(EXTENSION + "install.json") for n in data)
    assert any("/static/remoteEntry." in n for n in data)
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "tfmem_magic.adapters.pytest_plugin" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_it_installs_and_loads_in_a_fresh_environment_without_node(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    bin_dir = venv / "bin"
    env = {
        "PATH": str(bin_dir),
        "HOME": os.environ.get("HOME", str(tmp_path)),
        "LANG": "C.UTF-8",
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "JUPYTER_CONFIG_DIR": str(tmp_path / "jupyter-config"),
    }
    for name in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_CACHE_DIR"):
        if name in os.environ:
            env[name] = os.environ[name]
    assert shutil.which("node", path=env["PATH"]) is None and shutil.which("npm", path=env["PATH"]) is None
    # the user's install line: the package (TensorFlow stays their choice) and JupyterLab
    run([str(bin_dir / "python"), "-m", "pip", "install", "-q", str(wheel), "jupyterlab>=4.6,<5"], env)
    listing = run([str(bin_dir / "jupyter"), "labextension", "list"], env)
    line = next((x for x in listing.splitlines() if "tfmem_magic" in x), "")
    assert "enabled" in line and "OK" in line, listing
    out = run(
        [
            str(bin_dir / "python"),
            "-c",
            (
                "from IPython.core.interactiveshell import InteractiveShell\n"
                "sh = InteractiveShell.instance()\n"
                "sh.run_line_magic('load_ext', 'tfmem_magic')\n"
                "sh.run_cell('%%tfmem --quick --no-panel --as r\\nblock = b\"x\" * (64 * 2**20)')\n"
                "r = sh.user_ns['r']\n"
                "print('RSS', r.rss.peak_bytes - r.rss.baseline_bytes, r.env.tensorflow)\n"
            ),
        ],
        env,
    )
    rss, tensorflow = out.strip().splitlines()[-1].split()[1:]
    assert int(rss) >= 60 * 2**20 and tensorflow == "None"  # no TensorFlow here: process memory is measured
    # then the user installs their TensorFlow next to it (pip's cache has it from this suite's own install), and
    # the demo runs from the installed package: the `tfmem` command, the report on disk
    run([str(bin_dir / "python"), "-m", "pip", "install", "-q", "tensorflow-cpu==2.21.0"], env)
    out_dir = tmp_path / "demo"
    printed = run([str(bin_dir / "tfmem"), "demo", "--out", str(out_dir), "--epochs", "1"], env)
    assert "TF peak" in printed, printed
    html = next(out_dir.glob("*.html")).read_text()
    assert "conv_a" in html and "tfmem" in html

"""A real JupyterLab server and a real Chromium (Debian's, driven by Playwright; never `playwright install`).

The server runs on 127.0.0.1 with a random token, its config, runtime and IPython folders in temp folders, the news
toast off, and `window.jupyterapp` exposed; SIGTERM stops it and its kernels. A cell runs by a real click on its
prompt and Shift+Enter. Why each of these is needed: docs/design.md, 'Browser tests'.

The tests skip where /usr/bin/chromium is missing; CI installs it (.ci/run).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian chromium is not installed")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Lab:
    def __init__(self, root: Path, url: str, token: str, process: subprocess.Popen, app: str = "lab") -> None:
        self.root, self.url, self.token, self.process, self.app = root, url, token, process, app

    def api(self, path: str, method: str = "GET") -> object:
        request = urllib.request.Request(f"{self.url}{path}?token={self.token}", method=method)
        with urllib.request.urlopen(request, timeout=10) as response:
            body = response.read()
        return json.loads(body) if body else None

    def notebook_url(self, name: str) -> str:
        if self.app == "notebook":  # Jupyter Notebook 7: one notebook per page
            return f"{self.url}/notebooks/{name}?token={self.token}"
        return f"{self.url}/lab/tree/{name}?token={self.token}&reset"


@pytest.fixture(scope="session")
def lab(tmp_path_factory) -> Lab:
    yield from _serve_lab(tmp_path_factory.mktemp("lab"))


@pytest.fixture(scope="session")
def lab_without_extension(tmp_path_factory) -> Lab:
    """JupyterLab with tfmem's extension disabled: a front end with no `tfmem_insert` comm target, as VS Code's
    and Colab's notebooks are."""
    yield from _serve_lab(tmp_path_factory.mktemp("lab-bare"), disabled=["tfmem_magic"])


@pytest.fixture(scope="session")
def notebook7(tmp_path_factory) -> Lab:
    """Jupyter Notebook 7 (built on JupyterLab's components): the same prebuilt extension."""
    pytest.importorskip("notebook")
    yield from _serve_lab(tmp_path_factory.mktemp("notebook7"), app="notebook")


def _serve_lab(base: Path, disabled: list[str] | None = None, app: str = "lab"):
    root, settings = base / "root", base / "settings"
    root.mkdir()
    news = settings / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    news.parent.mkdir(parents=True)
    news.write_text(json.dumps({"fetchNews": "false"}))
    if disabled:  # what `jupyter labextension disable` writes, in this server's own config folder
        page_config = base / "config" / "labconfig" / "page_config.json"
        page_config.parent.mkdir(parents=True)
        page_config.write_text(json.dumps({"disabledExtensions": {name: True for name in disabled}}))
    port, token = _free_port(), secrets.token_hex(16)
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",  # kernels: this venv
        "JUPYTER_CONFIG_DIR": str(base / "config"),
        "JUPYTER_RUNTIME_DIR": str(base / "runtime"),
        "IPYTHONDIR": str(base / "ipython"),
    }
    log = open(base / "lab.log", "w")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyter",
            app,
            "--no-browser",
            "--allow-root",
            "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.port={port}",
            f"--IdentityProvider.token={token}",
            f"--ServerApp.root_dir={root}",
            *(
                [
                    "--LabApp.expose_app_in_browser=True",
                    f"--LabApp.workspaces_dir={base / 'workspaces'}",
                    f"--LabApp.user_settings_dir={settings}",
                ]
                if app == "lab"
                else [
                    "--JupyterNotebookApp.expose_app_in_browser=True",
                    f"--JupyterNotebookApp.user_settings_dir={settings}",
                ]
            ),
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    server = Lab(root, f"http://127.0.0.1:{port}", token, process, app)
    deadline = time.time() + 60
    while True:
        try:
            server.api("/api/status")
            break
        except OSError:
            if time.time() > deadline or process.poll() is not None:
                process.kill()
                raise RuntimeError("JupyterLab did not start:\n" + (base / "lab.log").read_text()[-3000:]) from None
            time.sleep(0.3)
    yield server
    process.send_signal(signal.SIGTERM)  # shuts the kernels down cleanly
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
    log.close()


@pytest.fixture(scope="session")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
                "--disable-dev-shm-usage",
            ],
        )
        yield chromium
        chromium.close()


# the test's screenshot -> the docs' image of the same view (README.md and docs/*.md show them)
DOCS_IMAGES = {
    "panel-breakdown.png": "panel.png",
    "panel-timeline.png": "panel-timeline.png",
    "panel-whatif.png": "panel-whatif.png",
    "panel-held.png": "panel-held.png",
    "static-reopened.png": "report.png",
    "fix-inserted.png": "fixes.png",
    "before-after.png": "before-after.png",
}


@pytest.fixture
def shoot(tmp_path):
    """Screenshot a locator into the test's folder. With TFMEM_SCREENSHOTS=DIR (`TFMEM_SCREENSHOTS=docs pytest
    tests/browser`) each also replaces the docs' image of that view: how the screenshots stay current."""
    target = os.environ.get("TFMEM_SCREENSHOTS")

    def take(locator, name: str) -> Path:
        path = tmp_path / name
        locator.screenshot(path=str(path))
        if target and name in DOCS_IMAGES:
            shutil.copyfile(path, Path(target) / DOCS_IMAGES[name])
        return path

    return take


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1280, "height": 1600})
    page = context.new_page()
    yield page
    context.close()


def wait_kernel_idle(page, timeout_ms: int = 60_000) -> None:
    page.wait_for_function(
        """() => { const w = window.jupyterapp.shell.currentWidget;
                   const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;
                   return k && k.status === 'idle'; }""",
        timeout=timeout_ms,
    )


def run_cell(page, index: int, timeout_ms: int = 180_000) -> None:
    """A real click on the cell's prompt and Shift+Enter; waits until it has run and the kernel is idle."""
    page.evaluate(f"window.jupyterapp.shell.currentWidget.content.widgets[{index}].model.executionCount = null")
    page.locator(".jp-Notebook .jp-Cell").nth(index).locator(".jp-InputPrompt").click()
    page.keyboard.press("Shift+Enter")
    page.wait_for_function(
        f"window.jupyterapp.shell.currentWidget.content.widgets[{index}].model.executionCount !== null",
        timeout=timeout_ms,
    )
    wait_kernel_idle(page, timeout_ms)


def open_notebook(lab: Lab, page, name: str, cells: list[str]) -> None:
    """Write a notebook of code cells into the server's root, open it and wait for its kernel."""
    import nbformat

    kernelspec = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    nbformat.write(
        nbformat.v4.new_notebook(
            cells=[nbformat.v4.new_code_cell(c) for c in cells], metadata={"kernelspec": kernelspec}
        ),
        lab.root / name,
    )
    page.goto(lab.notebook_url(name))
    page.wait_for_selector(".jp-Notebook .jp-Cell")
    wait_kernel_idle(page)

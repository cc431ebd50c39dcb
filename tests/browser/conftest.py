"""A real JupyterLab server and a real headless Chromium, for the learner's path.

The server runs on a free 127.0.0.1 port with a token, over a throwaway copy of
the notebooks, with its own settings (no news, every cell kept in the DOM) and
the app exposed as ``window.jupyterapp``, so that tests find cells in the
notebook's model rather than on screen (see ``lab.py``).
Server, kernels and browser are always shut down, also when a test fails.
Screenshots go to ``artifacts/browser/`` (not committed).
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

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "artifacts" / "browser"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]

SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "fetchNews": "false", "checkForUpdates": False},
}


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/browser" in str(item.fspath):
            item.add_marker(pytest.mark.browser)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def lab(tmp_path_factory):
    """Start ``jupyter lab`` over a copy of solutions/ and notebooks/; yield (url, token, root)."""
    try:
        import playwright  # noqa: F401
    except ImportError:
        pytest.skip("python playwright is not installed (make test installs it)")
    if CHROMIUM is None:
        pytest.skip("no chromium executable (make test / .ci/run install Debian's chromium as root)")
    work = tmp_path_factory.mktemp("lab")
    for folder in ("solutions", "notebooks"):
        if (ROOT / folder).is_dir():
            shutil.copytree(ROOT / folder, work / folder)
    (work / "scratch").mkdir()
    settings = work / ".settings"
    for name, value in SETTINGS.items():
        path = settings / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(value))
    token, port = secrets.token_hex(16), _free_port()
    env = {**os.environ, "JUPYTERLAB_SETTINGS_DIR": str(settings),
           "JUPYTER_RUNTIME_DIR": str(work / ".runtime"),
           "JUPYTERLAB_WORKSPACES_DIR": str(work / ".workspaces"), "MGPU_LAB_TIMEOUT": "240"}
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    log = open(ARTIFACTS / "jupyter-lab.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={work}", "--allow-root",
         "--ServerApp.port_retries=0", "--LabApp.news_url=", "--ServerApp.disable_check_xsrf=False",
         "--LabApp.expose_app_in_browser=True"],  # window.jupyterapp: tests read the notebook's model
        cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2).read()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"jupyter lab did not start; see {log.name}")
                time.sleep(0.5)
        yield url, token, work
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server shuts its kernels down
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


@pytest.fixture(scope="session")
def browser(lab):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS, headless=True)
        try:
            yield b
        finally:
            b.close()


def _shut_down_sessions(url: str, token: str) -> None:
    """Every kernel session on the server shut down (REST), so that the next test starts its own kernel
    and no earlier test's kernel (with its process server and ranks) runs beside it."""
    def call(method: str, path: str):
        req = urllib.request.Request(f"{url}{path}?token={token}", method=method)
        with urllib.request.urlopen(req, timeout=30) as reply:
            return reply.read()
    for session in json.loads(call("GET", "/api/sessions")):
        call("DELETE", f"/api/sessions/{session['id']}")


@pytest.fixture
def page(browser, lab, request):
    """A fresh browser context. Each test's notebook opens in a reset workspace (``lab.Notebook``), and its
    kernels are shut down when it ends: in one shared workspace, every notebook that an earlier test opened
    was restored, with its kernel, each time a page loaded (4 tabs and 4 kernels by the fifth test, seen in
    its screenshot; CI's run on a loaded machine then gave up opening lessons 08 and 09 after 90 s each)."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    pg = context.new_page()
    pg.set_default_timeout(60_000)
    try:
        yield pg
    finally:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        try:
            pg.screenshot(path=str(ARTIFACTS / f"{request.node.name}.png"), full_page=True)
        except Exception:  # noqa: BLE001 - a screenshot must not hide the test's own result
            pass
        context.close()
        _shut_down_sessions(*lab[:2])

"""``make test-browser``: every notebook run top to bottom in JupyterLab, in headless Chromium, as a learner would.

JupyterLab serves a temporary copy of notebooks/ (the committed files are never touched). For each notebook the
script opens it, chooses Run > Run All Cells, waits until every code cell has run, fails if any output is an error
or stderr (a warning counts: a learner should see none), and saves a screenshot to build/screenshots/.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from playwright.sync_api import sync_playwright

ROOT = Path(__file__).resolve().parent.parent
SCREENSHOTS = ROOT / "build" / "screenshots"
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-sync",
                  "--disable-background-networking", "--disable-component-update"]
CELL_TIMEOUT_S = 900  # for a whole notebook


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SETTINGS = {  # JupyterLab user settings for the run: render every cell (no virtual scrolling), no news pop-ups
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": '{"windowingMode": "none"}',
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings":
        '{"fetchNews": "false", "checkForUpdates": false}',
}


def start_lab(root: Path, port: int, token: str) -> subprocess.Popen:
    for name, text in SETTINGS.items():
        (root / "settings" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "settings" / name).write_text(text)
    lab = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--allow-root", f"--port={port}", "--ip=127.0.0.1",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
         f"--LabApp.user_settings_dir={root / 'settings'}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status?token={token}", timeout=2)
            return lab
        except OSError:
            time.sleep(1)
    lab.kill()
    raise RuntimeError("JupyterLab did not start within 120 s")


def accept_kernel_choice(page) -> bool:
    """JupyterLab asks which kernel to start when a notebook opens before it has listed the kernels (the first one, on
    a busy machine): take the one it proposes, the notebook's own. Whether it asked."""
    dialog = page.locator(".jp-Dialog", has_text="Select Kernel")
    if not dialog.count():
        return False
    dialog.locator(".jp-mod-accept").first.click()
    page.wait_for_timeout(2_000)  # let the kernel start
    return True


def menu(page, name: str, item: str) -> None:
    page.locator(".lm-MenuBar-itemLabel", has_text=name).first.click()
    page.locator(".lm-Menu-itemLabel", has_text=item).first.click()


def run_notebook(page, url: str, name: str) -> list[str]:
    """Open, run all cells, wait, and return the text of every error or stderr output (or of a time-out)."""
    page.goto(url)
    panel = ".jp-NotebookPanel:visible"
    page.wait_for_selector(f"{panel} .jp-CodeCell", timeout=120_000)
    page.wait_for_timeout(2_000)  # let the kernel connect
    accept_kernel_choice(page)
    menu(page, "Edit", "Clear Outputs of All Cells")  # fresh outputs only
    menu(page, "Run", "Run All Cells")
    prompts = page.locator(f"{panel} .jp-CodeCell .jp-InputPrompt")
    errors = page.locator(f'{panel} .jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')
    deadline, finished = time.time() + CELL_TIMEOUT_S, False
    while time.time() < deadline and not finished and errors.count() == 0:  # Run All stops at an error
        page.wait_for_timeout(1_000)
        if accept_kernel_choice(page):  # asked on Run All, which then ran nothing: again, with a kernel
            menu(page, "Run", "Run All Cells")
        texts = [t.strip() for t in prompts.all_inner_texts()]
        finished = bool(texts) and all(t[1:-2].isdigit() for t in texts)  # "[12]:" on every cell since the clear
    page.wait_for_timeout(1_000)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / f"{Path(name).stem}.png"), full_page=True)
    problems = [f"{name}: {text[:1000]}" for text in errors.all_inner_texts()]
    if not finished and not problems:
        problems.append(f"{name}: not every cell finished within {CELL_TIMEOUT_S} s")
    return problems


def shut_down_kernels(port: int, token: str) -> None:
    """Stop every kernel the notebook started, so each notebook runs alone (JupyterLab's REST API)."""
    base = f"http://127.0.0.1:{port}/api/sessions"
    with urllib.request.urlopen(f"{base}?token={token}", timeout=30) as response:
        sessions = json.load(response)
    for session in sessions:
        request = urllib.request.Request(f"{base}/{session['id']}?token={token}", method="DELETE")
        urllib.request.urlopen(request, timeout=30).close()


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="softmax-course-"))
    shutil.copytree(ROOT / "notebooks", work / "notebooks")
    port, token = free_port(), secrets.token_hex(16)
    lab = start_lab(work, port, token)
    failures = []
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
            for notebook in sorted((work / "notebooks").glob("*.ipynb")):
                started = time.time()
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                # ?reset: an empty workspace, so the notebooks opened before do not come back as tabs
                url = f"http://127.0.0.1:{port}/lab/tree/notebooks/{notebook.name}?reset&token={token}"
                problems = run_notebook(page, url, notebook.name)
                page.close()
                shut_down_kernels(port, token)
                failures += problems
                print(f"{'FAIL' if problems else 'ok  '} {notebook.name} ({time.time() - started:.0f} s)", flush=True)
            browser.close()
    finally:
        lab.terminate()
        lab.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)
    for failure in failures:
        print(failure)
    print(f"screenshots in {SCREENSHOTS.relative_to(ROOT)}/")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

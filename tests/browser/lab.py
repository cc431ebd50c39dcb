"""Driving a JupyterLab notebook the way a learner does: menus, the editor, Shift+Enter."""
from __future__ import annotations

import time


class Notebook:
    """One open notebook in JupyterLab (a Playwright page)."""

    def __init__(self, page, url: str, token: str, path: str):
        self.page = page
        page.goto(f"{url}/lab/tree/{path}?token={token}")
        page.wait_for_selector(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell", timeout=90_000)
        time.sleep(1)
        dialog = page.locator(".jp-Dialog button.jp-mod-accept")
        if dialog.count():  # a notebook without kernelspec metadata asks which kernel
            dialog.first.click()
        self.wait_idle(90)

    # -- state -----------------------------------------------------------------
    @property
    def cells(self):
        return self.page.locator(".jp-NotebookPanel:visible .jp-Notebook .jp-Cell")

    def code_cells(self):
        return self.page.locator(".jp-NotebookPanel:visible .jp-Notebook .jp-CodeCell")

    def kernel_status(self) -> str:
        ind = self.page.locator(".jp-NotebookPanel:visible .jp-Notebook-ExecutionIndicator")
        return ind.first.get_attribute("data-status") or "" if ind.count() else ""

    def wait_idle(self, timeout: float) -> None:
        """Until the kernel is idle and no cell is queued or running."""
        deadline = time.monotonic() + timeout
        quiet = 0
        while time.monotonic() < deadline:
            busy = self.page.locator(".jp-NotebookPanel:visible .jp-InputPrompt:has-text('[*]')").count()
            status = self.kernel_status()
            quiet = quiet + 1 if busy == 0 and status in ("idle", "") else 0
            if quiet >= 3:
                return
            time.sleep(0.5)
        raise TimeoutError(f"notebook still busy after {timeout} s (status {self.kernel_status()!r})")

    # -- actions ---------------------------------------------------------------
    def menu(self, *path: str) -> None:
        self.page.locator("#jp-MainMenu").get_by_text(path[0], exact=True).click()
        for item in path[1:]:
            self.page.locator(".lm-Menu:visible .lm-Menu-itemLabel", has_text=item).first.click()

    def run_all(self, timeout: float) -> None:
        self.menu("Run", "Run All Cells")
        time.sleep(1)
        self.wait_idle(timeout)

    def cell_index(self, text: str) -> int:
        """Index (among all cells) of the first code cell whose source contains ``text``."""
        sources = self.cells.evaluate_all(
            "cells => cells.map(c => (c.querySelector('.cm-content') || {}).innerText || '')")
        for i, src in enumerate(sources):
            if text in src:
                return i
        raise LookupError(f"no cell contains {text!r}")

    def set_source(self, index: int, source: str) -> None:
        """Replace a cell's text through the editor (no auto-indent: text is inserted)."""
        editor = self.cells.nth(index).locator(".cm-content")
        editor.click()
        self.page.keyboard.press("Control+a")
        self.page.keyboard.press("Delete")
        self.page.keyboard.insert_text(source)

    def run_cell(self, index: int, timeout: float) -> None:
        self.cells.nth(index).locator(".cm-content").click()
        self.page.keyboard.press("Escape")
        self.page.keyboard.press("Shift+Enter")
        time.sleep(0.5)
        self.wait_idle(timeout)

    def output(self, index: int):
        return self.cells.nth(index).locator(".jp-OutputArea")

    def save(self) -> None:
        self.page.keyboard.press("Control+s")

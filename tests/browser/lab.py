"""Driving a JupyterLab notebook the way a learner does: menus, the editor, Shift+Enter.

JupyterLab 4 may render only the cells in view (its windowing), so nothing here
reads the notebook from the screen: cells are found in the notebook's model
(``window.jupyterapp``, exposed by the test server), scrolled into view by
JupyterLab, and only then clicked or read; "busy" is the model's execution state
and the kernel's status, not the ``[*]`` prompts that happen to be drawn.
"""
from __future__ import annotations

import json
import time

# The notebook panel of this test's notebook, found by its path (not by what is on screen).
_PANEL = "[...window.jupyterapp.shell.widgets('main')].find(w => w.context && w.context.path === {path})"


class Notebook:
    """One open notebook in JupyterLab (a Playwright page)."""

    def __init__(self, page, url: str, token: str, path: str):
        self.page, self.path = page, path
        self._panel = _PANEL.format(path=json.dumps(path))
        # ?reset: a workspace holding this notebook alone (JupyterLab restores every tab the workspace held)
        page.goto(f"{url}/lab/tree/{path}?token={token}&reset")
        page.wait_for_function(f"() => window.jupyterapp && (({self._panel}) || {{}}).context?.isReady",
                               timeout=90_000)
        page.wait_for_selector(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell", timeout=90_000)
        opened = page.evaluate("() => [...window.jupyterapp.shell.widgets('main')]"
                               ".filter(w => w.context).map(w => w.context.path)")
        assert opened == [path], f"the reset workspace holds {opened}, not {path} alone"
        time.sleep(1)
        dialog = page.locator(".jp-Dialog button.jp-mod-accept")
        if dialog.count():  # a notebook without kernelspec metadata asks which kernel
            dialog.first.click()
        self.wait_idle(90)

    def _js(self, body: str, arg=None):
        """Run ``body`` in the page with ``panel`` (this notebook's panel) and ``arg`` defined."""
        return self.page.evaluate(f"async (arg) => {{ const panel = {self._panel}; {body} }}", arg)

    # -- state (from the model) --------------------------------------------------
    def sources(self) -> list[str]:
        """Every cell's source, in order, whether or not the cell is drawn."""
        return self._js("return panel.content.widgets.map(c => c.model.sharedModel.getSource());")

    def cell_index(self, text: str) -> int:
        """Index of the first cell whose source contains ``text``."""
        sources = self.sources()
        for i, src in enumerate(sources):
            if text in src:
                return i
        raise LookupError(f"none of the {len(sources)} cells of {self.path} contains {text!r}")

    def cell_indices(self, text: str) -> list[int]:
        """Indices of every cell whose source contains ``text``."""
        return [i for i, src in enumerate(self.sources()) if text in src]

    def delete_tagged(self, tag: str) -> int:
        """Delete every cell tagged ``tag`` from the open notebook (the page's model, not the file); how many."""
        return self._js("const m = panel.content.model.sharedModel; let n = 0;"
                        "for (let i = m.cells.length - 1; i >= 0; i--) {"
                        "  if ((m.cells[i].getMetadata('tags') || []).includes(arg)) { m.deleteCell(i); n++; } }"
                        "return n;", tag)

    def delete_cells(self, indices) -> int:
        """Delete the cells at ``indices`` (into every cell, as :meth:`sources` counts them) from the open
        notebook (the page's model, not the file); how many."""
        return self._js("const m = panel.content.model.sharedModel; let n = 0;"
                        "for (const i of [...arg].sort((a, b) => b - a)) { m.deleteCell(i); n++; }"
                        "return n;", sorted(set(indices)))

    def busy(self) -> tuple[str, int]:
        """The kernel's status and how many code cells are queued or running."""
        return tuple(self._js(
            "const k = panel.sessionContext.session?.kernel;"
            "const running = panel.content.widgets.filter("
            "  c => c.model.type === 'code' && c.model.executionState === 'running').length;"
            "return [k ? k.status : 'no kernel', running];"))

    def wait_idle(self, timeout: float) -> None:
        """Until the kernel is idle and no cell is queued or running."""
        deadline = time.monotonic() + timeout
        quiet = 0
        while time.monotonic() < deadline:
            status, running = self.busy()
            quiet = quiet + 1 if status == "idle" and running == 0 else 0
            if quiet >= 3:
                return
            time.sleep(0.5)
        raise TimeoutError(f"notebook still busy after {timeout} s (kernel {status!r}, {running} cell(s) running)")

    def dirty(self) -> bool:
        """Whether JupyterLab holds the notebook as changed since it was opened or saved."""
        return self._js("return panel.context.model.dirty;")

    def metadata(self) -> dict:
        """The notebook's metadata as JupyterLab holds it now."""
        return self._js("return panel.context.model.sharedModel.getMetadata();")

    # -- cells on screen ------------------------------------------------------------
    def cell(self, index: int):
        """The cell at ``index``, scrolled into view by JupyterLab (so drawn), as a locator."""
        self._js("panel.content.widgets.forEach((c, i) => c.node.setAttribute('data-mgpu-index', String(i)));"
                 "await panel.content.scrollToItem(arg, 'center');", index)
        locator = self.page.locator(f".jp-NotebookPanel:visible .jp-Cell[data-mgpu-index='{index}']")
        locator.wait_for(state="attached")
        return locator

    def output(self, index: int):
        return self.cell(index).locator(".jp-OutputArea")

    # -- actions ---------------------------------------------------------------
    def menu(self, *path: str) -> None:
        self.page.locator("#jp-MainMenu").get_by_text(path[0], exact=True).click()
        for item in path[1:]:
            self.page.locator(".lm-Menu:visible .lm-Menu-itemLabel", has_text=item).first.click()

    def run_all(self, timeout: float) -> None:
        self.menu("Run", "Run All Cells")
        time.sleep(1)
        self.wait_idle(timeout)

    def select(self, index: int) -> None:
        """Click into the cell's editor, as a learner does before a "Run ... Selected Cell" command."""
        self.cell(index).locator(".cm-content").click()

    def set_source(self, index: int, source: str) -> None:
        """Replace a cell's text through the editor (no auto-indent: text is inserted)."""
        self.select(index)
        self.page.keyboard.press("Control+a")
        self.page.keyboard.press("Delete")
        self.page.keyboard.insert_text(source)

    def run_cell(self, index: int, timeout: float) -> None:
        self.select(index)
        self.page.keyboard.press("Escape")
        self.page.keyboard.press("Shift+Enter")
        time.sleep(0.5)
        self.wait_idle(timeout)

    def save(self) -> None:
        self.page.keyboard.press("Control+s")

"""The learner's path in a real JupyterLab, driven through a real headless Chromium."""
from __future__ import annotations

import re
import time

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

from .lab import Notebook

pytestmark = pytest.mark.timeout(600)


def _widths(page) -> list[float]:
    bars = page.locator(".mgpu-progress .progress-bar")
    styles = [bars.nth(i).get_attribute("style") or "" for i in range(bars.count())]
    return [float(m.group(1)) if (m := re.search(r"width:\s*([\d.]+)%", s)) else 0.0 for s in styles]


def test_long_launches_show_a_live_progress_bar_per_rank(lab, page):
    url, token, work = lab
    nb = new_notebook(cells=[
        new_code_cell("import time\nfrom mgpu_lab import launch, progress"),
        new_code_cell("def work():\n    for _ in progress(range(40), desc='train'):\n        time.sleep(0.25)\n"
                      "    return 'done'\n\nlaunch(work, 2)"),
    ])
    nb.metadata.kernelspec = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    nbformat.write(nb, work / "scratch" / "progress.ipynb")
    book = Notebook(page, url, token, "scratch/progress.ipynb")
    book.menu("Run", "Run All Cells")
    page.wait_for_selector(".mgpu-progress .progress-bar", timeout=120_000)
    deadline, seen = time.monotonic() + 60, []
    while time.monotonic() < deadline:
        widths = _widths(page)
        if len(widths) == 2:
            seen.append(min(widths))
            if len(set(seen)) >= 3 and 0 < seen[0] < 100:
                break
        time.sleep(0.5)
    assert len(set(seen)) >= 3, f"bars did not advance: {seen}"
    book.wait_idle(120)
    assert _widths(page) == [100.0, 100.0]
    labels = page.locator(".mgpu-progress .widget-label").all_inner_texts()
    assert "[rank 0/2] train" in labels and "[rank 1/2] train" in labels
    assert "'done'" in book.output(1).inner_text()

"""The learner's path in a real JupyterLab, driven through a real headless Chromium."""
from __future__ import annotations

import platform
import re
import time

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

from submissions import PICK_DEVICE_BODY

from mgpu_lab.course.cells import SKIP_TAG, plan

from .conftest import ARTIFACTS
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


PICK_DEVICE = "import torch\n\ndef pick_device(index=None):" + PICK_DEVICE_BODY

WRONG_VISIBLE = '''def visible_devices_env(ids):
    if len(set(ids)) != len(ids) or any(not isinstance(i, int) or i < 0 for i in ids):
        raise ValueError(f"bad ids {ids}")
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in sorted(ids))}
'''


def test_solution_01_run_as_graded_shows_every_check_block_passed(lab, page):
    # The cells a grader runs: those tagged skip-in-grading (demos and timings, most of lesson 01's run time;
    # nbval runs them all) are deleted in the page, not in the file, then Run All Cells.
    url, token, root = lab
    tagged = [c for c in nbformat.read(root / "solutions/01_devices.ipynb", 4).cells
              if SKIP_TAG in c.metadata.get("tags", [])]
    book = Notebook(page, url, token, "solutions/01_devices.ipynb")
    assert len(tagged) >= 5 and book.delete_tagged(SKIP_TAG) == len(tagged)
    assert not any(cell.source in book.sources() for cell in tagged)
    book.run_all(timeout=300)
    checks = book.cell_indices('check("01.')  # found in the model, each scrolled into view to be read
    assert len(checks) == 3
    heads = []
    for i in checks:
        out = book.output(i)
        assert out.locator(".mgpu-check").count() == 1 and out.locator(".mgpu-check-passed").count() == 1
        heads.append(out.locator(".mgpu-check").inner_text().splitlines()[0])
    assert heads == ["01.pick_device: 2/2 points · passed", "01.train_step: 2/2 points · passed",
                     "01.visible_devices_env: 6/6 points · passed"]


def test_student_01_a_right_and_a_wrong_answer_typed_in_the_editor(lab, page):
    url, token, _ = lab
    book = Notebook(page, url, token, "notebooks/01_devices.ipynb")
    book.select(book.cell_index("def pick_device"))
    book.menu("Run", "Run All Above Selected Cell")
    book.wait_idle(180)
    for source, exercise in ((PICK_DEVICE, "def pick_device"), (WRONG_VISIBLE, "def visible_devices_env")):
        i = book.cell_index(exercise)
        book.set_source(i, source)
        book.run_cell(i, 60)
        book.run_cell(book.cell_index(f'check("01.{exercise[4:]}"'), 180)
    good = book.output(book.cell_index('check("01.pick_device"'))
    bad = book.output(book.cell_index('check("01.visible_devices_env"'))
    assert good.locator(".mgpu-check-passed").count() == 1
    assert "01.pick_device: 2/2 points · passed" in good.inner_text()
    assert bad.locator(".mgpu-check-failed").count() == 1
    text = bad.inner_text()
    head = bad.locator(".mgpu-check").inner_text().splitlines()[0]
    assert re.fullmatch(r"01\.visible_devices_env: [0-5]/6 points · not yet", head), head
    # No test-tool marker in what the learner reads: nbval's marks are cell tags, not source lines.
    checks = [s for s in book.sources() if s.lstrip().startswith("check(")]
    assert len(checks) == 3 and not any("NBVAL" in s for s in book.sources()), checks
    assert "visible_devices_env([3, 1])" in text and "keeps the order" in text  # the case that names it


def test_lesson_04_launch_cells_show_every_rank_and_the_explorer_responds(lab, page):
    url, token, _ = lab
    book = Notebook(page, url, token, "solutions/04_ddp.ipynb")
    explorer = book.cell_index("sampler_view.explorer(")
    book.select(explorer)
    book.menu("Run", "Run All Above Selected Cell")
    book.wait_idle(240)
    for launch_cell in ("launch(hello, 2", "def wrap_demo"):
        text = book.output(book.cell_index(launch_cell)).inner_text()
        assert text.startswith("launch: 2 ranks") and "[rank 0/2]" in text and "[rank 1/2]" in text, text
    book.run_cell(explorer, 120)
    out = book.output(explorer)
    out.locator(".widget-interact").wait_for()
    assert out.locator(".widget-slider").count() == 2 and out.locator("input[type=checkbox]").count() == 2
    out.locator(".widget-interact img").first.wait_for(timeout=60_000)
    before = out.locator(".widget-interact img").first.get_attribute("src")
    out.locator("input[type=checkbox]").first.click()  # drop_last: off -> on
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        imgs = out.locator(".widget-interact img")
        if imgs.count() and imgs.first.get_attribute("src") != before:
            break
        time.sleep(0.5)
    else:
        pytest.fail("the explorer's plot did not change after drop_last was ticked")
    assert out.locator("input[type=checkbox]").first.is_checked()


def test_a_student_notebook_opens_unchanged(lab, page):
    """Opened, its kernel started, nothing run: not marked unsaved. JupyterLab writes the kernel's own
    kernelspec and language_info into the notebook, and any difference marks it changed. The kernelspec is the
    file's to get right (eight notebooks held the display name "Python 3" and opened changed; every notebook's
    kernelspec is compared with the installed kernel's in tests/course/test_assign.py). language_info's Python
    version is the machine's: no content of the file avoids that difference (tried: without language_info,
    without its version, another version), so the copy here records this machine's version, as a notebook
    refreshed on it does."""
    url, token, work = lab
    path = work / "notebooks" / "01_devices.ipynb"
    nb = nbformat.read(path, 4)
    nb.metadata.language_info["version"] = platform.python_version()  # the kernel runs this interpreter
    nbformat.write(nb, path)
    book = Notebook(page, url, token, "notebooks/01_devices.ipynb")
    assert not book.dirty(), f"opened already marked unsaved; metadata now {book.metadata()}"


TORN_AND_DEADLOCK = [
    "from mgpu_lab import check",
    "import torch\n\ndef atomic_save(obj, path):\n    torch.save(obj, path)   # in place: a kill tears the file",
    'check("10.atomic_save", atomic_save)',
    "import torch\nimport torch.distributed as dist\n\ndef ring_allreduce(tensor):\n"
    "    rank, world = dist.get_rank(), dist.get_world_size()\n    incoming = torch.empty_like(tensor)\n"
    "    dist.send(tensor.contiguous(), (rank + 1) % world)   # every rank sends first\n"
    "    dist.recv(incoming, (rank - 1) % world)\n    return tensor + incoming",
    'check("09.ring_allreduce", ring_allreduce)',
]


def test_a_torn_file_and_a_deadlock_read_in_the_check_s_own_words(lab, page):
    """What a learner sees for two classic wrong answers (the screenshot in artifacts/browser shows it): the
    torn file named as such, never torch's unpickling error; the ring's deadlock said once, with its world sizes."""
    url, token, work = lab
    nb = new_notebook(cells=[new_code_cell(source) for source in TORN_AND_DEADLOCK])
    nb.metadata.kernelspec = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    nbformat.write(nb, work / "scratch" / "wrong_answers.ipynb")
    book = Notebook(page, url, token, "scratch/wrong_answers.ipynb")
    book.run_all(timeout=300)
    heads, texts = [], []
    for i in (2, 4):
        block = book.output(i).locator(".mgpu-check")
        assert block.count() == 1 and book.output(i).locator(".mgpu-check-failed").count() == 1
        texts.append(block.inner_text())
        heads.append(texts[-1].splitlines()[0])
        block.screenshot(path=str(ARTIFACTS / f"check-{heads[-1].split(':')[0]}-wrong-answer.png"))
    assert re.fullmatch(r"10\.atomic_save: [1-6]/7 points · not yet", heads[0]), heads
    assert heads[1] == "09.ring_allreduce: 0/8 points · not yet", heads
    torn, ring = texts
    assert "the file at path was half written when the writer was killed at byte 1 (it holds 1 byte)" in torn
    assert not any(words in torn for words in ("UnpicklingError", "weights_only", "1 bytes")), torn
    assert "deadlock with 2, 3 and 4 ranks" in ring and ring.count("every rank waits and none can proceed") == 1


# A cell that draws: matplotlib's figures, or the package's drawing helpers (mgpu_lab's figures modules).
DRAWS = re.compile(r"\bplt\.|\.plot\(|figures?\b|\bdraw_|\bshow_\w*\(")


def _drawing_plan(path) -> tuple[list[int], list[int]]:
    """(cells to delete, cells that draw) of a notebook, as indices into all its cells: every code cell that
    neither draws nor defines a name a kept cell reads (the grader's own reading of cells:
    :func:`mgpu_lab.course.cells.plan`) goes; the checks and the demos that feed no chart are nbval's to run."""
    cells = nbformat.read(path, 4).cells
    code = [i for i, c in enumerate(cells) if c.cell_type == "code"]
    sources = [cells[i].source for i in code]
    draws = {k for k, src in enumerate(sources) if DRAWS.search(src)}
    skip = plan(sources, {src for k, src in enumerate(sources) if k not in draws})
    return [code[k] for k in sorted(skip)], [code[k] for k in sorted(draws)]


@pytest.mark.parametrize("lesson", ["08_sharding", "09_inside_ddp"])
def test_a_lesson_s_plots_draw_without_an_error_and_are_kept_as_screenshots(lab, page, lesson):
    """The charts that were mended (08's legend, 09's overlap labels and bucket sweep beside its cost model)
    drawn in the learner's browser: the cells that draw and every cell they need run (the others, checks
    and demos that feed no chart, are deleted in the page; nbval runs every cell of the lesson), no cell
    shows an error, every drawing cell shows its figure, and each is kept in artifacts/browser for a person
    to look at."""
    url, token, root = lab
    gone, drawing = _drawing_plan(root / f"solutions/{lesson}.ipynb")
    assert drawing and gone, (lesson, drawing, gone)
    book = Notebook(page, url, token, f"solutions/{lesson}.ipynb")
    before = book.sources()
    kept = [src for i, src in enumerate(before) if i not in set(gone)]
    assert book.delete_cells(gone) == len(gone) and book.sources() == kept
    book.run_all(timeout=420)
    # A raised exception is an output of type "error" (the lessons' "what goes wrong" demos print to stderr,
    # which is not one).
    errors = book._js("return panel.content.widgets.filter(c => c.model.type === 'code')"
                      ".flatMap(c => c.model.outputs.toJSON()).filter(o => o.output_type === 'error')"
                      ".map(o => o.ename + ': ' + o.evalue);")
    assert errors == [], errors
    original = [i for i in range(len(before)) if i not in set(gone)]  # a cell's index in the file
    figures = {original[i]: i for i in range(len(kept)) if book.cell(i).locator(".jp-OutputArea img").count()}
    assert sorted(figures) == drawing, f"cells that draw {drawing}, cells that show a figure {sorted(figures)}"
    for cell, i in figures.items():
        book.output(i).screenshot(path=str(ARTIFACTS / f"{lesson}-cell{cell}-figure.png"))

"""mgpu_lab.course.assign: student copies from solutions, marker errors, the sync test."""
from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

from mgpu_lab.course.assign import CHECK_TAG, KEEP_TAG, KERNELSPEC, STUB, MarkerError, assign, refresh, strip_solutions, student_notebook
from mgpu_lab.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_block_is_replaced_with_the_stub_keeping_indentation():
    src = (
        "def f(x):\n"
        "    '''Doc.'''\n"
        "    ### BEGIN SOLUTION\n"
        "    y = x + 1\n"
        "    return y\n"
        "    ### END SOLUTION\n"
        "\n"
        "class A:\n"
        "    def g(self):\n"
        "        ### BEGIN SOLUTION\n"
        "        return 2\n"
        "        ### END SOLUTION"
    )
    assert strip_solutions(src) == (
        "def f(x):\n"
        "    '''Doc.'''\n"
        f"    {STUB}\n"
        "\n"
        "class A:\n"
        "    def g(self):\n"
        f"        {STUB}"
    )


def test_cells_without_markers_are_unchanged():
    assert strip_solutions("x = 1\nprint(x)") == "x = 1\nprint(x)"


@pytest.mark.parametrize("src,problem,line", [
    ("### BEGIN SOLUTION\nx = 1\n", "is never closed", 1),
    ("x = 1\n### END SOLUTION\n", "without a '### BEGIN SOLUTION' before it", 2),
    ("### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION\n", "nested", 2),
])
def test_unmatched_or_nested_markers_quote_the_notebook_and_cell(src, problem, line):
    with pytest.raises(MarkerError) as info:
        strip_solutions(src, "solutions/09_x.ipynb cell 4")
    msg = str(info.value)
    assert msg.startswith(f"solutions/09_x.ipynb cell 4, line {line}: ") and problem in msg
    assert f">   {line} | " in msg  # the cell is quoted with the bad line marked


def _solution_nb():
    return new_notebook(cells=[
        new_markdown_cell("# Title"),
        new_code_cell("def f():\n    ### BEGIN SOLUTION\n    return 1\n    ### END SOLUTION",
                      outputs=[new_output("stream", name="stdout", text="hi\n")], execution_count=3),
        new_code_cell("check('01.pick_device', f)", metadata={"tags": [CHECK_TAG]},
                      outputs=[new_output("execute_result", data={"text/plain": "ok"}, execution_count=4)]),
    ])


def test_student_copy_strips_solutions_and_clears_outputs():
    student = student_notebook(_solution_nb())
    assert student.cells[1].source == f"def f():\n    {STUB}"
    assert all(c.get("outputs", []) == [] for c in student.cells)
    assert student.cells[0].source == "# Title"


def test_assign_writes_copies_and_check_reports_stale_ones(tmp_path):
    sol = tmp_path / "solutions" / "01_demo.ipynb"
    sol.parent.mkdir()
    nbformat.write(_solution_nb(), sol)
    out = tmp_path / "notebooks"
    assert assign([sol], out, check_only=True) == [out / "01_demo.ipynb"]
    assert assign([sol], out) == [out / "01_demo.ipynb"]
    assert assign([sol], out, check_only=True) == []
    (out / "01_demo.ipynb").write_text((out / "01_demo.ipynb").read_text().replace("Title", "Edited"))
    assert main(["assign", str(sol), "--out", str(out), "--check"]) == 1
    assert main(["assign", str(sol), "--out", str(out)]) == 0
    assert assign([sol], out, check_only=True) == []


def test_a_marker_error_writes_nothing(tmp_path):
    good, bad = tmp_path / "01_a.ipynb", tmp_path / "02_b.ipynb"
    nbformat.write(_solution_nb(), good)
    nbformat.write(new_notebook(cells=[new_code_cell("### BEGIN SOLUTION\nx = 1")]), bad)
    with pytest.raises(MarkerError, match=r"02_b.ipynb cell 0, line 1"):
        assign([good, bad], tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert main(["assign", str(good), str(bad), "--out", str(tmp_path / "out")]) == 1


def test_notebooks_folder_is_exactly_what_assign_makes_from_solutions(monkeypatch):
    monkeypatch.chdir(ROOT)
    solutions = sorted((ROOT / "solutions").glob("*.ipynb"))
    if not solutions:
        pytest.fail("no solution notebooks found in solutions/")
    stale = assign(solutions, ROOT / "notebooks", check_only=True)
    assert stale == [], f"regenerate with `mgpu-lab assign`: {stale}"
    extra = {p.name for p in (ROOT / "notebooks").glob("*.ipynb")} - {p.name for p in solutions}
    assert extra == set(), f"student notebooks without a solution: {extra}"


def test_student_copy_keeps_the_check_tag():
    student = student_notebook(_solution_nb())
    assert student.cells[2].metadata["tags"] == [CHECK_TAG] and student.cells[2].source.startswith("check(")


def test_every_check_cell_is_tagged_and_no_cell_carries_a_test_tool_mark():
    """What the learner reads holds no nbval marks; nbval still compares every check cell (by its tag)."""
    for path in sorted((ROOT / "solutions").glob("*.ipynb")) + sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = [c for c in nbformat.read(path, 4).cells if c.cell_type == "code"]
        checks = [c for c in cells if c.source.lstrip().startswith("check(")]
        assert checks, f"{path.name}: no check cell"
        untagged = [c.source for c in checks if CHECK_TAG not in c.metadata.get("tags", [])]
        assert not untagged, f"{path.name}: check cells without the {CHECK_TAG!r} tag: {untagged}"
        marked = [c.source.splitlines()[0] for c in cells if "NBVAL_" in c.source]
        assert not marked, f"{path.name}: test-tool marks in cell sources: {marked}"
        mixed = [c.source for c in checks if len(c.source.strip().splitlines()) != 1]
        assert not mixed, f"{path.name}: a check cell holds more than its check: {mixed}"


def test_refresh_keeps_the_outputs_of_tagged_cells_only(tmp_path):
    nb = new_notebook(cells=[
        new_code_cell("print('demo')", outputs=[new_output("stream", name="stdout", text="stale\n")]),
        new_code_cell("6 * 7", metadata={"tags": [CHECK_TAG]}),
        new_code_cell("# NBVAL_CHECK_OUTPUT\n1 + 1"),  # the old first-line mark keeps nothing any more
        new_code_cell("print('measured', 3)", metadata={"tags": [KEEP_TAG]}),
    ])
    path = tmp_path / "01_demo.ipynb"
    nbformat.write(nb, path)
    assert refresh(path, timeout=120) == 2
    cells = nbformat.read(path, 4).cells
    assert cells[0].outputs == [] and cells[2].outputs == []
    assert cells[1].outputs[0]["data"]["text/plain"] == "42"
    assert cells[3].outputs[0]["text"] == "measured 3\n"
    assert all(c.outputs == [] for c in student_notebook(nbformat.read(path, 4)).cells)


def test_every_notebook_holds_the_installed_kernel_s_kernelspec():
    """JupyterLab writes the running kernel's kernelspec into the notebook: any other opens marked unsaved."""
    from jupyter_client.kernelspec import KernelSpecManager

    installed = KernelSpecManager().get_kernel_spec("python3")
    assert (KERNELSPEC["name"], KERNELSPEC["display_name"]) == ("python3", installed.display_name)
    for path in sorted((ROOT / "solutions").glob("*.ipynb")) + sorted((ROOT / "notebooks").glob("*.ipynb")):
        assert nbformat.read(path, 4).metadata.get("kernelspec") == KERNELSPEC, path.name

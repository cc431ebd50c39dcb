"""mgpu_lab.course.assign: student copies from solutions, marker errors, the sync test."""
from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

from mgpu_lab.course.assign import STUB, MarkerError, assign, strip_solutions, student_notebook
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
        new_code_cell("# NBVAL_CHECK_OUTPUT\ncheck('01.pick_device', f)",
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

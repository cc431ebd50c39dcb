"""Which cells grading skips: the static reading of names, the plan, and the tags in solutions/ and notebooks/."""
from __future__ import annotations

import copy
from pathlib import Path

import nbformat
import pytest

from mgpu_lab.course.assign import student_notebook
from mgpu_lab.course.cells import SKIP_TAG, needed_but_tagged, names, plan, reference_skips, tagged

ROOT = Path(__file__).resolve().parents[2]
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))


# -- names --------------------------------------------------------------------------------
@pytest.mark.parametrize("source, binds, reads", [
    ("x = y + 1", {"x"}, {"y"}),
    ("x = 1\nprint(x)", {"x"}, {"print"}),  # bound earlier in the cell: not read from another cell
    ("x += 1", {"x"}, {"x"}),
    ("import torch.nn as nn, os.path\nfrom a import b as c", {"nn", "os", "c"}, set()),
    ("def f(model, lr=base_lr):\n    steps = 3\n    return model(data) * lr * steps", {"f"}, {"base_lr", "data"}),
    ("class Net(Base):\n    size = width\n    def forward(self, x):\n        return x + bias", {"Net"},
     {"Base", "width", "bias"}),
    ("[i * k for i in items]", set(), {"k", "items"}),
    ("lambda v: v + w", set(), {"w"}),
    ("for a, b in pairs:\n    total = a + b", {"a", "b", "total"}, {"pairs"}),
    ("with open(p) as fh:\n    text = fh.read()", {"fh", "text"}, {"open", "p"}),
    ("%time result = slow(n)", {"result"}, {"slow", "n"}),
    ("%%capture out\nvalue = compute(z)", {"value"}, {"compute", "z"}),
    ("!ls {folder}\nx = 1", {"x"}, set()),
    ("def g():\n    global counter\n    counter = counter + 1", {"g"}, {"counter"}),
])
def test_names_reads_what_a_cell_takes_from_earlier_cells(source, binds, reads):
    found_binds, found_reads = names(source)
    assert found_binds >= binds and found_reads - {"get_ipython"} == reads


def test_a_cell_that_does_not_parse_has_no_names():
    assert names("def broken(:\n    pass") is None


# -- plan ---------------------------------------------------------------------------------
DEMO = "loss = measure(model)  # a demo\nhelper = lambda t: t * 2"
CELLS = ["import torch\nmodel = torch.nn.Linear(2, 2)", DEMO, "def answer(x):\n    return model(x)",
         "check('00.answer', answer)"]


def test_plan_skips_a_tagged_cell_no_later_cell_needs():
    assert plan(CELLS, {DEMO}) == {1}


def test_an_edited_demo_cell_runs():
    edited = [*CELLS[:1], DEMO + "\nmodel = torch.nn.Linear(2, 3)", *CELLS[2:]]
    assert plan(edited, {DEMO}) == set()


def test_a_demo_helper_the_learners_answer_uses_runs():
    uses = [*CELLS[:2], "def answer(x):\n    return helper(model(x))", CELLS[3]]
    assert plan(uses, {DEMO}) == set()


def test_a_demo_needed_only_through_another_needed_demo_runs():
    first, second = "table = [1, 2]", "total = sum(table)"
    cells = [first, second, "def answer():\n    return total"]
    assert plan(cells, {first, second}) == set()
    assert plan([first, second, "def answer():\n    return 1"], {first, second}) == {0, 1}


def test_a_later_definition_the_answer_reads_is_what_counts():
    cells = ["size = 4", "size = 8  # demo", "def answer():\n    return size"]
    assert plan(cells, {"size = 4", "size = 8  # demo"}) == {0}, "the demo's size is the one read"
    assert plan(["size = 8  # demo", "size = 4", "def answer():\n    return size"],
                {"size = 8  # demo"}) == {0}


def test_a_tagged_cell_that_does_not_parse_is_not_skipped():
    bad = "def broken(:"
    assert plan(["x = 1", bad], {bad}) == set()


# -- the tags in solutions/ and notebooks/ ---------------------------------------------------------
@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.stem)
def test_no_solution_notebooks_check_depends_on_a_cell_grading_skips(path):
    nb = nbformat.read(path, as_version=4)
    assert needed_but_tagged(nb) == []
    marked = tagged(nb)
    assert marked, f"{path.name}: no demo cell is tagged {SKIP_TAG!r}: grading would run every demo"
    code = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    skipped = {code[j] for j in plan([nb.cells[i].source for i in code], reference_skips(path.name[:2], [ROOT]))}
    assert skipped == set(marked)


def test_the_dependency_test_fails_when_a_check_reads_a_demo_cells_name():
    nb = nbformat.read(ROOT / "solutions" / "04_ddp.ipynb", as_version=4)
    broken = copy.deepcopy(nb)
    demo = tagged(broken)[2]
    name = sorted(names(broken.cells[demo].source)[0])[0]
    check_cell = next(i for i, c in enumerate(broken.cells) if c.cell_type == "code" and "check(" in c.source
                      and i > demo)
    broken.cells[check_cell].source += f"\nprint({name})"
    problems = needed_but_tagged(broken)
    assert len(problems) == 1 and f"cell {demo} (tagged {SKIP_TAG!r}) defines {name!r}" in problems[0]
    broken.cells[check_cell].metadata["tags"] = [SKIP_TAG]
    assert any("exercise or check cell" in p for p in needed_but_tagged(broken))


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.stem)
def test_assign_carries_the_tags_into_the_student_copy(path):
    nb = nbformat.read(path, as_version=4)
    student = student_notebook(nb)
    copy_on_disk = nbformat.read(ROOT / "notebooks" / path.name, as_version=4)
    assert tagged(student) == tagged(nb) == tagged(copy_on_disk)
    assert [student.cells[i].source for i in tagged(student)] == [nb.cells[i].source for i in tagged(nb)]

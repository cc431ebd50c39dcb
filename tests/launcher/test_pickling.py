"""Functions of a notebook cell travel by value with their cell's file name (mgpu_lab.launcher.pickling)."""
from __future__ import annotations

import pickle

import pytest

from mgpu_lab.launcher import pickling

CELL = "/tmp/ipykernel_4242/1234567.py"
SOURCE = '''
def scale(x, k=2):
    return x * k

class Model:
    def forward(self, x):
        raise ValueError(f"bad {x}")

def outer(n):
    def inner(x):
        return x + n
    return inner
'''


@pytest.fixture
def cell():
    ns = {"__name__": "__main__"}
    exec(compile(SOURCE, CELL, "exec"), ns)  # noqa: S102 - a notebook cell, as IPython compiles it
    return ns


def test_a_cell_function_keeps_its_file_name_and_still_works(cell):
    fn = pickle.loads(pickling.dumps(cell["scale"]))
    assert fn.__code__.co_filename == CELL
    assert fn(3) == 6 and fn(3, k=5) == 15


def test_methods_and_closures_keep_their_file_names(cell):
    cls = pickle.loads(pickling.dumps(cell["Model"]))
    assert cls.forward.__code__.co_filename == CELL
    with pytest.raises(ValueError, match="bad 1"):
        cls().forward(1)
    inner = pickle.loads(pickling.dumps(cell["outer"](10)))
    assert inner.__code__.co_filename == CELL and inner(1) == 11


def test_dump_writes_what_dumps_gives(cell, tmp_path):
    path = tmp_path / "payload.pkl"
    with open(path, "wb") as f:
        pickling.dump((cell["scale"], (2,), {}), f)
    fn, args, kwargs = pickle.loads(path.read_bytes())
    assert fn(*args, **kwargs) == 4 and fn.__code__.co_filename == CELL


def test_code_named_dynamic_code_stays_so(cell):
    ns = {"__name__": "__main__"}
    exec(compile("def f():\n    return 7\n", "<dynamic-code>", "exec"), ns)  # noqa: S102
    fn = pickle.loads(pickling.dumps(ns["f"]))
    assert fn() == 7 and fn.__code__.co_filename == "<dynamic-code>"


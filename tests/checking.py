"""Helpers shared by the checker tests (tests/course/checks/test_checks_NN.py).

That each solution gets full marks is proven where its notebook runs, not again here: nbval
compares every check cell's ``N/N points · passed`` (the cells are tagged ``nbval-check-output``), and
tests/course/test_grade.py grades every solution notebook in the sandbox. The checker tests hold
the stubs, the wrong answers and the checks' own machinery; tests/mutants the named mutants and
the correct variants.
"""
from __future__ import annotations

import sys
from pathlib import Path

import cloudpickle
import nbformat

# The stub travels to the check's ranks by value: by reference every rank would
# import this module, and nbformat with it (seconds each on a loaded machine).
cloudpickle.register_pickle_by_value(sys.modules[__name__])

def by_value(source: str, *names: str):
    """The objects ``source`` defines under ``names`` (one: the object), belonging to no module.

    cloudpickle ships such a function by value: a rank that got a function of a test file by
    reference would import that file, and with it nbformat (seconds per rank). Keep them in a
    dict or a tuple, not as module attributes, where cloudpickle would find them and pickle
    them by reference.
    """
    namespace: dict = {}
    exec(compile(source, f"<{names[0]}>", "exec"), namespace)
    return tuple(namespace[n] for n in names) if len(names) > 1 else namespace[names[0]]


def solutions_from(notebook: Path, names: tuple[str, ...], namespace: dict | None = None) -> dict:
    """The exercise functions exactly as a solution notebook defines them (its solution cells run)."""
    namespace = {} if namespace is None else namespace
    for cell in nbformat.read(notebook, as_version=4).cells:
        if cell.cell_type == "code" and "### BEGIN SOLUTION" in cell.source:
            exec(compile(cell.source, str(notebook), "exec"), namespace)
    return {name: namespace[name] for name in names}


def stub(*args, **kwargs):
    """What a student copy's exercise does before it is written."""
    raise NotImplementedError("write this function")


def case_starting(result, start: str):
    """The one case of a CheckResult whose name starts with ``start``."""
    matches = [c for c in result.cases if c.name.startswith(start)]
    assert len(matches) == 1, f"no single case starting {start!r} in {[c.name for c in result.cases]}"
    return matches[0]

"""Which reference implementations a notebook's imports make reachable by attribute (run in a fresh process).

``python reach.py NOTEBOOK REF...`` executes every import statement of the
notebook's code cells, then walks attributes from the names they bound: into
modules and classes of this package, never into torch or the standard library.
It prints one JSON line: for each reference it reached, the path (``ddp.train``).
"""
from __future__ import annotations

import ast
import json
import sys
import types


def import_lines(notebook: str) -> list[str]:
    """Every import statement of the notebook's code cells, as source."""
    cells = json.load(open(notebook, encoding="utf-8"))["cells"]
    out = []
    for cell in cells:
        if cell["cell_type"] != "code":
            continue
        src = "".join(cell["source"])
        try:
            tree = ast.parse(src)
        except SyntaxError:  # IPython magics: the cell holds no import we could run
            continue
        out += [ast.unparse(node) for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]
    return out


def ours(obj) -> bool:
    name = obj.__name__ if isinstance(obj, types.ModuleType) else getattr(obj, "__module__", "") or ""
    return name == "mgpu_lab" or name.startswith("mgpu_lab.")


def reachable(roots: dict, targets: dict, loaded: set | None = None) -> dict:
    """``{reference: path}`` for every target function reachable from ``roots`` (name -> object).

    ``loaded``: the names of the modules the notebook's imports loaded; when given, a module outside it is
    not walked (importing a reference to resolve it makes it an attribute of its package: not the notebook's
    doing).
    """
    found, seen = {}, set()
    queue = list(roots.items())
    while queue:
        path, obj = queue.pop(0)
        func = getattr(obj, "__func__", obj)
        for ref, target in targets.items():
            if func is target and ref not in found:
                found[ref] = path
        if id(obj) in seen or not (isinstance(obj, (types.ModuleType, type)) and ours(obj)):
            continue
        if loaded is not None and isinstance(obj, types.ModuleType) and obj.__name__ not in loaded:
            continue
        seen.add(id(obj))
        for name, value in list(vars(obj).items()):
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            queue.append((f"{path}.{name}", value))
    return found


def main(notebook: str, refs: list[str]) -> None:
    from mgpu_lab.course.checks._references import resolve

    namespace: dict = {}
    for line in import_lines(notebook):
        exec(line, namespace)  # noqa: S102 - the course's own notebooks
    loaded = set(sys.modules)  # before resolve() imports the references' modules
    targets = {ref: resolve(ref) for ref in refs}
    roots = {k: v for k, v in namespace.items() if k != "__builtins__"}
    print(json.dumps(reachable(roots, targets, loaded)))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])

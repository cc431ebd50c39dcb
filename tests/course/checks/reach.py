"""Which reference implementations a notebook's imports make reachable by attribute (run in a fresh process).

``python reach.py NOTEBOOK REF...`` (or one request per line to ``python reach.py --serve``, which
forks a fresh child for each) executes every import statement of the
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


def _name(obj) -> str:
    obj = getattr(obj, "__func__", obj)
    return f"{getattr(obj, '__module__', '')}:{getattr(obj, '__qualname__', '')}"


def reachable(roots: dict, refs) -> dict:
    """``{reference: path}`` for every reference (``"module:qualname"``) reachable from ``roots`` (name ->
    object), matched by name: nothing is imported for the walk, so a reference's own module counts only
    where the notebook's imports loaded it."""
    refs, found, seen = set(refs), {}, set()
    queue = list(roots.items())
    while queue:
        path, obj = queue.pop(0)
        name = _name(obj)
        if name in refs and name not in found:
            found[name] = path
        if id(obj) in seen or not (isinstance(obj, (types.ModuleType, type)) and ours(obj)):
            continue
        seen.add(id(obj))
        for key, value in list(vars(obj).items()):
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            queue.append((f"{path}.{key}", value))
    return found


def found_for(notebook: str, refs: list[str]) -> dict:
    """:func:`reachable` from the names the notebook's import statements bind (run here)."""
    namespace: dict = {}
    for line in import_lines(notebook):
        exec(line, namespace)  # noqa: S102 - the course's own notebooks
    return reachable({k: v for k, v in namespace.items() if k != "__builtins__"}, refs)


def main(notebook: str, refs: list[str]) -> None:
    print(json.dumps(found_for(notebook, refs)))


ANSWER = "reach: "  # the start of the line that answers a request of --serve


def serve() -> None:
    """``python reach.py --serve``: import torch once, then for every request line on stdin (a JSON list:
    the notebook, then its references) fork a child that prints :func:`found_for`'s answer on a line
    starting with :data:`ANSWER`. Each child
    is as fresh as a new process as far as this package goes (the server never imports it), without paying
    for torch's import again."""
    import os

    import torch  # noqa: F401 - what every notebook imports first; the walk never enters it
    import torch.distributed  # noqa: F401

    for request in sys.stdin:
        notebook, *refs = json.loads(request)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            try:
                answer = found_for(notebook, refs)
            except BaseException as exc:  # noqa: BLE001 - said on the answer line: the test shows it
                answer = {"error": f"{type(exc).__name__}: {exc}"}
            print(ANSWER + json.dumps(answer), flush=True)  # after anything the imports printed
            os._exit(0)
        os.waitpid(pid, 0)


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        serve()
    else:
        main(sys.argv[1], sys.argv[2:])

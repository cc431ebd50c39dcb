"""Which cells of a submission grading runs: everything but the demos that no exercise needs.

Demo, plot and measurement cells earn no points but cost most of a notebook's
run time. In ``solutions/`` they carry the cell tag :data:`SKIP_TAG`, which
``mgpu-lab assign`` keeps in the student copies. When grading, a cell of the
submission is skipped only when all of these hold:

- its source is, character for character, that of a tagged cell of the lesson's
  reference notebooks (so a learner's edit to a demo cell makes it run, and no
  tag the submission adds or removes changes anything);
- no cell that runs reads a name whose latest definition before it is in that
  cell (so a helper defined in a demo cell that the learner's answer uses, in
  any cell, still gets defined). Names are found statically (:func:`names`),
  which errs on the side of running a cell.

Example:
    >>> cells = ["import torch", "x = torch.ones(3)  # a demo", "print(x.sum())", "y = 1"]
    >>> sorted(plan(cells, skippable={cells[1], cells[3]}))
    [3]
"""
from __future__ import annotations

import ast
import json
from pathlib import Path

__all__ = ["SKIP_TAG", "names", "plan", "tagged", "needed_but_tagged", "reference_skips"]

SKIP_TAG = "skip-in-grading"
_MAGICS = ("run_cell_magic", "run_line_magic")


def _python(source: str) -> ast.Module | None:
    """The cell as Python (IPython's magics and ``!`` lines made into calls); None if it does not parse."""
    try:
        from IPython.core.inputtransformer2 import TransformerManager

        code = TransformerManager().transform_cell(source)
    except Exception:  # noqa: BLE001 - no IPython, or a cell it cannot read: take the source as it is
        code = source
    try:
        return ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def _stored(target: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(target) if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del))}


def _binds(stmt: ast.stmt) -> set[str]:
    """Names a top-level statement binds in the notebook's namespace (not inside functions or classes)."""
    out: set[str] = set()
    todo = [stmt]
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
            continue  # their bodies bind in their own scope
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name != "*"}
        elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            out.add(node.id)
        elif isinstance(node, ast.Lambda) or isinstance(node, (ast.ListComp, ast.SetComp, ast.DictComp,
                                                                 ast.GeneratorExp)):
            continue  # their variables are their own
        todo.extend(ast.iter_child_nodes(node))
    return out


def _local_names(fn) -> set[str]:
    """Parameters and names assigned in a function's (or lambda's) own scope, minus global/nonlocal ones."""
    args = fn.args
    params = [*args.posonlyargs, *args.args, *args.kwonlyargs, *filter(None, [args.vararg, args.kwarg])]
    local = {a.arg for a in params}
    declared: set[str] = set()
    body = fn.body if isinstance(fn.body, list) else [fn.body]
    for stmt in body:
        for node in _scope_walk(stmt):
            if isinstance(node, (ast.Global, ast.Nonlocal)):
                declared |= set(node.names)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                local.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                local |= {(a.asname or a.name).split(".")[0] for a in node.names}
            elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
                local.add(node.id)
    return local - declared


def _scope_walk(node):
    """The nodes of one scope: nested functions, lambdas and classes are yielded but not entered."""
    yield node
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
        return
    for child in ast.iter_child_nodes(node):
        yield from _scope_walk(child)


def _reads(node: ast.AST, local: frozenset = frozenset()) -> set[str]:
    """Names ``node`` reads from the notebook's namespace (loads not local to an enclosing function)."""
    out: set[str] = set()
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        outer = [*node.args.defaults, *filter(None, node.args.kw_defaults)]
        outer += getattr(node, "decorator_list", [])
        for n in outer:
            out |= _reads(n, local)
        inner = local | _local_names(node)
        for stmt in (node.body if isinstance(node.body, list) else [node.body]):
            out |= _reads(stmt, frozenset(inner))
        return out
    if isinstance(node, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
        inner = local | {n for g in node.generators for n in _stored(g.target)}
        for child in ast.iter_child_nodes(node):
            out |= _reads(child, frozenset(inner))
        return out
    if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id not in local:
        out.add(node.id)
    elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name) and node.target.id not in local:
        out.add(node.target.id)
    elif isinstance(node, ast.Call) and (code := _magic_code(node)) and (tree := _python(code)):
        for stmt in tree.body:  # x = %time f(y): the code is a string argument; read it too
            out |= _reads(stmt, local)
    for child in ast.iter_child_nodes(node):
        out |= _reads(child, local)
    return out


def _magic_code(call: ast.Call) -> str | None:
    """The Python code a ``%time``/``%%capture``-style magic call runs (its last string argument)."""
    if getattr(call.func, "attr", None) in _MAGICS and call.args:
        last = call.args[-1]
        if isinstance(last, ast.Constant) and isinstance(last.value, str):
            return last.value
    return None


def _ordered(stmts: list[ast.stmt], bound: set[str]) -> set[str]:
    """Names ``stmts`` read before binding them, in order; adds what they bind to ``bound``."""
    reads: set[str] = set()
    for stmt in stmts:
        if isinstance(stmt, (ast.For, ast.AsyncFor)):
            reads |= _reads(stmt.iter) - bound
            bound |= _stored(stmt.target)
            reads |= _ordered(stmt.body, bound) | _ordered(stmt.orelse, bound)
        elif isinstance(stmt, (ast.With, ast.AsyncWith)):
            for item in stmt.items:
                reads |= _reads(item.context_expr) - bound
                bound |= _stored(item.optional_vars) if item.optional_vars else set()
            reads |= _ordered(stmt.body, bound)
        elif isinstance(stmt, (ast.If, ast.While)):
            reads |= _reads(stmt.test) - bound
            reads |= _ordered(stmt.body, bound) | _ordered(stmt.orelse, bound)
        elif isinstance(stmt, ast.Try) or type(stmt).__name__ == "TryStar":
            reads |= _ordered(stmt.body, bound)
            for handler in stmt.handlers:
                reads |= (_reads(handler.type) - bound) if handler.type else set()
                bound |= {handler.name} if handler.name else set()
                reads |= _ordered(handler.body, bound)
            reads |= _ordered(stmt.orelse, bound) | _ordered(stmt.finalbody, bound)
        elif isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) and _magic_code(stmt.value) \
                and (inner := _python(_magic_code(stmt.value))):
            reads |= _ordered(inner.body, bound)  # %time x = f(y), %%capture cells: their code runs here
        else:
            reads |= _reads(stmt) - bound
            bound |= _binds(stmt)
    return reads


def names(source: str) -> tuple[set[str], set[str]] | None:
    """``(binds, reads)`` of a cell: names it defines at the top level, and names it reads that it had
    not bound itself by then (so they come from earlier cells). None when the cell does not parse."""
    tree = _python(source)
    if tree is None:
        return None
    binds: set[str] = set()
    reads = _ordered(tree.body, binds)
    return binds, reads


def plan(sources: list[str], skippable: set[str]) -> set[int]:
    """Indices (into ``sources``, the code cells in order) of the cells grading may skip.

    A cell is skipped when its source is in ``skippable`` and no cell that runs
    reads a name it was the latest to define; cells that do not parse are never
    skipped and read nothing.
    """
    info = [names(s) for s in sources]
    skip = {i for i, s in enumerate(sources) if s in skippable and info[i] is not None}
    changed = True
    while changed:  # each round runs one more needed cell at least; stops when none is needed
        changed = False
        latest: dict[str, int] = {}
        for i, found in enumerate(info):
            if found is None:
                continue
            binds, reads = found
            if i not in skip:
                needed = {latest[n] for n in reads if latest.get(n) in skip}
                if needed:
                    skip -= needed
                    changed = True
            for n in binds:
                latest[n] = i
    return skip


def tagged(nb) -> list[int]:
    """Indices (into ``nb.cells``) of the code cells tagged :data:`SKIP_TAG`."""
    return [i for i, c in enumerate(nb.cells)
            if c.get("cell_type") == "code" and SKIP_TAG in (c.get("metadata", {}).get("tags") or [])]


def needed_but_tagged(nb) -> list[str]:
    """What makes a tagged cell of ``nb`` (a solution notebook) impossible to skip, in words; [] if nothing.

    A tagged cell that defines a name an untagged cell reads (its latest
    definition before that cell), an exercise cell (``### BEGIN SOLUTION``) or a
    check cell that is tagged, and a tagged cell that does not parse are problems.
    """
    code = [(i, c) for i, c in enumerate(nb.cells) if c.get("cell_type") == "code"]
    marked = set(tagged(nb))
    out, latest = [], {}
    for i, c in code:
        found = names(c.source)
        if i in marked:
            if "### BEGIN SOLUTION" in c.source or "check(" in c.source:
                out.append(f"cell {i} is an exercise or check cell: it must not be tagged {SKIP_TAG!r}")
            if found is None:
                out.append(f"cell {i} does not parse: a tagged cell must")
        if found is None:
            continue
        binds, reads = found
        if i not in marked:
            for n in sorted(reads):
                if latest.get(n) in marked:
                    out.append(f"cell {latest[n]} (tagged {SKIP_TAG!r}) defines {n!r}, which cell {i} reads: "
                               f"untag it, or define {n!r} in a cell that grading runs")
        for n in binds:
            latest[n] = i
    return out


def reference_skips(lesson: str | None, roots: list[Path] | None = None) -> set[str]:
    """Sources of the tagged cells of lesson ``lesson``'s reference notebooks (solution and student copy).

    Args:
        lesson: ``"01"`` ... (the ``NN_`` of a notebook's file name); None: none.
        roots: folders holding ``solutions/`` and ``notebooks/`` (default: the
            repository the grader's ``mgpu_lab`` was installed from).
    """
    if lesson is None:
        return set()
    if roots is None:
        import mgpu_lab

        roots = [Path(mgpu_lab.__file__).resolve().parent.parent]
    out: set[str] = set()
    for root in roots:
        for folder in ("solutions", "notebooks"):
            for path in sorted((Path(root) / folder).glob(f"{lesson}_*.ipynb")):
                try:
                    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
                except (OSError, ValueError, KeyError):
                    continue
                for c in cells:
                    if c.get("cell_type") == "code" and SKIP_TAG in (c.get("metadata", {}).get("tags") or []):
                        src = c.get("source", "")
                        out.add("".join(src) if isinstance(src, list) else src)
    return out

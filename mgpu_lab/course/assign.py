"""solutions/ -> notebooks/: student copies, and refreshing the outputs nbval checks.

Solution code sits between ``### BEGIN SOLUTION`` and ``### END SOLUTION`` lines;
the student copy keeps the indentation and gets ``raise NotImplementedError``
instead. Student copies carry no outputs.

Example:
    >>> from mgpu_lab.course.assign import strip_solutions
    >>> print(strip_solutions("def f():\\n    ### BEGIN SOLUTION\\n    return 1\\n    ### END SOLUTION\\n"))
    def f():
        raise NotImplementedError("write your solution here")
    <BLANKLINE>
"""
from __future__ import annotations

from pathlib import Path

from .nbio import nbformat as _nbformat

nbformat = _nbformat()

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
# nbval compares the outputs of cells with this tag (a cell tag, kept by the student copy, so the learner's
# check cells hold nothing but the check itself).
CHECK_TAG = "nbval-check-output"
# A measured cell (a table, a figure, a timing) whose output a reader on GitHub should see beside the text that
# describes it: `refresh` keeps its output too. nbval --nbval-lax does not compare it (its numbers vary per run).
KEEP_TAG = "keep-output"
KERNELSPEC = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
STUB = 'raise NotImplementedError("write your solution here")'


class MarkerError(ValueError):
    """Unmatched or nested solution markers; the message quotes the notebook and cell."""


def _quote(source: str, where: str, lineno: int, problem: str) -> MarkerError:
    lines = source.splitlines()
    shown = "\n".join(f"{'>' if i == lineno else ' '} {i + 1:3d} | {line}" for i, line in enumerate(lines))
    return MarkerError(f"{where}, line {lineno + 1}: {problem}\n{shown}")


def strip_solutions(source: str, where: str = "cell") -> str:
    """Replace every solution block of one cell's source with the stub.

    Args:
        source: the cell's source.
        where: how to name the cell in errors, e.g. ``"solutions/01.ipynb cell 7"``.

    Raises:
        MarkerError: a BEGIN without END, an END without BEGIN, or nested blocks.
    """
    out, start = [], None
    lines = source.splitlines(keepends=True)
    for i, line in enumerate(lines):
        text = line.strip()
        if text.startswith(BEGIN):
            if start is not None:
                raise _quote(source, where, i, f"nested '{BEGIN}' (the block opened on line {start + 1} "
                                                f"is not closed); close it with '{END}' first")
            start = i
            indent = line[: len(line) - len(line.lstrip())]
            out.append(f"{indent}{STUB}\n")
        elif text.startswith(END):
            if start is None:
                raise _quote(source, where, i, f"'{END}' without a '{BEGIN}' before it")
            start = None
        elif start is None:
            out.append(line)
    if start is not None:
        raise _quote(source, where, start, f"'{BEGIN}' is never closed; add a '{END}' line")
    text = "".join(out)
    return text[:-1] if text.endswith("\n") and not source.endswith("\n") else text


def is_check_cell(cell) -> bool:
    """Whether nbval compares this cell's outputs (it carries the ``nbval-check-output`` tag)."""
    return cell.cell_type == "code" and CHECK_TAG in cell.get("metadata", {}).get("tags", [])


def student_notebook(nb, where: str = "notebook"):
    """The student copy of a solution notebook (a new object; outputs cleared)."""
    student = nbformat.from_dict(nb)
    for index, cell in enumerate(student.cells):
        if cell.cell_type != "code":
            continue
        cell.source = strip_solutions(cell.source, f"{where} cell {index}")
        cell.outputs = []
        cell.execution_count = None
        cell.metadata.pop("execution", None)
    # The kernel's own kernelspec: JupyterLab writes it into a notebook that holds another (e.g. display name
    # "Python 3"), which then opens marked unsaved.
    student.metadata["kernelspec"] = dict(KERNELSPEC)
    return student


def _write(nb, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(nbformat.writes(nb) + "\n", encoding="utf-8")


def assign(sources: list[Path] | None = None, out_dir: Path | str = "notebooks",
           check_only: bool = False) -> list[Path]:
    """Write the student copy of each solution notebook into ``out_dir``.

    Args:
        sources: solution notebooks (default: ``solutions/*.ipynb``).
        out_dir: where the student copies go.
        check_only: write nothing; return the copies that are missing or differ.

    Returns:
        The paths written (or, with ``check_only``, the ones out of date).

    Raises:
        MarkerError: bad solution markers (nothing is written then).
        FileNotFoundError: no solution notebook found.
    """
    sources = [Path(p) for p in sources] if sources else sorted(Path("solutions").glob("*.ipynb"))
    if not sources:
        raise FileNotFoundError("no solution notebooks: pass paths or run from the repository root "
                                "(looked for solutions/*.ipynb)")
    out_dir = Path(out_dir)
    rendered = {}
    for src in sources:  # all first: a marker error anywhere writes nothing
        nb = nbformat.read(src, as_version=4)
        rendered[out_dir / src.name] = nbformat.writes(student_notebook(nb, str(src))) + "\n"
    changed = [p for p, text in rendered.items() if not p.exists() or p.read_text(encoding="utf-8") != text]
    if not check_only:
        for path in changed:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(rendered[path], encoding="utf-8")
    return changed


def refresh(path: Path | str, timeout: float = 600) -> int:
    """Execute a solution notebook; keep the outputs of the cells tagged ``nbval-check-output`` or ``keep-output``.

    Every other output is dropped, so the committed notebook holds what nbval
    compares and the measured results a reader holds the text against (the
    student copy clears them all). Returns the number of cells whose outputs were kept.

    Raises:
        nbclient.exceptions.CellExecutionError: a cell failed (nothing is written).
    """
    from nbclient import NotebookClient

    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    nb.metadata["kernelspec"] = dict(KERNELSPEC)  # JupyterLab opens it without asking, and unchanged
    NotebookClient(nb, timeout=timeout, kernel_name="python3", store_widget_state=True,  # False: KeyError on interact's Output
                   resources={"metadata": {"path": str(path.parent.resolve())}}).execute()  # as nbval: cwd = its folder
    nb.metadata.pop("widgets", None)  # widget views differ per run; nbval compares none
    kept = 0
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        cell.metadata.pop("execution", None)
        if is_check_cell(cell) or KEEP_TAG in cell.get("metadata", {}).get("tags", []):
            kept += 1
        else:
            cell.outputs = []
            cell.execution_count = None
    _write(nb, path)
    return kept

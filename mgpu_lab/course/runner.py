"""What runs inside a grading sandbox: the submitted notebook, then the learner's code for the checks.

Two modes, each a process the grader starts in the submission's
:class:`~mgpu_lab.course.sandbox.Sandbox`:

``notebook NAME FD [SKIPS]``
    Executes the notebook in a Jupyter kernel (started here, so inside the
    sandbox), all but the demo cells that :func:`mgpu_lab.course.cells.plan`
    lets it skip (``SKIPS``: a JSON list of the sources of the lesson's cells
    tagged for skipping), writing its progress to file descriptor ``FD`` as JSON lines:
    ``{"cell": i}`` when cell ``i`` starts, ``{"ended": "ok"}``,
    ``{"ended": "died", "cell": i}`` or ``{"ended": "error", "why": ...}``, and before
    the end ``{"syntax": [{"cell": i, "line": n, "what": ...}]}`` for cells that did not
    compile (a syntax error defines nothing of the cell: the grader says where).
    ``MGPU_LAB_GRADE_ANSWERS`` is set, so every ``check(...)`` in the kernel
    judges nothing: it saves the learner's objects by value
    (:mod:`mgpu_lab.course.checks._answers`).

``serve ANSWERS FD``
    Answers the grader's requests, one at a time: frames on stdin carry a
    pickled request (the grader's probe functions by reference, arguments, and
    references to saved answers); it runs them with the launcher, in ranks
    inside the sandbox, and writes to ``FD`` a JSON header and, for a result,
    the result saved with ``torch.save``. Only plain data goes back (numbers,
    strings, bytes, lists, tuples, dicts, sets, tensors, devices, dtypes): the
    grader reads it with ``torch.load(weights_only=True)`` and unpickles nothing.

The grader trusts nothing that comes out of here: the learner's code runs in
this sandbox and could rewrite any of it. What it could forge is only the
evidence about its own answers, and a check's points are capped by the grader.
"""
from __future__ import annotations

import collections
import io
import json
import os
import pickle
import struct
import sys

MAX_FRAME = 64 << 20
_PLAIN = (type(None), bool, int, float, complex, str, bytes, bytearray)


def read_frame(stream) -> bytes | None:
    """One length-prefixed frame from a binary stream; None at end of stream."""
    head = stream.read(8)
    if len(head) < 8:
        return None
    (size,) = struct.unpack(">Q", head)
    if size > MAX_FRAME:
        raise ValueError(f"a frame of {size} bytes is larger than {MAX_FRAME}")
    data = stream.read(size)
    if len(data) < size:
        return None
    return data


def frame(data: bytes) -> bytes:
    return struct.pack(">Q", len(data)) + data


def write_all(fd: int, data: bytes) -> None:
    """Write every byte of ``data`` to ``fd``: a write to a pipe that a signal interrupts after part of
    the data returns what it wrote, and an unbuffered file's ``write`` does not try again (a reply cut
    that way left the grader waiting for its rest until the timeout)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


# -- notebook mode -----------------------------------------------------------------------
def _skip_demos(nb, skips: str | None) -> list[int]:
    """Drop the cells grading may skip from ``nb``; the original index of every cell left."""
    from mgpu_lab.course.cells import plan

    kept = list(range(len(nb.cells)))
    if not skips:
        return kept
    with open(skips, encoding="utf-8") as f:
        skippable = set(json.load(f))
    code = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    dropped = {code[j] for j in plan([nb.cells[i].source for i in code], skippable)}
    nb.cells = [c for i, c in enumerate(nb.cells) if i not in dropped]
    return [i for i in kept if i not in dropped]


def run_notebook(name: str, fd: int, skips: str | None = None) -> int:
    """Execute ``name`` in a fresh kernel (cells that raise do not stop it, demo cells that no exercise
    needs are skipped); report progress on ``fd``, with the cells' indices in the notebook as submitted."""
    out = os.fdopen(fd, "w", buffering=1)

    def note(**event):
        out.write(json.dumps(event) + "\n")

    try:
        from mgpu_lab.course.nbio import nbformat as import_nbformat

        nbformat = import_nbformat()  # before nbclient, which imports it too
        from nbclient import NotebookClient
        from nbclient.exceptions import DeadKernelError

        nb = nbformat.read(name, as_version=4)
        index = _skip_demos(nb, skips)
    except Exception as exc:  # noqa: BLE001 - whatever is wrong with the file, say it
        note(ended="error", why=f"the notebook could not be read: {type(exc).__name__}: {exc}"[:300])
        return 0
    # The kernel's check cells launch nothing (they save the answers): no process server to warm up beside
    # it. And once the last cell has run, the kernel is killed, not asked to shut down (seconds); the
    # sandbox ends everything it started anyway.
    os.environ["MGPU_LAB_PREWARM"] = "0"
    client = NotebookClient(nb, timeout=None, allow_errors=True, kernel_name="python3", shutdown_kernel="immediate",
                            resources={"metadata": {"path": os.getcwd()}})
    cell = {"index": None}

    def started(cell_index, **_):
        cell["index"] = index[cell_index]
        note(cell=index[cell_index])

    client.on_cell_start = lambda cell, cell_index: started(cell_index)
    try:
        client.execute()
    except DeadKernelError:
        note(syntax=syntax_errors(nb, index))
        note(ended="died", cell=cell["index"])
        return 0
    note(syntax=syntax_errors(nb, index))
    note(ended="ok")
    return 0


_SYNTAX = ("SyntaxError", "IndentationError", "TabError")


def syntax_errors(nb, index: list[int]) -> list[dict]:
    r"""The cells of the executed ``nb`` that did not compile: original cell index, line, and the error.

    Example:
        >>> from nbformat.v4 import new_code_cell, new_notebook, new_output
        >>> bad = new_code_cell("x = 1\ndef f(:", outputs=[new_output("error", ename="SyntaxError",
        ...     evalue="invalid syntax", traceback=["  Cell In[2], line 2\n    def f(:\n          ^", "SyntaxError: invalid syntax"])])
        >>> syntax_errors(new_notebook(cells=[new_code_cell("1"), bad]), [0, 3])
        [{'cell': 3, 'line': 2, 'what': 'SyntaxError: invalid syntax'}]
    """
    import re

    found = []
    for k, c in enumerate(nb.cells):
        for o in c.get("outputs", []) if c.cell_type == "code" else []:
            if o.get("output_type") == "error" and o.get("ename") in _SYNTAX:
                text = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(o.get("traceback") or []) + " " + str(o.get("evalue")))
                line = re.search(r"line (\d+)", text)
                found.append({"cell": index[k], "line": int(line.group(1)) if line else None,
                              "what": f"{o['ename']}: {str(o.get('evalue', ''))[:200]}"})
    return found


# -- serve mode --------------------------------------------------------------------------
class _Answers:
    """The saved answers of the notebook, loaded (by value) on first use."""

    def __init__(self, folder: str):
        self.folder, self.loaded = folder, {}

    def get(self, file: str, name: str):
        if file not in self.loaded:
            import cloudpickle

            with open(os.path.join(self.folder, os.path.basename(file)), "rb") as f:
                self.loaded[file] = cloudpickle.load(f)
        return self.loaded[file][name]


class _Request(pickle.Unpickler):
    def __init__(self, data: bytes, answers: _Answers):
        super().__init__(io.BytesIO(data))
        self.answers = answers

    def persistent_load(self, pid):
        kind, file, name = pid
        if kind != "answer":
            raise pickle.UnpicklingError(f"unknown reference {kind!r}")
        return self.answers.get(file, name)


def unjudgeable(value, where: str = "the result", depth: int = 0) -> str:
    """Why ``value`` cannot go back to the grader as plain data; "" when it can."""
    import torch

    if depth > 50:
        return f"{where} is nested too deeply"
    if isinstance(value, _PLAIN) and type(value) in _PLAIN:
        return ""
    if type(value) in (torch.Tensor, torch.nn.Parameter, torch.device, torch.dtype, torch.Size):
        return ""
    if type(value) in (list, tuple, set):
        return next((why for i, v in enumerate(value) if (why := unjudgeable(v, f"{where}[{i}]", depth + 1))), "")
    if type(value) in (dict, collections.OrderedDict):
        for k, v in value.items():
            why = unjudgeable(k, f"a key of {where}", depth + 1) or unjudgeable(v, f"{where}[{k!r}]", depth + 1)
            if why:
                return why
        return ""
    return f"{where} is a {type(value).__module__}.{type(value).__qualname__}"


def _error(exc: BaseException) -> dict:
    from mgpu_lab.launcher.errors import LaunchError, LaunchTimeout

    if isinstance(exc, LaunchError):
        return {"kind": "timeout" if isinstance(exc, LaunchTimeout) else "launch", "message": str(exc),
                "exc_type": exc.exc_type, "traceback": exc.traceback, "output": exc.output, "phase": exc.phase,
                "rank": exc.rank, "world_size": exc.world_size, "exitcode": exc.exitcode}
    return {"kind": "error", "type": type(exc).__name__, "message": str(exc)}


def answer(request: dict) -> tuple[dict, bytes]:
    """Carry out one request; the JSON header and the ``torch.save`` bytes of the result."""
    import torch

    from mgpu_lab.launcher.launch import run

    try:
        if request["op"] == "local":
            value = request["fn"](*request["args"])
        else:
            value = run(request["fn"], request["nprocs"], request["args"], request["kwargs"],
                        backend=request["backend"], timeout=request["timeout"], init=request["init"],
                        quiet=True, echo=False)
    except Exception as exc:  # noqa: BLE001 - every failure goes back as data
        return _error(exc), b""
    why = unjudgeable(value, "the value")
    if why:
        return {"kind": "unjudgeable", "message": why}, b""
    buf = io.BytesIO()
    torch.save({"value": value}, buf)
    return {"kind": "ok"}, buf.getvalue()


def serve(folder: str, fd: int) -> int:
    """Answer framed requests from stdin on ``fd`` until stdin closes."""
    import torch  # noqa: F401 - before the fork server is forked from here: it need not import torch again

    from mgpu_lab.launcher import procs  # not .launch yet: importing it starts a server the usual way

    procs.prewarm(fork=True)  # nothing but imports has run here yet
    os.dup2(2, 1)  # stray prints (e.g. while unpickling an answer) must not mix with the replies
    answers = _Answers(folder)
    while (data := read_frame(sys.stdin.buffer)) is not None:
        try:
            header, payload = answer(_Request(data, answers).load())
        except Exception as exc:  # noqa: BLE001 - e.g. an answer that cannot be loaded here
            header, payload = {"kind": "error", "type": type(exc).__name__, "message": str(exc)}, b""
        header = json.dumps(header, default=str).encode()
        write_all(fd, frame(header) + frame(payload))
    return 0


def main(argv: list[str]) -> int:
    if len(argv) in (3, 4) and argv[0] == "notebook":
        return run_notebook(argv[1], int(argv[2]), *argv[3:])
    if len(argv) == 3 and argv[0] == "serve":
        return serve(argv[1], int(argv[2]))
    print("usage: python -m mgpu_lab.course.runner notebook NAME FD [SKIPS] | serve ANSWERS FD", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

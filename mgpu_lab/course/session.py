"""The grader's side of judging a submission: its checkers, run here, on answers that stay in the sandbox.

After the notebook has run (:mod:`mgpu_lab.course.runner`, notebook mode), the
sandbox's folder holds the learner's answers, pickled by value, and a manifest
naming the exercise of each. The grader:

- reads the manifest as untrusted text: known exercise ids of the lesson only,
  the last check of each counts, anything malformed is ignored with a note;
- runs each exercise's checker itself (:func:`mgpu_lab.course.checks.run_checker`)
  with an :class:`Answer` per argument: a reference, never the object;
- sends every ``t.call`` / ``t.ranks`` / ``t.local`` of the checker to a
  :class:`Session`, a ``serve`` runner in the same sandbox, which runs it in
  ranks there and sends back plain data, read with ``torch.load(weights_only=True)``;
- takes the points from its own registry: one per passed case, at most the
  exercise's points, each exercise once.

Example:
    >>> from mgpu_lab.course.sandbox import Sandbox
    >>> with Sandbox() as box, Session(box, deadline=time.monotonic() + 600) as s:
    ...     s.run(max, 1, ([1, 2],), {}, timeout=30)
    [2]
"""
from __future__ import annotations

import io
import json
import os
import re
import selectors
import subprocess
import sys
import time

from mgpu_lab.launcher import pickling
from mgpu_lab.launcher.errors import LaunchError, LaunchTimeout

from .checks import CheckResult, Exercise, Tester, run_checker
from .runner import MAX_FRAME, frame
from .sandbox import Sandbox

__all__ = ["Answer", "Session", "read_manifest", "run_checkers"]

ANSWERS = "answers"
MANIFEST_LIMIT = 1 << 20
REPLY_GRACE = 90.0  # seconds a reply may take beyond the call's own timeout (start-up of the ranks)
_FILE = re.compile(r"^\d{1,6}\.pkl$")


class Answer:
    """A learner's object as the grader holds it: which saved file, which argument. Opaque."""

    __slots__ = ("file", "name")

    def __init__(self, file: str, name: str):
        self.file, self.name = file, name

    def __repr__(self) -> str:
        return f"<answer {self.name} ({self.file}), judged in the sandbox>"


class _Request(pickling.Pickler):
    def persistent_id(self, obj):
        return ("answer", obj.file, obj.name) if isinstance(obj, Answer) else None


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")  # the sandbox's text must not drive the instructor's terminal


def clean(value, limit: int = 20000) -> str:
    """Text from the sandbox as the grader shows it: cut to ``limit``, control characters replaced."""
    return "" if value is None else _CONTROL.sub("?", str(value)[:limit])


def _int(value):
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class Session:
    """A ``serve`` runner in the sandbox: runs the checkers' requests there, one at a time.

    Args:
        box: the submission's sandbox (its folder holds the answers).
        deadline: ``time.monotonic()`` after which every request fails as timed out.
    """

    def __init__(self, box: Sandbox, deadline: float):
        self.box, self.deadline = box, deadline
        self.proc = None
        self._replies = None

    def start(self) -> "Session":
        """Start the runner now (it imports torch and starts its forkserver while other work goes on)."""
        if self.proc is None:
            self._start()
        return self

    def ready(self) -> None:
        """Check that a runner started early still answers; one that does not is replaced at the next request.

        It shares the sandbox user's limits with the notebook that ran beside it
        (a fork bomb there may have starved it); nothing else of the notebook
        can reach it (its own PID and network namespaces).
        """
        if self.proc is not None:
            try:
                self.local(os.getpid)
            except Exception:  # noqa: BLE001 - whatever it answered, a fresh runner will do
                self._stop()

    def _start(self) -> None:
        read, write = os.pipe()
        try:
            self.proc = self.box.start([sys.executable, "-P", "-s", "-m", "mgpu_lab.course.runner", "serve",
                                        f"{self.box.inside}/{ANSWERS}", str(write)],
                                       stdin=subprocess.PIPE, pass_fds=(write,))
        finally:
            os.close(write)
        self._replies = read

    def _stop(self) -> None:
        if self.proc is not None:
            self.box.kill(self.proc)
            self.proc.stdin.close()
            os.close(self._replies)
            self.proc = self._replies = None

    def _write(self, data: bytes, until: float) -> None:
        fd = self.proc.stdin.fileno()
        os.set_blocking(fd, False)  # a runner that stops reading must not block the grader
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_WRITE)
            while data:
                left = until - time.monotonic()
                if left <= 0 or not sel.select(left):
                    raise TimeoutError
                data = data[os.write(fd, data):]

    def _read(self, n: int, until: float) -> bytes:
        data = b""
        with selectors.DefaultSelector() as sel:
            sel.register(self._replies, selectors.EVENT_READ)
            while len(data) < n:
                left = until - time.monotonic()
                if left <= 0 or not sel.select(left):
                    raise TimeoutError
                chunk = os.read(self._replies, n - len(data))
                if not chunk:
                    raise EOFError
                data += chunk
        return data

    def _frame(self, until: float) -> bytes:
        size = int.from_bytes(self._read(8, until), "big")
        if size > MAX_FRAME:
            raise ValueError(f"a reply of {size} bytes")
        return self._read(size, until)

    def _ask(self, request: dict, timeout: float):
        if time.monotonic() >= self.deadline:
            raise LaunchTimeout("launch timed out after 0 s: the time for grading this notebook ran out "
                                "(see --timeout)")
        buf = io.BytesIO()
        _Request(buf).dump(request)
        if self.proc is None:
            self._start()
        until = min(time.monotonic() + timeout + REPLY_GRACE, self.deadline + REPLY_GRACE)
        try:
            self._write(frame(buf.getvalue()), until)
            header, payload = json.loads(self._frame(until)), self._frame(until)
        except (OSError, EOFError, TimeoutError, ValueError, RecursionError) as exc:
            self._stop()  # a runner that hangs or talks nonsense is not asked again
            if isinstance(exc, TimeoutError):
                raise LaunchTimeout(f"launch timed out after {timeout:g} s: the sandbox did not answer") from None
            raise LaunchError(f"rank 0/1 died without raising: the sandbox's runner stopped answering "
                              f"({type(exc).__name__})") from None
        return self._reply(header, payload)

    def _reply(self, header, payload: bytes):
        import torch

        kind = header.get("kind") if isinstance(header, dict) else None
        if kind == "ok":
            try:
                return torch.load(io.BytesIO(payload), weights_only=True)["value"]
            except Exception as exc:  # noqa: BLE001 - anything but plain data is refused
                return self._unjudgeable(f"the reply could not be read as plain data ({type(exc).__name__})")
        if kind == "unjudgeable":
            return self._unjudgeable(clean(header.get("message"), 300))
        if kind in ("launch", "timeout"):
            cls = LaunchTimeout if kind == "timeout" else LaunchError
            raise cls(clean(header.get("message")), exc_type=clean(header.get("exc_type"), 200) or None,
                      traceback=clean(header.get("traceback")), output=clean(header.get("output")),
                      phase=clean(header.get("phase"), 20) or None, rank=_int(header.get("rank")),
                      world_size=_int(header.get("world_size")), exitcode=_int(header.get("exitcode")))
        name = clean(header.get("type"), 100) if isinstance(header, dict) else ""
        cls = {"TypeError": TypeError, "ValueError": ValueError}.get(name, RuntimeError)
        raise cls(clean(header.get("message") if isinstance(header, dict) else header, 2000))

    @staticmethod
    def _unjudgeable(why: str):
        from .checks import CaseFailed

        raise CaseFailed("your code returned something the grader cannot judge: return plain data (numbers, "
                         "strings, lists, tuples, dicts, tensors, devices)", "plain data", why)

    def run(self, fn, nprocs: int, args: tuple, kwargs: dict, *, backend=None, timeout: float, init: bool = True,
            **_ignored) -> list:
        """Like the launcher's ``run``, in the sandbox: the ranks' results, or LaunchError/LaunchTimeout."""
        timeout = max(1.0, min(timeout, self.deadline - time.monotonic()))
        values = self._ask({"op": "run", "fn": fn, "nprocs": nprocs, "args": args, "kwargs": kwargs,
                            "backend": backend, "timeout": timeout, "init": init}, timeout)
        if not isinstance(values, list) or len(values) != nprocs:
            return self._unjudgeable(f"{type(values).__name__} instead of one result per rank")
        return values

    def local(self, fn, *args, timeout: float = 60.0):
        """``fn(*args)`` in the sandbox's runner (a checker's helper, e.g. reading files the ranks wrote)."""
        return self._ask({"op": "local", "fn": fn, "args": args}, timeout)

    def close(self) -> None:
        self._stop()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_manifest(data: bytes | None, expected: list[Exercise]) -> tuple[dict, list[str]]:
    """The answer of each expected exercise (the last check of it counts), and notes on what was ignored.

    Returns:
        ``{exercise id: {"file": name} or {"error": why}}`` and notes.
    """
    known = {e.id for e in expected}
    found, ignored = {}, []
    for line in (data or b"").decode("utf-8", errors="replace").splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            entry = None
        ex = entry.get("exercise") if isinstance(entry, dict) else None
        if not isinstance(ex, str) or ex not in known:
            ignored.append(repr(ex)[:40] if isinstance(ex, str) else "a malformed line")
        elif isinstance(entry.get("file"), str) and _FILE.match(entry["file"]):
            found[ex] = {"file": entry["file"]}
        elif isinstance(entry.get("error"), str):
            found[ex] = {"error": clean(entry["error"], 500)}
        else:
            ignored.append(f"a malformed line for {ex}")
    notes = []
    if ignored:
        shown = sorted(set(ignored))
        notes.append(f"ignored {len(ignored)} recorded check(s) that are no exercise of this notebook: "
                     + ", ".join(shown[:5]) + (" ..." if len(shown) > 5 else ""))
    return found, notes


def _params(ex: Exercise) -> list[str]:
    import inspect

    return list(inspect.signature(ex.checker).parameters)[1:]


def run_checkers(box: Sandbox, expected: list[Exercise], session: Session) -> tuple[dict[str, CheckResult], list[str]]:
    """Judge every expected exercise the notebook checked, through ``session``; results by id, and notes."""
    try:
        manifest = box.read(f"{ANSWERS}/manifest.jsonl", MANIFEST_LIMIT)
    except ValueError as exc:
        return {}, [f"the answers could not be read: {exc}"]
    found, notes = read_manifest(manifest, expected)
    results = {}
    for ex in expected:
        entry = found.get(ex.id)
        if entry is None:
            continue
        if "error" in entry:
            results[ex.id] = CheckResult(ex.id, 0, ex.points, "failed", [],
                                         f"your objects could not be saved for grading: {entry['error']}")
            continue
        t = Tester(ex, runner=session.run, local=session.local, grading=True)
        named = {p: Answer(entry["file"], p) for p in _params(ex)}
        try:
            result = run_checker(ex, t, (), named)
        except Exception as exc:  # noqa: BLE001 - one exercise's trouble must not stop the others
            result = CheckResult(ex.id, 0, ex.points, "failed", [],
                                 f"the grader could not judge it: {type(exc).__name__}: {exc}"[:500])
        result.points = min(max(int(result.points), 0), ex.points)
        results[ex.id] = result
    return results, notes

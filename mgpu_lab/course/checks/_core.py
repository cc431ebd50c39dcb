"""The checker framework: judging cases, running learner code safely (the registry: :mod:`._registry`).

A lesson's checks module registers one checker per exercise::

    @exercise("01.pick_device", points=4, description="cuda:N when GPUs exist, cpu otherwise")
    def _(t, pick_device):
        with t.case("no GPU visible: pick_device() is cpu", hint="..."):
            t.equal(t.call(pick_device), torch.device("cpu"))

Learner code never runs in the kernel: :meth:`Tester.call` runs it in a fresh
rank process (and :meth:`Tester.ranks` in several), so a crash or a hang is a
failed case with its reason, within a bounded time, and the kernel lives on.
When a grader runs the notebook, ``check`` judges nothing (it saves the answers,
:mod:`._answers`); the grader calls :func:`judge` itself with a Tester whose
``runner`` runs the learner's code in the submission's sandbox.
"""
from __future__ import annotations

import inspect
import re
import shutil
import tempfile
import traceback
from contextlib import contextmanager

from ._answers import grading_folder, save
from ._registry import Exercise, exercise, exercises, get  # lesson modules import them from here
from ._result import Case, CheckResult
from .sim.outcome import outcome

__all__ = ["CALL_TIMEOUT", "CaseFailed", "Exercise", "NotAttempted", "Tester", "check", "exercise", "exercises",
           "get", "run_checker"]

# Seconds one call of learner code may take; read at call time, so tests can lower it.
CALL_TIMEOUT = 60.0


class NotAttempted(Exception):
    """The learner's code still raises NotImplementedError."""


class CaseFailed(Exception):
    """A case's verdict: failed, with what was expected, what came, and a hint."""

    def __init__(self, hint: str = "", expected: str = "", got: str = ""):
        super().__init__(hint)
        self.hint, self.expected, self.got = hint, expected, got


def _short(value, limit: int = 300) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Tester:
    """Collects the cases of one check; passed to every checker as ``t``.

    ``runner`` (default: the launcher's ``run``) and ``local`` (default: call
    the function here) are where the learner's code and the checker's helpers
    run; a grader passes its sandbox's, and ``grading=True``.
    """

    def __init__(self, ex: Exercise, runner=None, local=None, grading: bool = False):
        self.exercise = ex
        self.cases: list[Case] = []
        self._runner, self._local, self.grading = runner, local, grading
        self._scratch: list[str] = []
        # After one call hangs, later calls fail at once: a hanging answer must
        # not cost the learner CALL_TIMEOUT seconds per remaining case.
        self._hung = False

    @contextmanager
    def case(self, name: str, hidden: bool = False, hint: str = "", points: int = 1):
        """Judge one case, worth ``points`` (one unless the lesson's idea earns more; 0: practice, reported but
        unpaid): it passes unless its body raises.

        A :class:`CaseFailed` carries the details; an error in the learner's code
        (from :meth:`call`) fails the case with the error; NotImplementedError
        ends the whole check as "not attempted".
        """
        from mgpu_lab.launcher.errors import LaunchError, LaunchTimeout

        try:
            yield
        except NotAttempted:
            raise
        except CaseFailed as exc:
            self._add(name, False, hidden, points, exc.expected, exc.got, exc.hint or hint)
        except LaunchTimeout as exc:
            self._hung = True
            waited = exc.args[0].split(' after ')[1].split(':')[0]
            self._add(name, False, hidden, points, got=f"no answer within {waited}",
                      hint="your code hangs or is far too slow: look for a collective that not every "
                           "rank calls, or an endless loop" + (f"; {hint}" if hint else ""))
        except LaunchError as exc:
            if exc.exc_type == "NotImplementedError":
                raise NotAttempted() from None
            if exc.exc_type == "ReferenceCalled":  # the message says which reference, and what to do
                said = str(exc).splitlines()[0].split("ReferenceCalled: ", 1)[-1]
                self._add(name, False, hidden, points, got=said,
                          hint="the check judges your own code, not the library's")
                return
            self._add(name, False, hidden, points, got=_error_text(exc), hint=hint)
        else:
            self._add(name, True, hidden, points)

    def _add(self, name, passed, hidden, points=1, expected="", got="", hint=""):
        self.cases.append(Case(name, passed, hidden, expected, got, hint, points))

    # -- verdict helpers --------------------------------------------------
    def equal(self, got, expected, hint: str = "") -> None:
        """Fail the case unless ``got == expected`` (tensors: same values and dtype)."""
        import torch

        if isinstance(expected, torch.Tensor) or isinstance(got, torch.Tensor):
            same = (isinstance(got, torch.Tensor) and isinstance(expected, torch.Tensor)
                    and got.shape == expected.shape and got.dtype == expected.dtype
                    and bool(torch.equal(got, expected)))
        else:
            same = type(got) is type(expected) and got == expected if isinstance(expected, bool) else got == expected
        if not same:
            raise CaseFailed(hint, _short(expected), _short(got))

    def close(self, got, expected, hint: str = "", atol: float = 1e-5, rtol: float = 1e-4) -> None:
        """Fail the case unless two numbers or tensors agree to float tolerance."""
        import torch

        g = torch.as_tensor(got, dtype=torch.float64)
        e = torch.as_tensor(expected, dtype=torch.float64)
        if g.shape != e.shape or not torch.allclose(g, e, atol=atol, rtol=rtol):
            raise CaseFailed(hint, _short(expected), _short(got))

    def fail(self, hint: str, expected="", got="") -> None:
        """Fail the case now."""
        raise CaseFailed(hint, str(expected), str(got))

    # -- running the learner's code ----------------------------------------
    def call(self, fn, *args, prepare=None, catch: bool = False, timeout: float | None = None, **kwargs):
        """Run ``fn(*args, **kwargs)`` in a fresh process and return its result.

        Args:
            prepare: ``(function, args)`` run first in that process, e.g. to
                simulate GPUs; must be importable (module level).
            catch: return the call's outcome (:func:`.sim.outcome.outcome`: ``("ok", value)`` or
                ``("raised", type name, message)``) instead of failing the case when ``fn`` raises.
            timeout: seconds before the call counts as hung (default ``CALL_TIMEOUT``).
        """
        self._skip_if_hung()
        timeout = CALL_TIMEOUT if timeout is None else timeout
        return self._run(_harness, 1, (fn, args, kwargs, prepare, catch), {}, timeout=timeout,
                         init=False, backend=None)[0]

    def ranks(self, fn, nprocs: int, *args, timeout: float | None = None, backend="gloo", **kwargs) -> list:
        """Run ``fn`` in ``nprocs`` real ranks (process group initialised); results in rank order.

        The backend is gloo unless asked otherwise: probes judge CPU evidence, and
        a check must behave the same on a laptop and on an 8-GPU node.
        """
        self._skip_if_hung()
        timeout = CALL_TIMEOUT if timeout is None else timeout
        return self._run(fn, nprocs, args, kwargs, backend=backend, timeout=timeout, init=True)

    def local(self, fn, *args, timeout: float = 60.0):
        """Run a checker's helper ``fn(*args)`` (module level) where the learner's code runs.

        For what the checker must see there and nowhere else, e.g. files the
        learner's code wrote: a grader runs it in the sandbox (within ``timeout``
        seconds) and gets plain data back.
        """
        return fn(*args) if self._local is None else self._local(fn, *args, timeout=timeout)

    def scratch(self, prefix: str) -> str:
        """A new empty directory where the learner's code runs (a grader's sandbox when grading).

        Read what the learner's code wrote there with :meth:`local`. It is removed
        when the check ends (a grader removes the whole sandbox).
        """
        return self.remove_after(self.local(tempfile.mkdtemp, None, prefix))

    def remove_after(self, path: str | None) -> str | None:
        """Remove the directory ``path`` (made where the learner's code runs) when the check ends."""
        if path and not self.grading:
            self._scratch.append(path)
        return path

    def cleanup(self) -> None:
        """Remove the directories of :meth:`scratch` and :meth:`remove_after`."""
        while self._scratch:
            shutil.rmtree(self._scratch.pop(), ignore_errors=True)

    def _run(self, fn, nprocs, args, kwargs, **options):
        if self.exercise.references:  # the learner's code runs with tripwires on the references
            fn, args, kwargs = _armed_call, (self.exercise.references, fn, args, kwargs), {}
        if self._runner is None:
            from mgpu_lab.launcher.launch import run

            return run(fn, nprocs, args, kwargs, quiet=True, echo=False, **options)
        return self._runner(fn, nprocs, args, kwargs, **options)

    def _skip_if_hung(self) -> None:
        if self._hung:
            raise CaseFailed("not run: an earlier case of this check hung; fix that first",
                             got="skipped")


def _armed_call(references, fn, args, kwargs):
    """``fn(*args, **kwargs)`` with tripwires on ``references``; raises if one was called, even if caught."""
    from . import _references

    with _references.armed(references):
        out = fn(*args, **kwargs)
    if _references.calls():
        _references.called(_references.calls()[0])
    return out


def _harness(fn, args, kwargs, prepare, catch):
    if prepare is not None:
        prepare[0](*prepare[1])
    return outcome(fn, *args, **kwargs) if catch else fn(*args, **kwargs)


def _error_text(exc) -> str:
    if not exc.exc_type:  # the process died without an exception, e.g. os._exit or a segfault
        return "the process running your code died: " + str(exc).splitlines()[0] + _output_tail(exc)
    tb = [ln for ln in (exc.traceback or "").splitlines() if ln.strip()]
    where = next((ln.strip() for ln in reversed(tb) if ln.strip().startswith("File ")
                  and "mgpu_lab" not in ln), "")
    # The first line of the launcher's message is "rank r/w raised Type: message".
    said = str(exc).splitlines()[0].split(" raised ", 1)[-1]
    return f"your code raised {said}" + (f" ({where})" if where else "") + _output_tail(exc)


def _output_tail(exc, lines: int = 6) -> str:
    """What the learner's code printed before it failed (checks keep rank output out of the cell), without
    the C++ stack traces and c10d warnings PyTorch adds (:func:`for_learners`)."""
    printed = for_learners((getattr(exc, "output", "") or "").splitlines())
    return ("; it printed: " + " | ".join(printed[-lines:])) if printed else ""


# What PyTorch's C++ side prints around a failure, which says nothing about the learner's code: the frames of a
# C++ stack trace, and c10d's warnings (e.g. a host name it cannot resolve).
_CPP_NOISE = re.compile(r"^\s*(frame #\d+:|Exception raised from |\(no backtrace available\)|C\+\+ CapturedTraceback)"
                        r"|\[c10d\]|socket\.cpp|ProcessGroupGloo\.cpp|TCPStore\.cpp")


def for_learners(lines: list[str]) -> list[str]:
    """The non-blank ``lines`` a learner should read: C++ stack frames and c10d warnings left out.

    Example:
        >>> for_learners(["RuntimeError: boom", "Exception raised from run at socket.cpp:12 (most recent call first):",
        ...               "frame #0: c10::Error::Error() + 0x9c", "",
        ...               "[W1127 16:01:02 socket.cpp:767] [c10d] The hostname of the client socket cannot be retrieved",
        ...               "exit code 1"])
        ['RuntimeError: boom', 'exit code 1']
    """
    return [ln for ln in lines if ln.strip() and not _CPP_NOISE.search(ln)]


def check(exercise_id: str, *answers, **named) -> CheckResult:
    """Judge the learner's answer to one exercise.

    Args:
        exercise_id: e.g. ``"01.pick_device"``.
        *answers, **named: the learner's objects, passed explicitly.

    Returns:
        A :class:`CheckResult` (HTML in Jupyter, text in a terminal).

    Raises:
        ValueError: unknown exercise id. TypeError: wrong objects passed.

    Example:
        >>> def pick_device(index=None):               # the exercise cell, not written yet
        ...     raise NotImplementedError
        >>> print(check("01.pick_device", pick_device))
        01.pick_device: 0/2 points · not attempted
          not attempted: your code still raises NotImplementedError
    """
    ex = get(exercise_id)
    sig = inspect.signature(ex.checker)
    params = list(sig.parameters)[1:]
    try:
        bound = sig.bind(None, *answers, **named)
    except TypeError:
        raise TypeError(
            f"check({exercise_id!r}, ...) takes your {', '.join(params)}: "
            f"e.g. check({exercise_id!r}, {', '.join(params)})"
        ) from None
    folder = grading_folder()
    if folder:  # a grader runs this notebook: it judges later, from what is saved here
        return save(folder, ex.id, ex.points, dict(list(bound.arguments.items())[1:]))
    return run_checker(ex, Tester(ex), answers, named)


def run_checker(ex: Exercise, t: Tester, answers: tuple = (), named: dict | None = None) -> CheckResult:
    """Run the checker of ``ex`` with the tester ``t``; the verdict (at most ``ex.points`` points)."""
    note = ""
    try:
        ex.checker(t, *answers, **(named or {}))
    except NotAttempted:
        return CheckResult(ex.id, 0, ex.points, "not attempted", [],
                           "not attempted: your code still raises NotImplementedError")
    except Exception as exc:  # noqa: BLE001 - a broken answer must not break the check cell
        note = f"the check stopped early: {type(exc).__name__}: {exc}"
        traceback.clear_frames(exc.__traceback__)
    finally:
        t.cleanup()
    if sum(c.points for c in t.cases) > ex.points:
        raise RuntimeError(f"checker of {ex.id} judged cases worth {sum(c.points for c in t.cases)} points but "
                           f"declares {ex.points} points")
    while sum(c.points for c in t.cases) < ex.points:
        t.cases.append(Case("(not reached)", False, hint="the check stopped before this case"))
    points = sum(c.points for c in t.cases if c.passed)
    passed = points == ex.points and all(c.passed for c in t.cases)  # a practice case (no points) counts too
    return CheckResult(ex.id, points, ex.points, "passed" if passed else "failed", t.cases, note)

"""What a failed launch raises, and how a rank's failure is read and worded.

:class:`LaunchError` (a rank raised or died) and :class:`LaunchTimeout` (the
ranks hung) are what learners catch; they live apart from the job that raises
them so that catching them needs no launcher machinery. The helpers word an
exit code, tell a rank's own error from the one it got because a peer died,
rebuild a rank's exception object when it can be unpickled here, and write the
whole report of a failed (:func:`failure_error`) or hung (:func:`timeout_error`)
launch from what the job saw of its ranks.

Example:
    >>> exit_text(-9)
    'exit code -9 (killed by SIGKILL)'
    >>> is_consequence(("error", {"message": "Connection closed by peer [127.0.0.1]:29500"}))
    True
"""
from __future__ import annotations

import signal

import cloudpickle

from .relay import format_traceback, prefix

__all__ = ["LaunchError", "LaunchTimeout", "exit_text", "is_consequence", "load_exception",
           "summary", "hint", "failure_error", "timeout_error"]


class LaunchError(RuntimeError):
    """A rank raised or died. Attributes describe the first rank that failed.

    Attributes:
        rank: the failing rank. world_size: ranks in the launch.
        exitcode: its exit code (negative: killed by that signal), if it exited.
        exc_type: name of the exception it raised (None if it died without one).
        exception: that exception object when it could be pickled, else None.
        traceback: its traceback as text. failures: every failed rank -> summary.
    """

    def __init__(self, message, *, rank=None, world_size=None, exitcode=None,
                 exc_type=None, exception=None, traceback="", failures=None, phase=None, output=""):
        super().__init__(message)
        self.output = output  # the ranks' output, when the launch kept it (echo=False)
        self.phase = phase  # "init": failed while setting up the process group, before fn ran
        self.rank, self.world_size, self.exitcode = rank, world_size, exitcode
        self.exc_type, self.exception, self.traceback = exc_type, exception, traceback
        self.failures = failures or {}


class LaunchTimeout(LaunchError):
    """The ranks did not finish in time; ``stacks`` maps rank -> its Python stack."""

    def __init__(self, message, *, stacks=None, **kw):
        super().__init__(message, **kw)
        self.stacks = stacks or {}


def exit_text(code) -> str:
    """How a rank ended, in words: its exit code, and the signal that killed it if one did."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"exit code {code} (killed by {signal.Signals(-code).name})"
        except ValueError:
            return f"exit code {code}"
    return f"exit code {code}"


CONSEQUENCES = ("closed by peer", "reset by peer", "broken pipe", "connection refused",
                "remote process exited", "socket timeout", "connectfullmesh")


def is_consequence(message) -> bool:
    """True for errors that a rank gets because *another* rank failed.

    Args:
        message: the rank's last message, ``("error", info)`` or ``("ok", blob)``, or None.
    """
    if not message:
        return False
    return any(text in message[1]["message"].lower() for text in CONSEQUENCES)


def load_exception(err: dict):
    """The exception a rank raised, unpickled here, or None when it cannot be."""
    if err.get("pickled") is None:
        return None
    try:
        return cloudpickle.loads(err["pickled"])
    except Exception:  # noqa: BLE001 - the text is what matters
        return None


def summary(info) -> str:
    """One rank's failure in a few words (``info``: the job's record of the rank)."""
    if info.message:
        err = info.message[1]
        if "exit" in err:
            return f"called sys.exit({err['exit']['arg']}) ({exit_text(err['exit']['status'])})"
        cause = err.get("cause")
        said = f" (caused by {cause['exception_only'].strip()})" if cause else ""
        return f"raised {err['type']}: {err['message']}{said}"
    return f"died without raising ({exit_text(info.exitcode)})"


def hint(err: dict, init: bool) -> str | None:
    """The fix for a rank error that launch itself set up, if this is one."""
    if init and err["type"] == "ValueError" and "default process group twice" in err["message"]:
        return ("launch already initialised the process group before fn ran (init=True, the default); "
                "remove init_process_group from fn, or launch with init=False to leave it to fn")
    return None


def failure_error(ranks, failures, world_size: int, init: bool, output: str) -> LaunchError:
    """The LaunchError of a launch whose ranks ``failures`` failed (the first one first)."""
    first, n = failures[0], world_size
    lines = [f"rank {first.rank}/{n} {summary(first)}"]
    others = [f"rank {i.rank}/{n} {summary(i)}" for i in failures[1:]]
    if others:
        lines.append("after it: " + "; ".join(others))
    early = [i.rank for i in ranks if i.message is None and i.exitcode == 0]
    if early:
        lines.append(f"ended with exit code 0 without returning (e.g. os._exit(0)): ranks {', '.join(map(str, early))}")
    stopped = [i.rank for i in ranks if i.killed and i.message is None]
    if stopped:
        lines.append(f"stopped by the launcher: ranks {', '.join(map(str, stopped))}")
    tb, exc, exc_type, phase, exitcode = "", None, None, None, first.exitcode
    if first.message:
        err = first.message[1]
        phase, exc_type = err.get("phase"), err["type"]
        exitcode = err["exit"]["status"] if "exit" in err else exitcode
        tb, exc = format_traceback(err), load_exception(err)
        fix = hint(err, init)
        if fix:
            lines.append(f"hint: {fix}")
        lines += ["", f"Traceback of rank {first.rank}/{n}:", tb.rstrip()]
    else:
        lines.append("(a segfault, os._exit, or a kill from outside, e.g. the out-of-memory killer, "
                     "ends a process without a Python exception; its stderr is above)")
    return LaunchError("\n".join(lines), rank=first.rank, world_size=n, exitcode=exitcode, output=output,
                       exc_type=exc_type, exception=exc, traceback=tb, phase=phase,
                       failures={i.rank: summary(i) for i in failures})


def timeout_error(ranks, hung, stacks: dict, timeout: float, world_size: int, output: str) -> LaunchTimeout:
    """The LaunchTimeout of a launch whose ranks ``hung`` were still running after ``timeout``."""
    n = world_size
    finished = [str(i.rank) for i in ranks if i not in hung]
    lines = [
        f"launch timed out after {timeout:g} s: rank(s) {', '.join(str(i.rank) for i in hung)} "
        f"of {n} still running" + (f" (rank(s) {', '.join(finished)} had finished)" if finished else ""),
        "A hang usually means mismatched collectives: one rank waits in all_reduce/barrier/... "
        "that another rank never calls (e.g. different numbers of batches per rank, or a "
        "collective inside `if rank == 0`). Raise timeout= if the work is simply slow.",
        "Python stack of every rank still running (most recent call first):",
    ]
    for r, text in stacks.items():
        lines.append("\n".join(prefix(r, n) + line for line in (text or "(no stack received)").splitlines()))
    return LaunchTimeout("\n".join(lines), rank=hung[0].rank if hung else None, world_size=n,
                         output=output, stacks=stacks)

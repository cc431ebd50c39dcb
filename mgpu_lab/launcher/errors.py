"""What a failed launch raises, and how a rank's failure is read and worded.

:class:`LaunchError` (a rank raised or died) and :class:`LaunchTimeout` (the
ranks hung) are what learners catch; they live apart from the job that raises
them so that catching them needs no launcher machinery. The helpers word an
exit code, tell a rank's own error from the one it got because a peer died,
and rebuild a rank's exception object when it can be unpickled here.

Example:
    >>> exit_text(-9)
    'exit code -9 (killed by SIGKILL)'
    >>> is_consequence(("error", {"message": "Connection closed by peer [127.0.0.1]:29500"}))
    True
"""
from __future__ import annotations

import signal

import cloudpickle

__all__ = ["LaunchError", "LaunchTimeout", "exit_text", "is_consequence", "load_exception"]


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

"""Imported by the forkserver only, as the first of its preloaded modules.

When its launcher goes (the forkserver sees its "alive" pipe close), the forkserver
ends with ``SystemExit`` and Python's normal finalization, which for an interpreter
holding torch takes seconds (more on a loaded machine). The forkserver owns nothing
that needs finalizing (its ranks end with ``os._exit``), so it leaves at once.
Processes forked from it inherit the hook, which does nothing in them. Any other
process that imports this module (a test run importing every module, a docstring
runner) gets no hook: its exit status stays its own.
"""
from __future__ import annotations

import atexit
import os
import sys
from multiprocessing import forkserver

_SERVER_PID = os.getpid()


def _leave_now() -> None:
    if os.getpid() == _SERVER_PID:
        os._exit(0)


def _imported_by_the_fork_server() -> bool:
    """Whether this import runs inside ``multiprocessing.forkserver.main`` (its preload loop)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is forkserver.main.__code__:
            return True
        frame = frame.f_back
    return False


#: True in the fork server (and in the ranks forked from it, where the hook does nothing).
QUICK_EXIT = _imported_by_the_fork_server()
if QUICK_EXIT:
    atexit.register(_leave_now)  # registered last, so run first: before the slow teardown

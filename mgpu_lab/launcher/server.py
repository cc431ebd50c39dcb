"""Imported by the forkserver only, as the first of its preloaded modules.

When its launcher goes (the forkserver sees its "alive" pipe close), the forkserver
ends with ``SystemExit`` and Python's normal finalization, which for an interpreter
holding torch takes seconds (more on a loaded machine). The forkserver owns nothing
that needs finalizing (its ranks end with ``os._exit``), so it leaves at once.
Processes forked from it inherit the hook, which does nothing in them.
"""
from __future__ import annotations

import atexit
import os

_SERVER_PID = os.getpid()


def _leave_now() -> None:
    if os.getpid() == _SERVER_PID:
        os._exit(0)


atexit.register(_leave_now)  # registered last, so run first: before the slow teardown

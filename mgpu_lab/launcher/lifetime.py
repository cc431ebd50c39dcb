"""A launch's processes live exactly as long as the launch, however it ends.

Launcher side: :class:`Lifeline`, a pipe whose write end only the launching
process holds, so the kernel closes it however that process dies (SIGKILL, the
out-of-memory killer); and :func:`interrupts_deferred`, which holds Ctrl-C back
while ranks start, so that every rank that starts is known and can be stopped.

Rank side, :func:`bind_rank`, the first thing every rank does: it leads its own
process group and is a child subreaper, so everything it starts (DataLoader
workers, a shell's ``cmd &`` that double-forks) stays in its group (unless it
starts a session of its own) and below it while it lives;
it dies with the forkserver; it gives back the forkserver's "alive" pipe that
every forked process inherits (held by ranks, it kept the forkserver from ever
seeing its launcher go); and it starts a guard, a tiny shell in its group that
waits for the lifeline to close and then SIGKILLs the group. The lifeline
closes when the launcher dies, and when the job ends, so the guard of a rank
that died on its own (a segfault, ``os._exit``) then ends what that rank left.

Example:
    >>> with interrupts_deferred():   # a Ctrl-C here is raised when the block ends
    ...     pass
"""
from __future__ import annotations

import os
import signal
import subprocess
import threading
from contextlib import contextmanager
from multiprocessing import forkserver
from multiprocessing.connection import Connection

from mgpu_lab.core import libc

__all__ = ["Lifeline", "interrupts_deferred", "bind_rank"]


class Lifeline:
    """A pipe that tells the ranks of one launch that their launcher is gone.

    The launcher keeps the write end and never writes: the read end becomes
    readable (end of file) only when every copy of the write end is closed, by
    :meth:`close` or by the kernel when the launching process dies.
    """

    def __init__(self):
        read, self._write = os.pipe()  # close-on-exec: no program the launcher runs inherits it
        self.reader = Connection(read, writable=False)  # sent to every rank

    def close(self) -> None:
        """Cut the lifeline: every guard still waiting kills its rank's process group."""
        if self._write is not None:
            os.close(self._write)
            self._write = None
        self.reader.close()


@contextmanager
def interrupts_deferred():
    """Hold SIGINT (Ctrl-C, a Jupyter interrupt) back while the block runs; deliver it after.

    Without this, an interrupt that lands after the forkserver has been asked for a
    rank but before its pid is known leaves a rank that nobody stops. Outside the
    main thread (where no SIGINT handler runs) the block simply runs.
    """
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous is None:
        yield  # None: a handler not set from Python, which could not be put back
        return
    held = []
    signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if held:
            signal.raise_signal(signal.SIGINT)  # now the caller's handler sees it


def _prctl(option: int, value: int) -> None:
    try:
        libc.prctl(option, value)
    except OSError:  # not Linux: the guard below still works
        pass


def _drop_forkserver_alive_fd() -> None:
    # multiprocessing hands every process forked by the forkserver the write end
    # of the forkserver's "alive" pipe (so that it may start processes too); the
    # forkserver exits only when all copies are closed. A rank is no client of it.
    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass
        server._forkserver_alive_fd = None  # a rank's own forkserver start makes a new one


# The guard: a shell whose stdin is the lifeline (started by vfork+exec in 0.2-2 ms on a
# loaded 2-core machine, where a fork of the rank, torch and all, took 25-36 ms). `read` returns at end
# of file, when the launcher is gone or has ended the job; then one signal ends the rank's process
# group, the guard included.
_GUARD = ["/bin/sh", "-c", "read _; kill -s KILL 0"]
_guard = None  # the rank's guard process, kept referenced for the rank's life


def bind_rank(lifeline: Connection) -> None:
    """Tie this rank, and all it will start, to the launcher's lifeline (see the module)."""
    global _guard
    try:
        os.setpgid(0, 0)
    except OSError:
        pass
    _prctl(libc.PR_SET_CHILD_SUBREAPER, 1)  # orphans of its children are re-parented to it
    _prctl(libc.PR_SET_PDEATHSIG, signal.SIGKILL)  # dies with the forkserver
    _drop_forkserver_alive_fd()
    try:
        _guard = subprocess.Popen(_GUARD, stdin=lifeline.fileno(), stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, close_fds=True)
    except OSError:  # no shell, or out of processes: unguarded, still dying with the forkserver
        pass
    lifeline.close()

"""A launch's processes live exactly as long as the launch, however it ends.

Launcher side: :class:`Lifeline`, a pipe whose write end only the launching
process holds, so the kernel closes it however that process dies (SIGKILL, the
out-of-memory killer); and :func:`interrupts_deferred`, which holds Ctrl-C back
while ranks start, so that every rank that starts is known and can be stopped.

Rank side, :func:`bind_rank`, the first thing every rank does: it leads its own
process group and is a child subreaper, so everything it starts (DataLoader
workers, a shell's ``cmd &`` that double-forks) stays in its group and below it;
it dies with the forkserver; it gives back the forkserver's "alive" pipe that
every forked process inherits (held by ranks, it kept the forkserver from ever
seeing its launcher go); and it forks a guard, a small process that waits for
the lifeline to close or the rank to die and then SIGKILLs the rank's group.

Example:
    >>> with interrupts_deferred():   # a Ctrl-C here is raised when the block ends
    ...     pass
"""
from __future__ import annotations

import ctypes
import os
import select
import signal
import threading
from contextlib import contextmanager
from multiprocessing import forkserver
from multiprocessing.connection import Connection

__all__ = ["Lifeline", "interrupts_deferred", "bind_rank"]

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


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
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the guard below still works
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


def bind_rank(lifeline: Connection) -> None:
    """Tie this rank, and all it will start, to the launcher's lifeline (see the module)."""
    try:
        os.setpgid(0, 0)
    except OSError:
        pass
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)  # orphans of its children are re-parented to it
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # dies with the forkserver
    _drop_forkserver_alive_fd()
    rank_pid = os.getpid()
    try:
        if os.fork() == 0:  # still single-threaded here: forking is safe
            _guard(lifeline.fileno(), rank_pid)
    except OSError:  # out of processes (a process limit): run unguarded, still dying with the forkserver
        pass
    lifeline.close()


def _guard(lifeline_fd: int, rank_pid: int) -> None:
    """The guard process: SIGKILL the rank's group once the launcher or the rank is gone."""
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)  # hold none of the pipes that the launcher reads to their end
        keep = sorted({lifeline_fd, 0, 1, 2})
        for low, high in zip(keep, keep[1:] + [os.sysconf("SC_OPEN_MAX")]):
            os.closerange(low + 1, high)
        try:
            watched = [lifeline_fd, os.pidfd_open(rank_pid)]  # readable when the rank exits
            poll = None
        except (AttributeError, OSError):  # no pidfd (Linux < 5.3): look at the parent instead
            watched, poll = [lifeline_fd], 0.5
        while not select.select(watched, [], [], poll)[0] and os.getppid() == rank_pid:
            pass
        os.killpg(0, signal.SIGKILL)  # the rank, all it started that stayed in its group, and this guard
    finally:
        os._exit(0)

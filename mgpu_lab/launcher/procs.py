"""Starting rank processes from a forkserver that has preloaded torch.

Ranks are forked from a clean server process (started with ``exec``, never a
fork of the caller), so a Jupyter kernel that has already initialised CUDA can
still launch, and each rank starts in milliseconds with torch already imported.
A process that has done nothing but import may make the server a fork of
itself instead (``prewarm(fork=True)``: the grading sandbox's runner).
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from contextlib import contextmanager
from multiprocessing import context, forkserver, popen_forkserver, spawn

import psutil

# server first (the forkserver's own quick exit); torchvision too: the data lessons
# use it in every rank (a missing one is skipped); torch._dynamo: the first optimizer of
# a process imports it (seconds per rank), and only the forkserver should pay for it.
_PRELOAD = ["mgpu_lab.launcher.server", "mgpu_lab.launcher.rank", "torch._dynamo", "torchvision"]
_lock = threading.Lock()


def preload_modules() -> list[str]:
    """Modules the forkserver imports once: ours plus ``MGPU_LAB_PRELOAD`` (comma list)."""
    extra = [m.strip() for m in os.environ.get("MGPU_LAB_PRELOAD", "").split(",") if m.strip()]
    return _PRELOAD + extra


def prewarm(fork: bool = False) -> None:
    """Start the forkserver now, so that it imports torch while the caller does other work.

    Returns at once; the first launch waits only for what is left of the import.

    Args:
        fork: make the server a fork of this process instead of a new Python, so
            that it has what this process imported (torch: seconds of CPU saved).
            Only for a process that has done nothing yet but import: no threads,
            no CUDA, no code of anyone else (the grading sandbox's runner, first
            thing). A server already running is kept.

    Example:
        >>> from mgpu_lab.launcher.launch import prewarm
        >>> prewarm()
    """
    with _lock, _start_method_untouched():
        forkserver.set_forkserver_preload(preload_modules())
        if fork:
            _fork_server(forkserver._forkserver)
        forkserver.ensure_running()


def _fork_server(server: forkserver.ForkServer) -> None:
    """What ``server.ensure_running()`` does (the same in Python 3.10 to 3.13.0), with ``os.fork`` for its
    ``spawnv_passfds``. A Python whose fork server also takes an authentication key gets it started the usual way.
    """
    import socket

    from multiprocessing import connection, resource_tracker, util

    if server._forkserver_pid is not None or hasattr(server, "_forkserver_authkey"):
        return
    resource_tracker.ensure_running()
    with socket.socket(socket.AF_UNIX) as listener:
        address = connection.arbitrary_address("AF_UNIX")
        listener.bind(address)
        if not util.is_abstract_socket_namespace(address):
            os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()  # the server ends when every holder of alive_w is gone
        try:
            pid = os.fork()
            if pid == 0:
                try:
                    global _lock
                    _lock = threading.Lock()  # held by the parent as it forked
                    keep = sorted({listener.fileno(), alive_r})  # as spawnv_passfds: nothing else
                    os.closerange(3, keep[0])
                    os.closerange(keep[0] + 1, keep[1])
                    os.closerange(keep[1] + 1, os.sysconf("SC_OPEN_MAX"))
                    forkserver.main(listener.fileno(), alive_r, server._preload_modules)
                finally:
                    os._exit(0)
        except BaseException:
            os.close(alive_w)
            raise
        finally:
            os.close(alive_r)
    server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid


@contextmanager
def _start_method_untouched():
    """Leave multiprocessing's start method unset if the caller has not set it.

    multiprocessing fixes it whenever it is asked for it (``spawn.get_preparation_data``
    asks while starting the forkserver and every process); a learner's later
    ``set_start_method("spawn")`` would then raise "context has already been set".
    """
    before = multiprocessing.get_start_method(allow_none=True)
    try:
        yield
    finally:
        if before is None:
            multiprocessing.set_start_method(None, force=True)  # documented: back to unset


class _Popen(popen_forkserver.Popen):
    def _launch(self, process_obj):
        # Unlike multiprocessing's default, ranks never re-import the caller's
        # __main__: functions travel by value, and a script without an
        # ``if __name__ == "__main__"`` guard must not re-run itself in every rank.
        original = spawn.get_preparation_data

        def without_main(name):
            data = original(name)
            data.pop("init_main_from_name", None)
            data.pop("init_main_from_path", None)
            return data

        with _lock, _start_method_untouched():
            spawn.get_preparation_data = without_main
            try:
                super()._launch(process_obj)
            finally:
                spawn.get_preparation_data = original


# multiprocessing's list of children is not thread-safe before Python 3.11.4 or so (Debian 12's 3.11.2):
# ``start()`` walks it calling ``p._popen.poll()`` while another thread's ``close()`` sets ``_popen`` to None,
# and the start fails with "'NoneType' object has no attribute 'poll'". Checks that judge several answers in
# threads start and close ranks at once, so both hold this lock.
_children_lock = threading.Lock()


class RankProcess(context.ForkServerProcess):
    """A process forked from the preloaded forkserver."""

    @staticmethod
    def _Popen(process_obj):
        return _Popen(process_obj)

    def start(self):
        with _children_lock:
            super().start()

    def close(self):
        with _children_lock:
            super().close()


def start(target, args, name: str) -> RankProcess:
    """Start ``target(*args)`` in a fresh rank process (not a daemon: ranks may have workers)."""
    prewarm()
    proc = RankProcess(target=target, args=args, name=name, daemon=False)
    proc.start()
    return proc


def kill_descendants(pid: int, include_self: bool = False, wait: float = 0.0) -> None:
    """SIGKILL every process below ``pid`` (and ``pid`` itself with ``include_self``).

    Args:
        pid: the root of the tree.
        include_self: kill ``pid`` too.
        wait: seconds to wait for them to be gone (0: do not wait).
    """
    try:
        root = psutil.Process(pid)
        victims = root.children(recursive=True) + ([root] if include_self else [])
    except psutil.Error:
        return
    for victim in victims:
        try:
            victim.kill()
        except psutil.Error:
            pass
    if wait:
        psutil.wait_procs(victims, timeout=wait)


def kill_tree(proc: RankProcess) -> None:
    """SIGKILL a rank and every process it started (DataLoader workers included).

    The rank leads its own process group (see :mod:`.lifetime`): one signal to the
    group reaches the rank, its guard and all it started at once; descendants that
    left the group (``setsid``) are found below the rank, a child subreaper.
    """
    if proc.pid is None:
        return
    try:
        escaped = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        escaped = []
    if proc.exitcode is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # not its group yet, or gone
            pass
        try:
            proc.kill()
        except (OSError, ValueError):
            pass
    for victim in escaped:
        try:
            victim.kill()
        except psutil.Error:
            pass

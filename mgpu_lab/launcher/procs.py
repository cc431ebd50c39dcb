"""Starting rank processes from a forkserver that has preloaded torch.

Ranks are forked from a clean server process (started with ``exec``, never a
fork of the caller), so a Jupyter kernel that has already initialised CUDA can
still launch, and each rank starts in milliseconds with torch already imported.
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


def prewarm() -> None:
    """Start the forkserver now, so that it imports torch while the caller does other work.

    Returns at once; the first launch waits only for what is left of the import.

    Example:
        >>> from mgpu_lab.launcher.launch import prewarm
        >>> prewarm()
    """
    with _lock, _start_method_untouched():
        forkserver.set_forkserver_preload(preload_modules())
        forkserver.ensure_running()


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


class RankProcess(context.ForkServerProcess):
    """A process forked from the preloaded forkserver."""

    @staticmethod
    def _Popen(process_obj):
        return _Popen(process_obj)


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

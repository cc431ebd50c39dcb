"""Finding a hang: collective timeouts, TORCH_DISTRIBUTED_DEBUG, the flight recorder, py-spy.

A distributed job hangs when its ranks disagree about the next collective: one
rank skips it, calls another one, or calls it with another shape, or one rank
never gets there (stuck reading data). The tools, all usable on a cluster:

- the **collective timeout** of ``init_process_group(timeout=...)`` turns the
  wait into an error (gloo raises in the waiting call; NCCL's watchdog aborts);
- ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` checks every collective's op and shapes
  across the ranks before running it, and raises an error naming both sides;
- the **flight recorder** (``TORCH_FR_BUFFER_SIZE``) keeps each rank's last
  collective calls; :func:`collective_log` reads this rank's (where the ranks'
  logs part is the first call they disagree on);
- ``py-spy dump --pid PID`` prints the Python stack of a live process from
  outside; :class:`StackWatcher` runs it on every rank of a hung launch.

:func:`init` starts a process group with these switches, in a rank launched
with ``init=False`` (or first thing in a torchrun script).

Example:
    >>> import torch
    >>> from mgpu_lab import launch
    >>> def job():
    ...     init(timeout=2, flight_recorder=64)
    ...     torch.distributed.all_reduce(torch.ones(2))
    ...     return collective_log()
    >>> logs = launch(job, 2, init=False)
    launch: 2 ranks · ...
    >>> logs[0] == logs[1] == [("all_reduce", (2,))]               # every rank made the same calls
    True
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time

from mgpu_lab import dist as mdist

__all__ = ["init", "collective_log", "py_spy", "StackWatcher"]


def init(timeout: float = 300.0, flight_recorder: int = 0, debug: str | None = None, backend: str | None = None):
    """Initialise the default process group with a collective timeout and the debugging switches.

    Args:
        timeout: seconds a collective waits for the other ranks before it fails.
        flight_recorder: entries of the flight recorder's ring buffer
            (``TORCH_FR_BUFFER_SIZE``); 0 leaves it off.
        debug: ``"OFF"``, ``"INFO"`` or ``"DETAIL"`` (``TORCH_DISTRIBUTED_DEBUG``);
            None keeps what the environment says.
        backend: as :func:`mgpu_lab.dist.setup`.

    Returns:
        This rank's device.

    Raises:
        ValueError: an unknown ``debug`` level.

    Example:
        >>> from mgpu_lab import launch
        >>> kinds = launch(lambda: init(timeout=5, flight_recorder=100, debug="DETAIL").type, 2, init=False)
        launch: 2 ranks · ...
        >>> set(kinds) <= {"cpu", "cuda"}
        True
    """
    import torch.distributed as tdist

    if flight_recorder:
        os.environ["TORCH_FR_BUFFER_SIZE"] = str(int(flight_recorder))  # read when the group is made
    if debug is not None:
        if debug not in ("OFF", "INFO", "DETAIL"):
            raise ValueError(f"debug={debug!r}: use 'OFF', 'INFO' or 'DETAIL' (TORCH_DISTRIBUTED_DEBUG)")
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = debug
        # torch.distributed reads the variable when it is imported; this rank imported it already
        tdist.set_debug_level_from_env()
    return mdist.setup(backend, timeout=timeout)


def collective_log(pg_name: str | None = None) -> list[tuple[str, tuple[int, ...]]]:
    """This rank's collective calls as the flight recorder saw them: ``[(op, shape), ...]``, oldest first.

    ``op`` drops the backend's prefix (``"gloo:all_reduce"`` -> ``"all_reduce"``);
    ``shape`` is the first input tensor's (``()`` for a barrier). Needs the
    recorder on (:func:`init` with ``flight_recorder`` > 0, or the
    ``TORCH_FR_BUFFER_SIZE`` variable) before the process group was made.

    Args:
        pg_name: keep only the calls of the group with this name or description
            (``"0"`` or ``"default_pg"`` for the default group).

    Note:
        The dump function, ``torch._C._distributed_c10d._dump_fr_trace_json``,
        is private API of torch 2.14; NCCL jobs usually dump to files instead
        (``TORCH_NCCL_DUMP_ON_TIMEOUT=1``).
    """
    from torch._C import _distributed_c10d as c10d

    dump = json.loads(c10d._dump_fr_trace_json(includeCollectives=True))
    out = []
    for entry in sorted(dump.get("entries", []), key=lambda e: e["record_id"]):
        if pg_name is not None and pg_name not in entry["process_group"]:
            continue
        op = entry["profiling_name"].split(":", 1)[-1]
        sizes = entry.get("input_sizes") or [[]]
        out.append((op, tuple(int(s) for s in sizes[0])))
    return out


def py_spy_path() -> str | None:
    """The ``py-spy`` executable (beside this Python, or on PATH), or None when it is not installed."""
    here = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return here if os.access(here, os.X_OK) else shutil.which("py-spy")


def py_spy(pid: int, timeout: float = 20.0) -> str:
    """``py-spy dump --pid PID``: the Python stack of every thread of a live process, read from outside.

    Raises:
        RuntimeError: py-spy is not installed (``pip install py-spy``), or it failed (its message).
    """
    exe = py_spy_path()
    if exe is None:
        raise RuntimeError("py-spy is not installed here: pip install py-spy (it needs ptrace permission "
                           "on the target, e.g. the same user, or root in a container with SYS_PTRACE)")
    proc = subprocess.run([exe, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"py-spy dump --pid {pid} failed (exit {proc.returncode}): "
                           f"{(proc.stderr or proc.stdout).strip()[:500]}")
    return re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout)  # py-spy colours its output even into a pipe


class StackWatcher:
    """Run ``py-spy dump`` on the ranks of a launch that is still running, from a thread of this process.

    The ranks write their pid into ``directory`` (:meth:`register`, called in
    each rank); ``delay`` seconds after the last one did, the watcher dumps
    every registered pid. The launch itself blocks the caller meanwhile, as a
    hung job blocks its terminal; read :attr:`dumps` (rank -> text) after it.

    Example:
        >>> import tempfile, time
        >>> from mgpu_lab import launch
        >>> def stuck_here(folder):                   # a rank that takes long (a hang would take forever)
        ...     StackWatcher.register(folder)
        ...     time.sleep(4)
        >>> folder = tempfile.mkdtemp()
        >>> watcher = StackWatcher(folder, nprocs=2, delay=1.0).start()
        >>> _ = launch(stuck_here, 2, folder)
        launch: 2 ranks · ...
        >>> "stuck_here" in watcher.join().dumps[1]   # rank 1's stack, as py-spy saw it
        True
    """

    def __init__(self, directory: str, nprocs: int, delay: float = 1.0, wait: float = 60.0):
        self.directory, self.nprocs, self.delay, self.wait = directory, nprocs, delay, wait
        self.dumps: dict[int, str] = {}
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def register(directory: str) -> None:
        """In a rank: record this process's pid for the watcher."""
        with open(os.path.join(directory, f"rank{mdist.rank()}.pid"), "w") as f:
            f.write(str(os.getpid()))

    def start(self) -> "StackWatcher":
        self._thread.start()
        return self

    def join(self) -> "StackWatcher":
        self._thread.join(self.wait)
        return self

    def _pids(self) -> dict[int, int]:
        found = {}
        for name in os.listdir(self.directory):
            if name.startswith("rank") and name.endswith(".pid"):
                with open(os.path.join(self.directory, name)) as f:
                    text = f.read().strip()
                if text:
                    found[int(name[4:-4])] = int(text)
        return found

    def _run(self) -> None:
        end = time.monotonic() + self.wait
        while len(self._pids()) < self.nprocs and time.monotonic() < end:
            time.sleep(0.05)
        time.sleep(self.delay)
        for rank, pid in sorted(self._pids().items()):
            try:
                self.dumps[rank] = py_spy(pid)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                self.dumps[rank] = f"(no dump: {exc})"

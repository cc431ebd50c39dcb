"""``torch.profiler`` on every rank: one Chrome trace per rank, read back; the GPU's memory snapshot.

:func:`profile_steps` runs a training step under the profiler with a schedule
(``wait`` steps ignored, ``warmup`` steps profiled and thrown away, ``active``
steps kept) and writes the kept steps as a Chrome trace, one file per rank
(``rank0.json``, ``rank1.json``, ...): the files open in https://ui.perfetto.dev
or ``chrome://tracing``. :func:`load_trace` reads one back as the dict
``export_chrome_trace`` wrote, after checking that it is one. A trace is a list of
events; complete events (``"ph": "X"``) have a start ``ts`` and a duration ``dur`` in
microseconds, a thread ``tid`` and a category ``cat``: ``cpu_op`` for operators,
``user_annotation`` for ``record_function`` labels and the backend's collectives
(``gloo:all_reduce``), ``kernel`` for GPU kernels, on a lane per CUDA stream.

On a GPU, :func:`memory_snapshot` records the caching allocator's history while a
function runs (``torch.cuda.memory._record_memory_history``) and writes the
snapshot that https://pytorch.org/memory_viz draws.

Example:
    >>> import os, tempfile
    >>> folder = tempfile.mkdtemp()
    >>> x = torch.randn(64, 64)
    >>> path = profile_steps(lambda: (x @ x).sum(), folder, wait=0, warmup=1, active=1)
    >>> os.path.basename(path), any(e["name"] == "aten::mm" for e in load_trace(path)["traceEvents"])
    ('rank0.json', True)
"""
from __future__ import annotations

import json
import os
import threading

import torch

__all__ = ["COLLECTIVE_PREFIXES", "profile_steps", "load_trace", "complete_events", "memory_snapshot", "BusyThread"]

#: Names of the communication events in a trace: torch's collective calls (``c10d::allreduce_``), and the
#: backend's own work (``gloo:all_reduce`` on gloo's threads, ``nccl:all_reduce`` beside NCCL's kernels).
COLLECTIVE_PREFIXES = ("c10d::", "gloo:", "nccl:")


def _all_threads_config():
    """The profiler's option to record operators of every thread (``profile_all_threads``), or None."""
    try:
        from torch._C._profiler import _ExperimentalConfig

        return _ExperimentalConfig(profile_all_threads=True)
    except (ImportError, TypeError):  # an older torch: the training thread and the backend's threads only
        return None


def profile_steps(step, folder: str, *, wait: int = 1, warmup: int = 1, active: int = 2, name: str = "rank",
                  profile_memory: bool = True, all_threads: bool = False) -> str:
    """Run ``step()`` ``wait + warmup + active`` times under ``torch.profiler``; write the active steps' trace.

    Call it in every rank: each writes ``{folder}/{name}{rank}.json`` (rank 0 outside a process
    group). Every step is labelled ``ProfilerStep#i`` in the trace. CUDA kernels are recorded
    too when this process has a GPU. What the profiler itself prints from C++ is silenced.

    Args:
        step: one training step, called without arguments.
        folder: where the trace goes (made if missing).
        wait, warmup, active: the schedule: steps ignored, profiled but dropped (the first profiled
            steps are slower), and kept.
        profile_memory: record every allocation and free (``[memory]`` events).
        all_threads: record the operators of every thread, not only this one and the threads it
            hands work to (torch's ``profile_all_threads``; ignored where torch lacks it).

    Returns:
        The trace file's path.

    Raises:
        ValueError: ``active`` < 1 or a negative ``wait`` / ``warmup``.
    """
    from torch.profiler import ProfilerActivity, profile, schedule

    if active < 1 or wait < 0 or warmup < 0:
        raise ValueError(f"wait={wait}, warmup={warmup}, active={active}: the profiler needs active >= 1 step "
                         "to keep, and wait, warmup >= 0")
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{name}{rank}.json")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    config = _all_threads_config() if all_threads else None
    options = {"experimental_config": config} if config is not None else {}
    from mgpu_lab.sharding.fsdp import _quiet_stderr

    with _quiet_stderr(), profile(activities=activities, profile_memory=profile_memory,
                                  schedule=schedule(wait=wait, warmup=warmup, active=active, repeat=1),
                                  on_trace_ready=lambda prof: prof.export_chrome_trace(path), **options) as prof:
        for _ in range(wait + warmup + active):
            step()
            prof.step()
    return path


def load_trace(path: str) -> dict:
    """The Chrome trace at ``path`` as a dict (as ``export_chrome_trace`` wrote it).

    Raises:
        ValueError: the file is not JSON, or holds no ``traceEvents`` list, or an event lacks a name or phase.

    Example:
        >>> import tempfile
        >>> bad = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
        >>> _ = bad.write('{"events": []}'); bad.close()
        >>> load_trace(bad.name)
        Traceback (most recent call last):
        ...
        ValueError: ... has no 'traceEvents' list: not a Chrome trace ...
    """
    try:
        with open(path, encoding="utf-8") as f:
            trace = json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not JSON ({exc}): write traces with prof.export_chrome_trace(path)") from None
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise ValueError(f"{path} has no 'traceEvents' list: not a Chrome trace (keys: {sorted(trace)[:8]}); "
                         "write it with prof.export_chrome_trace(path)")
    broken = [e for e in trace["traceEvents"] if not isinstance(e, dict) or "ph" not in e]
    if broken:
        raise ValueError(f"{path}: {len(broken)} events without a phase 'ph', e.g. {broken[0]!r}")
    return trace


def complete_events(trace: dict) -> list[dict]:
    """The complete events (``"ph": "X"``) of a trace: each has ``name``, ``cat``, ``tid``, ``ts`` and ``dur`` (us).

    Example:
        >>> complete_events({"traceEvents": [{"ph": "X", "name": "aten::mm", "ts": 1.0, "dur": 2.0, "tid": 7},
        ...                                  {"ph": "i", "name": "[memory]", "ts": 1.5}]})
        [{'ph': 'X', 'name': 'aten::mm', 'ts': 1.0, 'dur': 2.0, 'tid': 7}]
    """
    return [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]


def memory_snapshot(fn, path: str, max_entries: int = 100_000) -> dict:
    """On a GPU: run ``fn()`` while the CUDA caching allocator records its history; write the snapshot.

    The pickle at ``path`` is what https://pytorch.org/memory_viz draws: every allocation
    with the Python stack that made it, over time.

    Returns:
        ``{"path", "peak_bytes"}``: the snapshot's file and ``torch.cuda.max_memory_allocated``
        during ``fn`` (beyond what was allocated before).

    Raises:
        RuntimeError: no CUDA GPU in this process.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("memory_snapshot needs a CUDA GPU (torch.cuda.is_available() is False): on a CPU, "
                           "count what autograd saves with saved_tensors_hooks instead")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=max_entries)
    try:
        fn()
        torch.cuda.synchronize()
        torch.cuda.memory._dump_snapshot(path)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    return {"path": path, "peak_bytes": torch.cuda.max_memory_allocated() - before}


class BusyThread:
    """A helper thread that runs matrix products until stopped: work beside the training loop in a trace.

    Use it as a context manager around the profiled steps (with ``profile_steps(...,
    all_threads=True)``); :attr:`tid` is its thread id, as the trace names it.

    Example:
        >>> with BusyThread(size=32) as helper:
        ...     pass
        >>> helper.products > 0 and helper.tid > 0
        True
    """

    def __init__(self, size: int = 128, pause: float = 0.0):
        self.size, self.pause, self.products, self.tid = size, pause, 0, 0
        self._stop = threading.Event()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        self.tid = threading.get_native_id()
        a = torch.randn(self.size, self.size)
        while True:
            torch.tanh(a @ a)
            self.products += 1
            self._started.set()
            if self._stop.wait(self.pause):
                return

    def __enter__(self):
        self._thread.start()
        self._started.wait()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        return False

"""Start one child process per job, each seeing only its own GPUs, and train them on command.

The parent side of :mod:`mgpu_lab.devices.subset_train`: :class:`SubsetJobs` starts
``python -m mgpu_lab.devices.subset_train --model NAME --serve`` once per job, with
that job's GPUs in the child's ``CUDA_VISIBLE_DEVICES`` from the start (CUDA
reads it once, when the child first initialises CUDA). The children import
torch once and then train whenever told, so that running the jobs one after
another and all at once can be timed with the same processes, start-up
excluded. Each run comes back as a :class:`SubsetRun`.

Example:
    >>> from mgpu_lab.devices.subset_jobs import SubsetJobs
    >>> with SubsetJobs({"A": [0, 1], "B": [2, 3]}) as jobs:
    ...     runs = jobs.train(steps=300)           # both at once
    [...] pid ... · CUDA_VISIBLE_DEVICES=... · ...
    >>> sorted(runs), runs["B"].device   # GPUs 2 and 3: the CPU on a machine with fewer than 3 GPUs
    (['A', 'B'], 'cpu')
"""
from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from mgpu_lab.devices.subset_train import LEARNING_RATES, READY, RESULT

__all__ = ["SubsetJobs", "SubsetRun"]


@dataclass(frozen=True)
class SubsetRun:
    """One training run of one job, as the child reported it and the parent timed it.

    Attributes:
        name: The job's name, e.g. ``"A"``.
        ids: The GPU ids it was given (as the parent numbers them).
        visible: ``CUDA_VISIBLE_DEVICES`` as the child saw it.
        gpu_count: GPUs torch saw in the child (0 without CUDA).
        device: Where it trained, e.g. ``"cuda:0"`` or ``"cpu"``.
        lr: Its learning rate.
        steps: Optimisation steps taken.
        first_loss: Loss of the first batch.
        last_loss: Loss of the last batch.
        train_s: Seconds spent training, measured in the child.
        began_s: When the parent told it to train, in seconds since the
            round (one :meth:`SubsetJobs.train` call) began.
        ended_s: When its result arrived, on the same clock.
    """

    name: str
    ids: tuple[int, ...]
    visible: str | None
    gpu_count: int
    device: str
    lr: float
    steps: int
    first_loss: float
    last_loss: float
    train_s: float
    began_s: float
    ended_s: float

    @property
    def wall_s(self) -> float:
        """Seconds from the order to train to the result, seen from the parent."""
        return self.ended_s - self.began_s


class SubsetJobs:
    """One child process per job, each seeing only its own GPUs; train them on command.

    Each child runs ``python -m mgpu_lab.devices.subset_train --model NAME --serve``
    with the environment of :func:`mgpu_lab.devices.visible.child_env`, so its
    ``CUDA_VISIBLE_DEVICES`` is in place before it starts. The children import
    torch once; :meth:`train` then runs any of them one after another or all at
    once. Use it as a context manager, or call :meth:`close`.

    Args:
        jobs: Job name -> GPU ids as this process numbers them, e.g.
            ``{"A": [0, 1], "B": [2, 3]}``; names are keys of :data:`LEARNING_RATES`.
        threads: CPU threads per child (also ``OMP_NUM_THREADS``).
        timeout: Seconds any wait (start-up, one :meth:`train` call) may take.
        echo: Print what the children print, each line prefixed ``[name]``.
        gpu_env: ``gpu_env(ids)`` -> the variables that make a child see GPUs ``ids`` (lesson 01
            passes the learner's own); default :func:`mgpu_lab.devices.visible.child_env`'s.

    Raises:
        ValueError: For unknown names or bad GPU ids, before any child starts.
        RuntimeError: If a child dies or does not answer within ``timeout``;
            every child is then stopped.

    Attributes:
        startup_s: Job name -> seconds from starting the child to its READY
            (Python start-up and ``import torch``).

    Example:
        >>> with SubsetJobs({"A": [0], "B": [1]}, echo=False) as jobs:
        ...     one_by_one = [jobs.train(["A"], steps=50), jobs.train(["B"], steps=50)]
        ...     at_once = jobs.train(steps=50)
        >>> [sorted(runs) for runs in one_by_one], sorted(at_once)
        ([['A'], ['B']], ['A', 'B'])
    """

    def __init__(self, jobs: Mapping[str, Sequence[int]], threads: int = 1, timeout: float = 120.0,
                 echo: bool = True, gpu_env=None):
        from mgpu_lab.devices.visible import child_env

        unknown = [name for name in jobs if name not in LEARNING_RATES]
        if unknown or not jobs:
            raise ValueError(f"jobs={dict(jobs)!r}: name each job one of {sorted(LEARNING_RATES)}, "
                             "e.g. {'A': [0, 1], 'B': [2, 3]}")
        if gpu_env is None:
            envs = {name: child_env(list(ids)) for name, ids in jobs.items()}  # validates every id first
        else:
            envs = {name: {**os.environ, **gpu_env(list(ids))} for name, ids in jobs.items()}
        self.jobs = {name: tuple(ids) for name, ids in jobs.items()}
        self.timeout, self.echo = timeout, echo
        self.startup_s: dict[str, float] = {}
        self._lines: queue.Queue = queue.Queue()
        self._tails: dict[str, list[str]] = {name: [] for name in jobs}
        self._procs: dict[str, subprocess.Popen] = {}
        began = time.perf_counter()
        try:
            for name, env in envs.items():
                env.update(OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
                proc = subprocess.Popen(
                    [sys.executable, "-m", "mgpu_lab.devices.subset_train", "--model", name, "--serve",
                     "--threads", str(threads)],
                    env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                    text=True, bufsize=1)
                self._procs[name] = proc
                threading.Thread(target=self._read, args=(name, proc), daemon=True).start()
            ready = {name: at for name, _, at in self._wait(READY, list(jobs), began, echo)}
            self.startup_s = {name: ready[name] - began for name in jobs}
        except BaseException:  # e.g. Ctrl-C during start-up
            self.close(wait=0)
            raise

    def _read(self, name: str, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self._lines.put((name, line.rstrip("\n"), time.perf_counter()))
        self._lines.put((name, None, time.perf_counter()))

    def _wait(self, kind: str, names: list[str], began: float, echo: bool) -> list[tuple[str, str, float]]:
        """Collect one ``kind`` line from each child in ``names``; echo the rest."""
        got, deadline = [], began + self.timeout
        pending = set(names)
        while pending:
            try:
                name, line, at = self._lines.get(timeout=max(0.0, deadline - time.perf_counter()))
            except queue.Empty:
                self.close(wait=0)
                raise RuntimeError(f"model(s) {', '.join(sorted(pending))} did not answer within "
                                   f"{self.timeout:g} s; stopped every child. Pass a larger timeout= "
                                   "or fewer steps") from None
            if line is None:
                proc = self._procs[name]
                code = proc.wait()
                tail = "\n".join(self._tails[name][-15:])
                self.close(wait=0)
                raise RuntimeError(f"model {name} (GPUs {list(self.jobs[name])}) exited with code {code}; "
                                   f"its last output:\n{tail}")
            if line == READY or line.startswith(RESULT):
                if name in pending and line.startswith(kind):
                    got.append((name, line, at))
                    pending.discard(name)
                continue
            self._tails[name] = (self._tails[name] + [line])[-15:]
            if echo:
                print(f"[{name}] {line}", flush=True)
        return got

    def train(self, names: Iterable[str] | None = None, steps: int = 300,
              echo: bool | None = None) -> dict[str, SubsetRun]:
        """Train the named jobs (default: all) *at the same time*, each from scratch, and wait for all.

        For one after another, call it once per job: ``train(["A"])``, then ``train(["B"])``.

        Args:
            names: Which jobs; default every job.
            steps: Optimisation steps for each.
            echo: Print the children's lines (default: as given to the constructor).

        Returns:
            Job name -> :class:`SubsetRun`, in the order of ``names``.

        Raises:
            ValueError: For an unknown name or ``steps`` below 1.
            RuntimeError: If a child died, was closed, or did not answer in time.
        """
        names = list(self.jobs if names is None else names)
        unknown = [name for name in names if name not in self.jobs]
        if unknown or not names or steps < 1:
            raise ValueError(f"train(names={names!r}, steps={steps}): names must be among {list(self.jobs)} "
                             "and steps at least 1")
        if not self._procs:
            raise RuntimeError("these jobs are closed; start new ones with SubsetJobs(...)")
        began = time.perf_counter()
        sent = {}
        for name in names:
            sent[name] = time.perf_counter() - began
            try:
                self._procs[name].stdin.write(f"train {steps}\n")
                self._procs[name].stdin.flush()
            except OSError:  # it has died: _wait below reports its exit code and output
                pass
        results = {}
        for name, line, at in self._wait(RESULT, names, began, self.echo if echo is None else echo):
            report = json.loads(line[len(RESULT):])
            results[name] = SubsetRun(name=name, ids=self.jobs[name], began_s=sent[name],
                                      ended_s=at - began, **report)
        return {name: results[name] for name in names}

    def close(self, wait: float = 10.0) -> None:
        """Stop every child: close its stdin, wait up to ``wait`` s for it to exit, then kill it.

        Safe to call twice. Errors and timeouts close with ``wait=0``: a child
        that is still training is killed at once.
        """
        procs, self._procs = self._procs, {}
        for proc in procs.values():
            try:
                proc.stdin.close()
            except OSError:
                pass
        deadline = time.perf_counter() + wait
        for proc in procs.values():
            try:
                proc.wait(timeout=max(0.0, deadline - time.perf_counter()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def __enter__(self) -> "SubsetJobs":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_procs", None):
            self.close(wait=0)

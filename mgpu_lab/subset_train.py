"""Train several models at once, each in its own process on its own subset of GPUs.

The plainest way to use a multi-GPU machine for more than one job: start one
process per job and give each a disjoint set of GPUs through
``CUDA_VISIBLE_DEVICES`` (model A on GPUs 0-1, model B on GPUs 2-3). Each child
numbers its own GPUs from ``cuda:0`` and cannot touch the others. The variable
must be in the child's environment when it starts: CUDA reads it once, when
the process first initialises CUDA.

One job by hand, as a plain script::

    CUDA_VISIBLE_DEVICES=0,1 python -m mgpu_lab.subset_train --model A --steps 300

From Python, :class:`SubsetJobs` starts one child per job (``--serve``: it
imports torch once, then trains whenever told), so that running the jobs one
after another and all at once can be timed with the same processes, start-up
excluded. Each job trains on the first GPU of its set (``cuda:0`` in the
child), or on the CPU when it sees no GPU.

Example:
    >>> from mgpu_lab.subset_train import SubsetJobs
    >>> with SubsetJobs({"A": [0, 1], "B": [2, 3]}) as jobs:  # doctest: +SKIP
    ...     runs = jobs.train(steps=300)           # both at once
    [A] pid 812 · CUDA_VISIBLE_DEVICES='0,1' · no CUDA GPU visible (...): running on the CPU
    ...
    >>> runs["A"].device  # doctest: +SKIP
    'cpu'
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

__all__ = ["LEARNING_RATES", "SubsetJobs", "SubsetRun", "cuda_sees", "main", "train"]

# The jobs differ in one hyper-parameter, as in a small learning-rate sweep.
LEARNING_RATES = {"A": 0.05, "B": 0.2}
READY, RESULT = "READY", "RESULT "
_FEATURES, _CLASSES, _HIDDEN, _SAMPLES = 64, 10, 256, 4096


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


def cuda_sees(ids: Sequence[int], physical_gpus: int) -> list[int]:
    """The physical GPUs a child started with ``CUDA_VISIBLE_DEVICES=ids`` can use.

    CUDA walks the list in order and stops at the first index that does not
    exist, so on a 2-GPU machine ``[0, 1]`` gives GPUs 0 and 1, ``[2, 3]`` gives
    none (the child falls back to the CPU) and ``[1, 5, 0]`` gives only GPU 1.

    Args:
        ids: The GPU indices put into the child's ``CUDA_VISIBLE_DEVICES``.
        physical_gpus: How many GPUs the machine has.

    Returns:
        The physical indices in the order the child numbers them (``cuda:0``
        first); empty when the child sees no GPU.

    Example:
        >>> cuda_sees([2, 3], 4), cuda_sees([2, 3], 2), cuda_sees([0, 1], 1)
        ([2, 3], [], [0])
    """
    seen = []
    for gpu in ids:
        if not 0 <= gpu < physical_gpus:
            break
        seen.append(gpu)
    return seen


def train(name: str, steps: int = 300, batch_size: int = 256) -> dict:
    """Train job ``name`` from scratch in this process: on ``cuda:0`` if a GPU is visible, else the CPU.

    The data (a learnable synthetic classification set) and the initial weights
    are the same on every call, so every run of a job does the same work.

    Args:
        name: A key of :data:`LEARNING_RATES` (``"A"`` or ``"B"``).
        steps: Optimisation steps, one batch each.
        batch_size: Samples per batch.

    Returns:
        A dict with ``visible``, ``gpu_count``, ``device``, ``lr``, ``steps``,
        ``first_loss``, ``last_loss`` and ``train_s``.

    Raises:
        ValueError: For an unknown name, or ``steps`` or ``batch_size`` below 1.

    Example:
        >>> train("A", steps=5)["device"]  # doctest: +SKIP
        'cpu'
    """
    if name not in LEARNING_RATES:
        raise ValueError(f"model {name!r} is not one of {sorted(LEARNING_RATES)}; use 'A' or 'B'")
    if steps < 1 or batch_size < 1:
        raise ValueError(f"steps={steps} and batch_size={batch_size} must both be at least 1")
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = torch.device("cuda", 0) if gpus else torch.device("cpu")
    gen = torch.Generator().manual_seed(1)
    inputs = torch.randn(_SAMPLES, _FEATURES, generator=gen)
    labels = (inputs @ torch.randn(_FEATURES, _CLASSES, generator=gen)).argmax(dim=1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(_FEATURES, _HIDDEN), torch.nn.ReLU(),
                                torch.nn.Linear(_HIDDEN, _CLASSES)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATES[name], momentum=0.9)
    losses = []
    start = time.perf_counter()
    for _ in range(steps):
        index = torch.randint(0, _SAMPLES, (batch_size,), generator=gen)
        x, y = inputs[index].to(device), labels[index].to(device)
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    losses = [float(v) for v in losses]  # on a GPU: one wait for the results, not one per step
    return {"visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "gpu_count": gpus, "device": str(device),
            "lr": LEARNING_RATES[name], "steps": steps, "first_loss": losses[0], "last_loss": losses[-1],
            "train_s": time.perf_counter() - start}


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m mgpu_lab.subset_train``: say what this process sees, then train.

    Without ``--serve`` it trains once. With ``--serve`` it prints ``READY``
    and then trains each time a line ``train STEPS`` arrives on stdin, until
    stdin closes. Every run ends with a line ``RESULT {json}``.

    Args:
        argv: Command-line arguments (default ``sys.argv[1:]``).

    Returns:
        The exit code, 0 on success.

    Example:
        >>> main(["--model", "A", "--steps", "5"])  # doctest: +SKIP
        0
    """
    parser = argparse.ArgumentParser(prog="python -m mgpu_lab.subset_train",
                                     description="Train one small model on the GPUs this process sees.")
    parser.add_argument("--model", required=True, choices=sorted(LEARNING_RATES))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads torch may use (default 1)")
    parser.add_argument("--serve", action="store_true", help="train on each 'train STEPS' line of stdin")
    args = parser.parse_args(argv)
    import torch

    from .devices import describe

    torch.set_num_threads(args.threads)
    print(f"pid {os.getpid()} · CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r} · "
          f"{describe()}", flush=True)
    orders = _orders(sys.stdin) if args.serve else [args.steps]
    if args.serve:
        # One step first, so that one-time costs (torch.optim imports torch._dynamo
        # on first use: seconds on a busy machine) count as start-up, not training.
        train(args.model, 1)
        print(READY, flush=True)
    for steps in orders:
        result = train(args.model, steps)
        print(f"model {args.model} (lr {result['lr']}) on {result['device']}: loss {result['first_loss']:.3f} "
              f"-> {result['last_loss']:.3f} in {steps} steps, {result['train_s']:.2f} s", flush=True)
        print(RESULT + json.dumps(result), flush=True)
    if args.serve:
        # Nothing is left to clean up; skip the interpreter's teardown of torch,
        # which takes seconds on a busy machine while the parent waits.
        sys.stdout.flush()
        os._exit(0)
    return 0


def _orders(lines: Iterable[str]):
    """The step counts of ``train STEPS`` lines; stops at the end of input or ``quit``."""
    for line in lines:
        words = line.split()
        if words == ["quit"]:
            return
        if len(words) != 2 or words[0] != "train" or not words[1].isdigit():
            raise ValueError(f"expected 'train STEPS' or 'quit' on stdin, got {line.strip()!r}")
        yield int(words[1])


class SubsetJobs:
    """One child process per job, each seeing only its own GPUs; train them on command.

    Each child runs ``python -m mgpu_lab.subset_train --model NAME --serve``
    with the environment of :func:`mgpu_lab.devices.child_env`, so its
    ``CUDA_VISIBLE_DEVICES`` is in place before it starts. The children import
    torch once; :meth:`train` then runs any of them one after another or all at
    once. Use it as a context manager, or call :meth:`close`.

    Args:
        jobs: Job name -> GPU ids as this process numbers them, e.g.
            ``{"A": [0, 1], "B": [2, 3]}``; names are keys of :data:`LEARNING_RATES`.
        threads: CPU threads per child (also ``OMP_NUM_THREADS``).
        timeout: Seconds any wait (start-up, one :meth:`train` call) may take.
        echo: Print what the children print, each line prefixed ``[name]``.

    Raises:
        ValueError: For unknown names or bad GPU ids, before any child starts.
        RuntimeError: If a child dies or does not answer within ``timeout``;
            every child is then stopped.

    Attributes:
        startup_s: Job name -> seconds from starting the child to its READY
            (Python start-up and ``import torch``).

    Example:
        >>> with SubsetJobs({"A": [0, 1], "B": [2, 3]}, echo=False) as jobs:  # doctest: +SKIP
        ...     one_by_one = [jobs.train(["A"]), jobs.train(["B"])]
        ...     at_once = jobs.train()
    """

    def __init__(self, jobs: Mapping[str, Sequence[int]], threads: int = 1, timeout: float = 120.0,
                 echo: bool = True):
        from .devices import child_env

        unknown = [name for name in jobs if name not in LEARNING_RATES]
        if unknown or not jobs:
            raise ValueError(f"jobs={dict(jobs)!r}: name each job one of {sorted(LEARNING_RATES)}, "
                             "e.g. {'A': [0, 1], 'B': [2, 3]}")
        envs = {name: child_env(list(ids)) for name, ids in jobs.items()}  # validates every id first
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
                    [sys.executable, "-m", "mgpu_lab.subset_train", "--model", name, "--serve",
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


if __name__ == "__main__":
    sys.exit(main())

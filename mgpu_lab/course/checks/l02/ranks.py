"""What lesson 02's checks run in a fresh process: every case of an exercise in one call.

:func:`run_loaders` builds loaders with the learner's ``make_loader`` for every
situation its check judges (CUDA devices included: building a pinned loader
needs no GPU) and describes them; :func:`run_seeds` runs ``seed_worker`` in
real forked workers that start from one copied random state, in each of the
check's real ranks (every rank with the same loader generator seed) or in one
process without a launcher; :func:`run_best`
times ``best_num_workers`` on data sets whose speed per ``num_workers`` the
check sets. Each returns plain evidence, which :mod:`.checkers` judges.
"""
from __future__ import annotations

import multiprocessing
import numpy as np
import os
import random
import time
import torch
import warnings
from contextlib import contextmanager
from torch.utils.data import DataLoader, Dataset, get_worker_info

from ..sim.cuda import simulated_gpus
from ..sim.outcome import one_thread, outcome


def fork_workers() -> None:
    """Start DataLoader workers with fork in this process, as in the learner's Jupyter kernel on Linux.

    The check's process inherits the forkserver start method of the launcher;
    its workers would then pickle the data set and import torch anew (seconds each).
    """
    multiprocessing.set_start_method("fork", force=True)
    one_thread()
    # The "more workers than cores" warning names this machine's core count: keep check output stable.
    warnings.filterwarnings("ignore", message="This DataLoader will create")


# -- make_loader --------------------------------------------------------------------
class Numbered(Dataset):
    """``n`` one-element float tensors 0, 1, ..., n-1."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int):
        return torch.tensor([float(index)])


def describe_loader(make_loader, device, num_workers: int, train: bool, iterate: bool) -> dict:
    """Build a loader of 10 numbered samples, batch size 4, with the learner's make_loader; describe it."""
    loader = make_loader(Numbered(10), 4, device, num_workers=num_workers, train=train)
    if not isinstance(loader, DataLoader):
        return {"type": type(loader).__name__}
    out = {"type": "DataLoader", "sampler": type(loader.sampler).__name__, "drop_last": loader.drop_last,
           "pin_memory": loader.pin_memory, "persistent_workers": loader.persistent_workers,
           "num_workers": loader.num_workers, "batch_size": loader.batch_size}
    if iterate:
        out["batches"] = [[int(v) for v in b.flatten()] for b in loader]
    return out


@contextmanager
def _no_gpus():
    yield


def run_loaders(make_loader, scenarios: dict) -> dict:
    """``{name: outcome of describe_loader(...)}`` for ``scenarios = {name: (device, num_workers, train,
    iterate, simulated GPUs or None)}``."""
    fork_workers()
    out = {}
    for name, (device, workers, train, iterate, gpus) in scenarios.items():
        with simulated_gpus(gpus) if gpus is not None else _no_gpus():
            out[name] = outcome(describe_loader, make_loader, device, workers, train, iterate)
    return out


# -- seed_worker ----------------------------------------------------------------------
_WORKER_ERROR: list = []  # in a worker: what the learner's seed_worker raised there, if anything
GENERATORS = ("torch", "random", "numpy")


class Draws(Dataset):
    """Item i: (worker id, one draw each from torch, Python's random and NumPy's global generator), or,
    where the worker's ``seed_worker`` raised, (worker id, "raised", error type, message)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int):
        info = get_worker_info()
        worker = info.id if info is not None else -1
        if _WORKER_ERROR:
            return (worker, "raised", *_WORKER_ERROR)
        return (worker, float(torch.rand(())), random.random(), float(np.random.rand()))


def _first_draws(loader) -> dict:
    """The first draw of each generator in each worker, over one epoch of ``loader``."""
    first = {}
    for item in loader:
        if item[1] == "raised":
            if item[2] == "NotImplementedError":
                raise NotImplementedError(item[3])
            return {"error": f"{item[2]} in a worker: {item[3]}"}
        first.setdefault(item[0], tuple(round(v, 12) for v in item[1:]))
    return {gen: [first[w][i] for w in sorted(first)] for i, gen in enumerate(GENERATORS)}


def run_seeds(seed_worker, generator_seed: int = 7, num_workers: int = 2, single: bool = False) -> dict:
    """Two epochs of a forked DataLoader using ``seed_worker``, and one epoch of a second loader with the
    same generator seed: ``{"epoch1", "epoch2", "again"}``, each the first draws per generator and worker,
    and ``"copied"``, the first draws of Python's and NumPy's state as every worker copies it (or
    ``{"error": ...}``); ``single``: as one process without a launcher (no ``RANK``, no process group).

    Every worker first gets back the random state of this process for Python
    and NumPy (what fork copies, and what forked workers kept before PyTorch 1.9
    reseeded NumPy), then the learner's ``seed_worker(worker_id)`` runs. Every
    rank runs the same loaders with the same generator seed, as ranks started
    from one script do. What it raises is sent back as data: a worker that
    fails its init leaves a DataLoader whose shutdown waits seconds for it.
    """
    fork_workers()
    if single:
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
            os.environ.pop(name, None)
    random.seed(1234)
    np.random.seed(1234)
    parent = (random.getstate(), np.random.get_state())
    copied = {"random": round(random.random(), 12), "numpy": round(float(np.random.rand()), 12)}  # as copied
    random.setstate(parent[0])
    np.random.set_state(parent[1])

    def init(worker_id):
        random.setstate(parent[0])
        np.random.set_state(parent[1])
        try:
            seed_worker(worker_id)
        except BaseException as exc:  # noqa: BLE001 - reported with the items
            _WORKER_ERROR[:] = [type(exc).__name__, str(exc).splitlines()[0] if str(exc) else ""]

    def loader():
        return DataLoader(Draws(2 * num_workers), batch_size=None, num_workers=num_workers, worker_init_fn=init,
                          generator=torch.Generator().manual_seed(generator_seed), multiprocessing_context="fork")

    first = loader()
    out = {}
    for name, source in (("epoch1", first), ("epoch2", first), ("again", None)):
        got = _first_draws(source if source is not None else loader())
        if "error" in got:
            return got
        out[name] = got
    out["copied"] = copied
    return out


# -- best_num_workers -----------------------------------------------------------------
class Paced(Dataset):
    """Samples that cost ``costs[num_workers]`` seconds (a sleep) and are counted per num_workers; a worker's
    first sample costs ``startup`` seconds more (its start-up: each worker has its own copy of the data set)."""

    def __init__(self, costs: dict, n: int, counts, startup: float = 0.0):
        self.costs, self.n, self.counts, self.startup, self.started = costs, n, counts, startup, False

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int):
        info = get_worker_info()
        k = info.num_workers if info is not None else 0
        with self.counts.get_lock():
            self.counts[min(k, len(self.counts) - 1)] += 1
        if info is not None and not self.started:
            self.started = True
            time.sleep(self.startup)
        time.sleep(self.costs.get(k, 0.0))
        return torch.zeros(2)


def run_best(best_num_workers, scenarios: list, batch_size: int, n_batches: int, n: int) -> list:
    """For each ``(costs, candidates, startup)``: the learner's choice on a :class:`Paced` data set of ``n``
    samples (each worker's start-up ``startup`` seconds), and the samples drawn per candidate (an outcome
    per scenario)."""
    fork_workers()
    out = []
    for costs, candidates, startup in scenarios:
        counts = multiprocessing.get_context("fork").Array("l", 17)
        got = outcome(best_num_workers, Paced(costs, n, counts, startup), list(candidates), batch_size, n_batches)
        if got[0] == "ok" and not isinstance(got[1], (int, float, str, type(None))):
            got = ("ok", repr(got[1])[:100])
        out.append({"outcome": got, "counts": {k: counts[k] for k in candidates}})
    return out

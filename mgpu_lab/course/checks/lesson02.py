"""Checks of lesson 02 (data loading): make_loader, seed_worker, best_num_workers.

Every answer runs in a fresh process, with real DataLoaders and real workers:

- ``make_loader`` is judged from the loader it builds (sampler, drop_last,
  pin_memory, persistent_workers), so "pin_memory exactly when the device is
  CUDA" is checked on a CPU-only machine by passing ``torch.device("cuda")``
  (building a loader with ``pin_memory=True`` needs no GPU; iterating would);
- ``seed_worker`` runs as the worker_init_fn of a real forked DataLoader whose
  workers start from the same copied random state, as forked workers did
  before PyTorch 1.9 reseeded NumPy itself;
- ``best_num_workers`` measures a data set whose speed per worker count the
  check controls (samples sleep), and which counts the samples drawn.
"""
from __future__ import annotations

import multiprocessing
import random
import time
import warnings

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from ._core import exercise


# -- make_loader --------------------------------------------------------------------
class Numbered(Dataset):
    """``n`` one-element float tensors 0, 1, ..., n-1."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int):
        return torch.tensor([float(index)])


def pretend_gpus(n: int) -> None:
    """Make ``torch.cuda`` in this process report ``n`` GPUs (no CUDA call is made)."""
    torch.cuda.is_available = lambda: n > 0
    torch.cuda.device_count = lambda: n


def fork_workers() -> None:
    """Start DataLoader workers with fork in this process, as in the learner's Jupyter kernel on Linux.

    A rank process inherits the forkserver start method of the launcher; its
    workers would then pickle the data set and import torch anew (seconds each).
    """
    multiprocessing.set_start_method("fork", force=True)
    # The "more workers than cores" warning names this machine's core count: keep check output stable.
    warnings.filterwarnings("ignore", message="This DataLoader will create")


def inspect_loader(make_loader, device, num_workers: int, train: bool, iterate: bool) -> dict:
    """Build a loader of 10 numbered samples, batch size 4, with the learner's make_loader; describe it."""
    fork_workers()
    loader = make_loader(Numbered(10), 4, device, num_workers=num_workers, train=train)
    if not isinstance(loader, DataLoader):
        return {"type": type(loader).__name__}
    out = {"type": "DataLoader", "sampler": type(loader.sampler).__name__, "drop_last": loader.drop_last,
           "pin_memory": loader.pin_memory, "persistent_workers": loader.persistent_workers,
           "num_workers": loader.num_workers, "batch_size": loader.batch_size}
    if iterate:
        out["batches"] = [[int(v) for v in b.flatten()] for b in loader]
    return out


def _describe(got: dict, keys) -> str:
    return ", ".join(f"{k}={got.get(k)!r}" for k in keys)


@exercise("02.make_loader", points=7, description="make_loader(dataset, batch_size, device, num_workers=0, "
          "train=True): shuffle and drop_last when training only, pin_memory exactly for CUDA, "
          "persistent_workers exactly when num_workers > 0")
def _make_loader(t, make_loader):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    with t.case("train=True: shuffles (RandomSampler) and drops the last incomplete batch",
                hint="training wants shuffle=True (a new order every epoch) and drop_last=True (no tiny, "
                     "noisy last batch; under DDP also equal batch counts on every rank)"):
        got = t.call(inspect_loader, make_loader, cpu, 0, True, False)
        if got["type"] != "DataLoader":
            t.fail("return a torch.utils.data.DataLoader", "DataLoader", got["type"])
        t.equal(_describe(got, ("sampler", "drop_last")), "sampler='RandomSampler', drop_last=True")
    with t.case("train=False: keeps the order and every sample (batches [0..3], [4..7], [8, 9])",
                hint="evaluation must see every sample once, in order: shuffle=False, drop_last=False"):
        got = t.call(inspect_loader, make_loader, cpu, 0, False, True)
        t.equal(_describe(got, ("sampler", "drop_last", "batches")),
                "sampler='SequentialSampler', drop_last=False, batches=[[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]")
    with t.case("device=torch.device('cuda'): pin_memory=True (judged on the loader, which needs no GPU)",
                hint="pin_memory=(torch.device(device).type == 'cuda'): decide from the device argument, "
                     "not from torch.cuda.is_available()"):
        got = t.call(inspect_loader, make_loader, cuda, 0, True, False)
        t.equal(got.get("pin_memory"), True)
    with t.case("device=cpu on a machine with 2 GPUs: pin_memory=False",
                hint="pinning only helps copies to a GPU; a loader for the CPU must not pin (decide from "
                     "the device argument, not from torch.cuda.is_available())"):
        got = t.call(inspect_loader, make_loader, cpu, 0, True, False, prepare=(pretend_gpus, (2,)))
        t.equal(got.get("pin_memory"), False)
    with t.case("num_workers=2: two workers, persistent_workers=True",
                hint="pass num_workers through and set persistent_workers=(num_workers > 0), so the "
                     "workers start once, not at every epoch"):
        got = t.call(inspect_loader, make_loader, cpu, 2, True, False)
        t.equal(_describe(got, ("num_workers", "persistent_workers")), "num_workers=2, persistent_workers=True")
    with t.case("num_workers=0: persistent_workers=False (DataLoader refuses True without workers)",
                hint="persistent_workers=(num_workers > 0): with num_workers=0 there is no worker to keep"):
        got = t.call(inspect_loader, make_loader, cpu, 0, False, False, catch=True)
        if got[0] == "raised":
            t.fail("", "a DataLoader with persistent_workers=False", f"{got[1]}: {got[2]}")
        t.equal(got[1].get("persistent_workers"), False)
    with t.case("train=True, 2 workers, device cuda:1: 2 shuffled full batches of 4, pinned", hidden=True):
        got = t.call(inspect_loader, make_loader, torch.device("cuda", 1), 2, True, False)
        if got.get("pin_memory") is not True or got.get("batch_size") != 4:
            t.fail("cuda:1 is a CUDA device too; keep the batch size")
        got = t.call(inspect_loader, make_loader, cpu, 2, True, True)
        sizes = [len(b) for b in got["batches"]]
        flat = sorted(v for b in got["batches"] for v in b)
        if sizes != [4, 4] or len(set(flat)) != 8:
            t.fail("two full batches of distinct samples", "[4, 4]", str(sizes))


# -- seed_worker ----------------------------------------------------------------------
class Draws(Dataset):
    """Item i: (worker id, one draw from Python's random, one from NumPy's global generator)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int):
        info = get_worker_info()
        return (info.id if info is not None else -1, random.random(), float(np.random.rand()))


def worker_draws(seed_worker, generator_seed: int, num_workers: int = 2) -> dict:
    """First draws of each worker of a forked DataLoader using ``seed_worker``.

    Every worker first gets back the random state of this process (what fork
    copies, and what forked workers kept before PyTorch 1.9 reseeded NumPy),
    then the learner's ``seed_worker(worker_id)`` runs.
    """
    fork_workers()
    random.seed(1234)
    np.random.seed(1234)
    parent = (random.getstate(), np.random.get_state())

    def init(worker_id):
        random.setstate(parent[0])
        np.random.set_state(parent[1])
        seed_worker(worker_id)

    loader = DataLoader(Draws(2 * num_workers), batch_size=None, num_workers=num_workers, worker_init_fn=init,
                        generator=torch.Generator().manual_seed(generator_seed), multiprocessing_context="fork")
    try:
        items = list(loader)
    except Exception as exc:  # noqa: BLE001 - the worker's error, re-raised by the DataLoader
        if isinstance(exc, NotImplementedError):
            raise
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        return {"error": f"{type(exc).__name__} in a worker: {lines[-1] if lines else ''}"}
    first = {}
    for worker, r, n in items:
        first.setdefault(worker, (round(r, 12), round(n, 12)))
    return {"random": [first[w][0] for w in sorted(first)], "numpy": [first[w][1] for w in sorted(first)]}


SEED_HINT = ("seed from torch's per-worker seed: s = torch.initial_seed() % 2**32, then np.random.seed(s) "
             "and random.seed(s)")


@exercise("02.seed_worker", points=5, description="seed_worker(worker_id): seed Python's random and NumPy in "
          "each DataLoader worker from torch's per-worker seed")
def _seed_worker(t, seed_worker):
    runs = {}
    with t.case("runs in real workers, where torch's per-worker seed is a 64-bit number",
                hint="np.random.seed accepts only 0..2**32-1: reduce the seed with % 2**32"):
        runs["a"] = t.call(worker_draws, seed_worker, 7)
        runs["b"] = t.call(worker_draws, seed_worker, 7)
        runs["c"] = t.call(worker_draws, seed_worker, 8)
        errors = [r["error"] for r in runs.values() if "error" in r]
        if errors:
            t.fail("", "no error", errors[0])
    ok = not any("error" in r for r in runs.values()) and len(runs) == 3
    for gen, name in (("numpy", "NumPy"), ("random", "Python's random")):
        with t.case(f"{name}: two workers that start from the same copied state draw different numbers",
                    hint=f"the classic bug: every worker makes the same 'random' augmentation. {SEED_HINT}"):
            if not ok:
                t.fail("the first case did not pass")
            a, b = runs["a"][gen]
            if a == b:
                t.fail("", "different first draws in worker 0 and worker 1", f"both {a}")
    with t.case("the same generator seed gives the same draws in a second run (reproducible)",
                hint="derive the seed from torch (torch.initial_seed()), not from time or os.urandom; "
                     "DataLoader(generator=torch.Generator().manual_seed(...)) fixes torch's seeds"):
        if not ok:
            t.fail("the first case did not pass")
        t.equal(runs["b"], runs["a"])
    with t.case("another generator seed gives other draws (augmentations change from epoch to epoch)",
                hint="seeding with worker_id or a constant repeats the same augmentations every epoch "
                     "and every run; use torch.initial_seed(), which the DataLoader draws anew each epoch"):
        if not ok:
            t.fail("the first case did not pass")
        if runs["c"] == runs["a"]:
            t.fail("", "different draws for generator seeds 7 and 8", "the same draws")


# -- best_num_workers -----------------------------------------------------------------
class Paced(Dataset):
    """Samples that cost ``costs[num_workers]`` seconds (a sleep) and are counted per num_workers."""

    def __init__(self, costs: dict, n: int, counts):
        self.costs, self.n, self.counts = costs, n, counts

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int):
        info = get_worker_info()
        k = info.num_workers if info is not None else 0
        with self.counts.get_lock():
            self.counts[k] += 1
        time.sleep(self.costs.get(k, 0.0))
        return torch.zeros(2)


def run_best(best_num_workers, costs: dict, candidates: list, batch_size: int, n_batches: int,
             n: int = 96) -> dict:
    """The learner's choice on a :class:`Paced` data set, and the samples drawn per candidate."""
    fork_workers()
    counts = multiprocessing.get_context("fork").Array("l", max(candidates) + 1)
    got = best_num_workers(Paced(costs, n, counts), list(candidates), batch_size, n_batches)
    return {"got": got, "counts": {k: counts[k] for k in candidates}}


def _fastest(costs: dict, candidates) -> int:
    return max(candidates, key=lambda k: max(k, 1) / costs[k])


BEST_CASES = [  # name, costs per num_workers (s/sample), candidates, hidden
    ("workers help (15 ms/sample in every process): 2 of [0, 1, 2]", {0: .015, 1: .015, 2: .015}, [0, 1, 2], False),
    ("workers make samples slower (4 ms alone, 30 ms in workers): 0 of [0, 2, 3]", {0: .004, 2: .03, 3: .03},
     [0, 2, 3], False),
    ("the fastest in the middle: 2 of [3, 0, 2, 1]", {0: .02, 1: .02, 2: .004, 3: .04}, [3, 0, 2, 1], True),
]
BATCH, N_BATCHES = 4, 6


@exercise("02.best_num_workers", points=5, description="best_num_workers(dataset, candidates, batch_size, "
          "n_batches): measure each candidate after a warm-up and return the fastest")
def _best(t, best_num_workers):
    first = None
    for name, costs, candidates, hidden in BEST_CASES:
        expected = _fastest(costs, candidates)
        with t.case(f"{name}", hidden=hidden,
                    hint="time n_batches for every candidate (after a warm-up) and return the num_workers "
                         "with the most samples per second; more workers is not always faster"):
            got = t.call(run_best, best_num_workers, costs, candidates, BATCH, N_BATCHES)
            first = first or got
            t.equal(got["got"], expected)
    with t.case(f"draws a warm-up batch plus n_batches={N_BATCHES} from every candidate",
                hint="iterate a DataLoader for every candidate: first at least one warm-up batch (workers "
                     "start, caches fill), then time n_batches"):
        if first is None:
            t.fail("the first case did not finish")
        low = {k: c for k, c in first["counts"].items() if c < (N_BATCHES + (1 if k == 0 else 0)) * BATCH}
        if low:
            t.fail("", f"at least {(N_BATCHES + 1) * BATCH} samples with num_workers=0 and "
                       f"{N_BATCHES * BATCH} with workers", f"samples drawn per num_workers: {first['counts']}")
    with t.case("draws only what it measures (a few warm-up batches plus n_batches, not whole epochs)",
                hint="stop after the warm-up and n_batches batches: next(iterator) in a loop, then drop "
                     "the iterator; a sweep over whole epochs takes far longer"):
        if first is None:
            t.fail("the first case did not finish")
        high = {k: c for k, c in first["counts"].items() if c > (N_BATCHES + 5 + 2 * k) * BATCH}
        if high:
            t.fail("", f"about {(N_BATCHES + 1) * BATCH} samples per num_workers (plus what workers "
                       "prefetch)", f"samples drawn per num_workers: {first['counts']}")

"""Measuring how well a DataLoader feeds the model.

- :func:`show_sweep`: lesson 02's demo of a ``num_workers`` sweep: it prints
  each rate, plots the curve (:func:`plot_sweep`) and hands back only its
  :func:`knee`, the fewest workers within 90% of the best.
- :func:`epoch_starts`: what each epoch pays before its first batch (worker
  start-up, which ``persistent_workers`` pays only once).
- :func:`timed_loop`: a training loop with a progress bar that splits the time
  into *waiting for the next batch* and *computing*: data-bound or compute-bound.
- :func:`copy_timing`: host-to-GPU copies from pageable vs pinned memory (CUDA).
- :class:`RandomDraws` and :func:`draws_by_worker`: what the random number
  generators of each worker produce (the seeding bug, and its fix).

Example:
    >>> knee([{"num_workers": 0, "samples_per_s": 100}, {"num_workers": 2, "samples_per_s": 195}])
    2
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from mgpu_lab.data.rates import _bar, batch_size_of

__all__ = ["knee", "plot_sweep", "show_sweep", "epoch_starts", "LoopTiming", "timed_loop",
           "copy_timing", "RandomDraws", "draws_by_worker", "batch_size_of"]


def knee(rows: list[dict], fraction: float = 0.9) -> int:
    """The fewest workers that reach ``fraction`` of the best throughput in a sweep.

    Example:
        >>> knee([{"num_workers": 0, "samples_per_s": 100}, {"num_workers": 2, "samples_per_s": 190},
        ...       {"num_workers": 4, "samples_per_s": 200}])
        2
    """
    if not rows:
        raise ValueError("knee() needs the rows of a sweep; got none")
    best = max(r["samples_per_s"] for r in rows)
    return min(r["num_workers"] for r in rows if r["samples_per_s"] >= fraction * best)


def plot_sweep(rows: list[dict], ax=None, cores: int | None = None, title: str = ""):
    """Plot samples/s against num_workers, marking the knee and the number of CPU cores."""
    import matplotlib.pyplot as plt

    from mgpu_lab.devices import cpu_count

    if ax is None:
        _, ax = plt.subplots(figsize=(5.5, 3.4))
    xs = [r["num_workers"] for r in rows]
    ys = [r["samples_per_s"] for r in rows]
    ax.plot(xs, ys, "o-", color="tab:blue")
    k = knee(rows)
    ax.plot([k], [ys[xs.index(k)]], "o", ms=12, mfc="none", mec="tab:red", label=f"knee: {k} workers")
    cores = cpu_count() if cores is None else cores
    ax.axvline(cores, color="gray", ls="--", lw=1, label=f"{cores} CPU cores")
    ax.set_xlabel("num_workers")
    ax.set_ylabel("samples / s")
    ax.set_xticks(xs)
    ax.set_ylim(bottom=0)
    ax.set_title(title or "DataLoader throughput")
    ax.legend(loc="lower right")
    return ax


def show_sweep(dataset: Dataset, workers, batch_size: int = 32, n_batches: int = 10, cores: int | None = None,
               title: str = "", ax=None) -> int:
    """Measure a ``num_workers`` sweep, print each rate, plot the curve and return its knee.

    The demo of lesson 02's section 2: it shows the measurement, and hands back
    only the knee (the fewest workers within 90% of the best), not the rates.

    Args:
        dataset: The data set to load.
        workers: The ``num_workers`` values to measure.
        batch_size, n_batches: Per candidate, batches of ``batch_size`` timed after the workers started.
        cores: The CPU cores to mark on the plot (default: this machine's).
        title: The plot's title.
        ax: A matplotlib axis to draw on (default: a new figure).

    Returns:
        The knee of the sweep (:func:`knee`).

    Example:
        >>> import matplotlib
        >>> matplotlib.use("Agg")
        >>> from mgpu_lab.data.images import EncodedImages
        >>> show_sweep(EncodedImages(n=64), [0], batch_size=8, n_batches=2)  # doctest: +ELLIPSIS
        num_workers=0: ... samples/s  (start-up ... s)
        0
    """
    from mgpu_lab.data import rates  # the measurement; the notebook imports only this module

    rows = rates.sweep_workers(dataset, workers, batch_size=batch_size, n_batches=n_batches, progress=False)
    for r in rows:
        print(f"num_workers={r['num_workers']}: {r['samples_per_s']:6.0f} samples/s  (start-up {r['startup_s']:.2f} s)")
    plot_sweep(rows, ax=ax, cores=cores, title=title)
    return knee(rows)


def epoch_starts(loader, epochs: int = 3, batches: int | None = None) -> list[dict]:
    """Per epoch: seconds until its first batch, and seconds for the whole (or ``batches``) epoch."""
    rows = []
    for epoch in range(epochs):
        start = time.perf_counter()
        first = None
        for i, _ in enumerate(loader):
            if first is None:
                first = time.perf_counter() - start
            if batches is not None and i + 1 >= batches:
                break
        rows.append({"epoch": epoch, "first_batch_s": first, "epoch_s": time.perf_counter() - start})
    return rows


@dataclass
class LoopTiming:
    """Where the time of a loop went: waiting for batches, or computing on them.

    The first batch is kept apart (``startup_s``: worker start-up, lazy
    initialisation); ``samples``, ``wait_s`` and ``compute_s`` count the batches after it.
    """

    batches: int
    samples: int
    startup_s: float
    wait_s: float
    compute_s: float

    @property
    def wait_fraction(self) -> float:
        return self.wait_s / max(self.wait_s + self.compute_s, 1e-12)

    @property
    def verdict(self) -> str:
        return "data-bound" if self.wait_s > self.compute_s else "compute-bound"

    @property
    def samples_per_s(self) -> float:
        """Steady-state throughput: the batches after the first."""
        return self.samples / max(self.wait_s + self.compute_s, 1e-12)

    def __str__(self) -> str:
        return (f"{self.batches} batches: waiting {self.wait_s:.2f} s, computing {self.compute_s:.2f} s "
                f"({100 * self.wait_fraction:.0f}% waiting: {self.verdict}), {self.samples_per_s:.0f} samples/s; "
                f"first batch after {self.startup_s:.2f} s")


def timed_loop(loader, step, max_batches: int | None = None, device=None, desc: str = "train",
               progress: bool = True) -> LoopTiming:
    """Run ``step(batch)`` over ``loader`` with a progress bar; time waiting vs computing.

    Args:
        step: the work on one batch (e.g. a training step).
        max_batches: stop after this many batches (default: one epoch).
        device: when it is a CUDA device, the GPU is synchronised after each
            step, so that the GPU's time counts as computing (CUDA calls
            return before the GPU has finished).

    Returns:
        A :class:`LoopTiming`; ``str()`` of it says data-bound or compute-bound.
    """
    cuda = device is not None and torch.device(device).type == "cuda"
    total = len(loader) if max_batches is None else min(max_batches, len(loader))
    bar = _bar(total=total, desc=desc, disable=not progress, unit="batch")
    wait = compute = startup = 0.0
    batches = samples = 0
    it = iter(loader)
    try:
        while batches < total:
            t0 = time.perf_counter()
            batch = next(it)
            t1 = time.perf_counter()
            step(batch)
            if cuda:
                torch.cuda.synchronize(device)
            t2 = time.perf_counter()
            if batches == 0:
                startup = t1 - t0
            else:
                wait += t1 - t0
                compute += t2 - t1
                samples += batch_size_of(batch)
                bar.set_postfix(waiting=f"{100 * wait / max(wait + compute, 1e-12):.0f}%", refresh=False)
            batches += 1
            bar.update(1)
    finally:
        bar.close()
        del it
    return LoopTiming(batches, samples, startup, wait, compute)


def copy_timing(shape=(64, 3, 224, 224), device=None, repeats: int = 10) -> dict | None:
    """Host-to-GPU copies of a batch of ``shape``: pageable vs pinned host memory.

    Returns ``None`` when ``device`` is not a CUDA device (there is nothing to copy
    to on a CPU-only machine). Otherwise, per copy in seconds:

    - ``pageable_s`` / ``pinned_s``: the copy itself (GPU synchronised);
    - ``pageable_nb_cpu_s`` / ``pinned_nb_cpu_s``: how long ``.to(device,
      non_blocking=True)`` holds the Python thread. From pinned memory it returns
      at once and the copy overlaps what follows; from pageable memory it cannot.
    """
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type != "cuda":
        return None
    pageable = torch.randn(shape)
    pinned = pageable.pin_memory()
    out = {"bytes": pageable.numel() * pageable.element_size()}
    for name, src in (("pageable", pageable), ("pinned", pinned)):
        src.to(device)
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(repeats):
            src.to(device)
        torch.cuda.synchronize(device)
        out[f"{name}_s"] = (time.perf_counter() - start) / repeats
        held = 0.0
        for _ in range(repeats):
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            src.to(device, non_blocking=True)
            held += time.perf_counter() - t0
        torch.cuda.synchronize(device)
        out[f"{name}_nb_cpu_s"] = held / repeats
    out["pinned_GBps"] = out["bytes"] / out["pinned_s"] / 1e9
    out["pageable_GBps"] = out["bytes"] / out["pageable_s"] / 1e9
    return out


class RandomDraws(Dataset):
    """Items that show what each worker's random number generators produce.

    ``dataset[i]`` is a dict: the index, the worker that made it (-1 in the main
    process), and one draw from Python's ``random``, NumPy's global
    ``np.random``, torch, and ``own_rng``: a NumPy Generator this data set
    created in ``__init__`` (in the main process, before any worker forked).
    """

    def __init__(self, n: int = 8, seed: int = 0):
        self.n = n
        self.rng = np.random.default_rng(seed)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict:
        info = get_worker_info()
        return {"index": index, "worker": info.id if info is not None else -1,
                "random": random.random(), "numpy": float(np.random.rand()),
                "torch": float(torch.rand(())), "own_rng": float(self.rng.random())}


def draws_by_worker(dataset: Dataset, num_workers: int = 2, worker_init_fn=None, generator=None,
                    context: str = "fork") -> dict[int, list[dict]]:
    """Run ``dataset`` through a DataLoader once; the items grouped by the worker that made them.

    ``context="fork"`` (the Linux default before Python 3.14): workers start as
    copies of this process, random number generator states included.
    """
    loader = DataLoader(dataset, batch_size=None, shuffle=False, num_workers=num_workers,
                        worker_init_fn=worker_init_fn, generator=generator,
                        multiprocessing_context=context if num_workers > 0 else None)
    out: dict[int, list[dict]] = {}
    for item in loader:
        out.setdefault(item["worker"], []).append(item)
    return out

"""Per-rank step timing on real ranks: where the time goes when ranks get unequal work (lesson 05).

:func:`timed_epoch` runs one epoch of a DDP training loop in each rank, with
the forward/backward of every batch stood in for by a wait proportional to the
batch's cost (e.g. its number of tokens): by default a sleep, as a host process
waits while its GPU computes, which keeps timings clean on shared CPU cores;
``work=spin`` burns a core instead. Each step ends in DDP's
gradient all-reduce, so a rank with a cheap batch waits there for the rank
with the costliest one: the per-step start, compute-done and end times it
records show that waiting. :func:`summarize` turns them into wall-clock
numbers, :func:`plot_rank_bars` and :func:`plot_timeline` into pictures.
The training loop for ranks with unequal numbers of batches under DDP's ``Join``
is :mod:`mgpu_lab.data.join`, which lesson 05's notebook does not import.

Example:
    >>> from mgpu_lab import launch
    >>> from torch.utils.data import DistributedSampler
    >>> costs = [10] * 64  # 64 samples, 1 ms each
    >>> make = lambda rank, world: DistributedSampler(range(64), world, rank)
    >>> results = launch(timed_epoch, 2, make, costs, batch_size=8)
    launch: 2 ranks · ...
    >>> summarize(results)["steps"]
    4
"""
from __future__ import annotations

import time

import torch

from mgpu_lab import dist as mdist

__all__ = ["spin", "timed_epoch", "summarize", "plot_rank_bars", "plot_timeline"]

UNIT_S = 1e-4  # seconds of work per unit of cost: a 100-token sample takes 10 ms


def spin(seconds: float) -> None:
    """Keep this core busy for ``seconds`` of wall-clock time.

    A busy-wait stands in for CPU compute; on a machine whose cores are shared
    with other work it overshoots by a scheduler time slice now and then, which
    is why :func:`timed_epoch` sleeps by default.
    """
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class _Costs(torch.utils.data.Dataset):
    def __init__(self, costs):
        self.costs = torch.as_tensor(costs, dtype=torch.float64)

    def __len__(self) -> int:
        return len(self.costs)

    def __getitem__(self, index: int):
        return self.costs[index]


def timed_epoch(make_sampler, costs, batch_size: int = 8, unit_s: float = UNIT_S, epoch: int = 0,
                work=time.sleep) -> dict:
    """One timed epoch of DDP training in this rank (call it through ``launch``).

    Args:
        make_sampler: ``make_sampler(rank, world_size)`` returns this rank's sampler
            (a function or lambda from a notebook cell works).
        costs: per-sample costs; a batch's work lasts ``unit_s * sum(costs)`` seconds.
        batch_size: samples per step.
        unit_s: seconds of work per unit of cost.
        epoch: passed to ``sampler.set_epoch``.
        work: ``work(seconds)`` stands in for a batch's forward and backward:
            ``time.sleep`` (default) or :func:`spin`.

    Returns:
        This rank's record: ``rank``, and per step ``start``, ``computed`` (work
        done) and ``end`` (after the gradient all-reduce) times on a clock that
        every process on the machine shares, and the batch ``cost``.

    Raises:
        ValueError: ``batch_size < 1`` or ``unit_s < 0``.
    """
    import torch.distributed as tdist
    from torch.nn.parallel import DistributedDataParallel as DDP

    if batch_size < 1 or unit_s < 0:
        raise ValueError(f"batch_size={batch_size}, unit_s={unit_s}: need batch_size >= 1 and unit_s >= 0")
    rank, world, device = tdist.get_rank(), tdist.get_world_size(), mdist.device()
    sampler = make_sampler(rank, world)
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)
    loader = torch.utils.data.DataLoader(_Costs(costs), batch_size=batch_size, sampler=sampler)
    torch.manual_seed(0)
    module = torch.nn.Linear(16, 1).to(device)
    model = DDP(module, device_ids=[device.index]) if device.type == "cuda" else DDP(module)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.ones(1, 16, device=device)
    rec = {"rank": rank, "start": [], "computed": [], "end": [], "cost": []}
    tdist.barrier()  # start together, so the first step's wait is not start-up skew
    for batch in loader:
        rec["start"].append(time.perf_counter())
        cost = float(batch.sum())
        work(cost * unit_s)  # this batch's forward and backward
        rec["computed"].append(time.perf_counter())
        optimizer.zero_grad()
        model(x).sum().backward()  # DDP all-reduces the gradients here: waits for every rank
        optimizer.step()
        rec["end"].append(time.perf_counter())
        rec["cost"].append(cost)
    return rec


def summarize(results: list[dict]) -> dict:
    """Wall-clock numbers of one :func:`timed_epoch` launch.

    Returns:
        ``steps``; ``wall_s`` (first start to last end); per rank ``cost``,
        ``compute_s`` and ``wait_s`` (time in the all-reduce, mostly waiting for a
        slower rank); ``ideal_s`` (the mean rank's compute: the wall time of
        perfectly balanced work); ``lost`` (``wall_s / ideal_s - 1``, the share of
        time the stragglers cost); ``step_imbalance`` (sum over steps of the
        costliest rank's batch over the mean rank's, from the recorded costs).

    Example:
        >>> r = [{"start": [0, 2], "computed": [1, 3], "end": [2, 4], "cost": [1, 1]},
        ...      {"start": [0, 2], "computed": [2, 4], "end": [2, 4], "cost": [2, 2]}]
        >>> round(summarize(r)["lost"], 3)
        0.333
    """
    t0 = min(r["start"][0] for r in results if r["start"]) if any(r["start"] for r in results) else 0.0
    t1 = max((r["end"][-1] for r in results if r["end"]), default=t0)
    compute = [sum(c - s for s, c in zip(r["start"], r["computed"])) for r in results]
    wait = [sum(e - c for c, e in zip(r["computed"], r["end"])) for r in results]
    ideal = sum(compute) / len(compute)
    together = list(zip(*(r["cost"] for r in results)))  # the batch costs of each step all ranks took
    mean = sum(sum(c) / len(c) for c in together)
    return {"steps": max(len(r["start"]) for r in results), "wall_s": t1 - t0,
            "cost": [sum(r["cost"]) for r in results], "compute_s": compute, "wait_s": wait,
            "ideal_s": ideal, "lost": (t1 - t0) / ideal - 1 if ideal > 0 else 0.0,
            "step_imbalance": sum(max(c) for c in together) / mean if mean > 0 else 1.0}


def plot_rank_bars(runs: dict, ax=None):
    """Stacked bars per rank: work (colour) and waiting (grey), one group per run.

    Args:
        runs: ``{label: results of timed_epoch}``, e.g. ``{"DistributedSampler": r1, "balanced": r2}``.
        ax: a matplotlib Axes (default: a new figure).
    """
    import matplotlib.pyplot as plt

    ax = ax or plt.subplots(figsize=(6, 3))[1]
    x, ticks, labels = 0, [], []
    for i, (label, results) in enumerate(runs.items()):
        s = summarize(results)
        for r, (c, w) in enumerate(zip(s["compute_s"], s["wait_s"])):
            ax.bar(x, c, color=f"C{i}", label=f"work ({label})" if r == 0 else None)
            ax.bar(x, w, bottom=c, color="0.75", label="waiting for the slowest rank" if r == 0 and i == 0 else None)
            ticks.append(x)
            labels.append(f"rank {r}")
            x += 1
        ax.text(x - 1 - (len(results) - 1) / 2, max(s["compute_s"][j] + s["wait_s"][j] for j in range(len(results))),
                f"{label}\nwall {s['wall_s']:.2f} s", ha="center", va="bottom", fontsize=8)
        x += 0.6
    ax.set_xticks(ticks, labels, fontsize=8)
    ax.set_ylabel("seconds in the epoch")
    ax.margins(y=0.25)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7, loc="lower right", framealpha=0.9)
    return ax


def plot_timeline(results: list[dict], ax=None, steps: int = 12, title: str = ""):
    """Per-rank timeline of the first ``steps`` steps: work (colour), waiting (grey).

    Every step ends for all ranks at the same moment (the all-reduce); the grey
    part is the time a rank sat idle waiting for the slowest one.
    """
    import matplotlib.pyplot as plt

    ax = ax or plt.subplots(figsize=(7, 1 + 0.4 * len(results)))[1]
    t0 = min(r["start"][0] for r in results if r["start"])
    for r in results:
        row = r.get("rank", results.index(r))
        n = min(steps, len(r["start"]))
        busy = [((s - t0) * 1e3, (c - s) * 1e3) for s, c in zip(r["start"][:n], r["computed"][:n])]
        idle = [((c - t0) * 1e3, (e - c) * 1e3) for c, e in zip(r["computed"][:n], r["end"][:n])]
        ax.broken_barh(busy, (row - 0.35, 0.7), facecolors=f"C{row}", edgecolor="white", linewidth=0.5)
        ax.broken_barh(idle, (row - 0.35, 0.7), facecolors="0.8")
    ax.set_yticks(range(len(results)), [f"rank {r.get('rank', i)}" for i, r in enumerate(results)])
    ax.invert_yaxis()
    ax.set_xlim(left=0)
    ax.set_xlabel("ms since the first step")
    ax.set_title(title or f"first {steps} steps: work (colour), waiting (grey)", fontsize=9)
    return ax

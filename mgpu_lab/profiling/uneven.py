"""DDP steps whose ranks do unequal work, profiled: a slow loader, extra compute or a larger batch on a rank.

:func:`uneven_ddp_trace` profiles DDP steps of lesson 09's model (``depth`` Linear+ReLU
layers of ``width``, then a classifier) in every rank and writes one Chrome trace per rank
(:func:`mgpu_lab.profiling.traces.profile_steps`). Every batch comes through a
``DataLoader`` whose fetch waits ``delay`` seconds, as a read from a slow file system
would; the profiler labels each fetch ``enumerate(DataLoader)#...__next__`` by itself.
Each step's forward, backward and optimizer step are labelled with ``record_function``, as in
:func:`mgpu_lab.profiling.runs.ddp_trace`. ``ranks`` changes what some ranks do:
``{1: {"delay": 0.3}}`` gives rank 1 a slower loader, ``{0: {"extra": 6}}`` gives rank 0
more compute in forward and backward (:class:`Extra`, which adds no parameter, so DDP's
gradients stay the same shape on every rank), ``{2: {"batch": 1024}}`` gives rank 2 a larger
batch.

Example:
    >>> import tempfile
    >>> from mgpu_lab import launch
    >>> folder = tempfile.mkdtemp()
    >>> paths = launch(uneven_ddp_trace, 2, folder, {1: {"delay": 0.05}}, delay=0.0, width=64, steps=1)
    launch: 2 ranks · ...
    >>> [p.rsplit("/", 1)[1] for p in paths]
    ['uneven-rank0.json', 'uneven-rank1.json']
"""
from __future__ import annotations

import math
import time

import torch
import torch.distributed as tdist
from torch import nn
from torch.profiler import record_function

__all__ = ["Extra", "Samples", "uneven_ddp_trace", "SETTINGS"]

#: What a rank of :func:`uneven_ddp_trace` does unless ``ranks`` says otherwise for it.
SETTINGS = ("delay", "extra", "batch")


class Samples(torch.utils.data.Dataset):
    """Fixed random samples (features, class), fetched a batch at a time (``__getitems__``), so that a larger
    batch costs the loader little more; each fetch first waits ``delay`` seconds (a slow file system)."""

    def __init__(self, width: int, delay: float = 0.0, n: int = 2048):
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, width, generator=generator)
        self.y = torch.randint(0, 10, (n,), generator=generator)
        self.delay = delay

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]

    def __getitems__(self, indices: list) -> list:
        if self.delay:
            time.sleep(self.delay)
        rows = torch.tensor(indices) % len(self.x)
        return [self.x[rows], self.y[rows]]


def _as_batch(fetched: list) -> list:
    """The collate function: :meth:`Samples.__getitems__` returns the batch already stacked."""
    return fetched


class Extra(nn.Module):
    """``repeats`` products ``tanh(h @ up) @ down`` beside the activations, kept in the output (times 0) so that
    backward computes through them too: more compute per sample, and no parameter (DDP's buckets stay the same)."""

    def __init__(self, width: int, repeats: int, hidden: int = 4096):
        super().__init__()
        generator = torch.Generator().manual_seed(1)
        self.repeats = repeats
        self.up = torch.randn(width, hidden, generator=generator) / math.sqrt(width)  # plain tensors: no buffers
        self.down = torch.randn(hidden, width, generator=generator) / math.sqrt(hidden)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if not self.repeats:
            return h
        y = h
        for _ in range(self.repeats):
            y = torch.tanh(y @ self.up) @ self.down
        return h + 0.0 * y


def uneven_ddp_trace(folder: str, ranks: dict | None = None, *, delay: float = 0.05, extra: int = 0,
                     batch: int = 32, width: int = 512, depth: int = 3, steps: int = 3,
                     name: str = "uneven-rank") -> str:
    """In a rank: profile DDP steps whose batches come through a slow ``DataLoader``; the trace's path.

    Args:
        ranks: ``{rank: {"delay"|"extra"|"batch": value}}``: what differs on those ranks.
        delay: seconds every fetch of a batch waits.
        extra: :class:`Extra`'s repeats after the first layer (0: none).
        batch: samples per batch.
        width, depth: the model (lesson 09's ``mlp``).
        steps: the steps kept in the trace, after two that are run and dropped: the first pays one-time
            costs, and in the second DDP rebuilds its buckets in the order the gradients arrived.

    Raises:
        ValueError: ``ranks`` names a setting that does not exist.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    from mgpu_lab.comm.ddp_buckets import mlp

    from .traces import profile_steps

    mine = {"delay": delay, "extra": extra, "batch": batch}
    for rank, changed in (ranks or {}).items():
        if set(changed) - set(SETTINGS):
            raise ValueError(f"ranks[{rank}]={changed}: the settings are {SETTINGS}")
        if rank == tdist.get_rank():
            mine |= changed
    base = mlp(width, depth)
    ddp = DDP(nn.Sequential(base[0], base[1], Extra(width, mine["extra"]), *base[2:]))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    loader = iter(torch.utils.data.DataLoader(Samples(width, mine["delay"]), batch_size=mine["batch"],
                                              collate_fn=_as_batch, sampler=range(1 << 30)))  # indices wrap

    def step():
        x, y = next(loader)
        opt.zero_grad()
        with record_function("forward"):
            loss = nn.functional.cross_entropy(ddp(x), y)
        with record_function("backward"):
            loss.backward()
        with record_function("optimizer"):
            opt.step()

    return profile_steps(step, folder, wait=1, warmup=1, active=steps, name=name, profile_memory=False)

"""Model parallelism: stages on devices, micro-batches, busy/idle timelines, DDP over two-device replicas.

Lesson 06 splits a model into stages, puts each stage on its own device and
moves the activations between them. With two GPUs the stages sit on cuda:0
and cuda:1; on a machine without GPUs the same code runs with both devices
being the CPU (see :func:`stage_devices`). :class:`TwoStageNet`
holds two stages on two devices, :func:`ddp_replica_rank` trains DDP (in a rank) over replicas that are
each one such net, and :func:`ideal_timeline` draws the schedule GPipe's formula assumes (the pipelines
themselves are :mod:`mgpu_lab.pipelining`'s).

Example:
    >>> import torch
    >>> model = mlp(features=8, width=16, depth=4, classes=3)
    >>> stage1, stage2 = split(model, 2)
    >>> net = TwoStageNet(stage1, stage2, "cpu", "cpu")
    >>> net(torch.randn(6, 8)).shape
    torch.Size([6, 3])
    >>> round(ideal_timeline(2, 4).idle_fraction(), 3)
    0.2
"""
from __future__ import annotations

import copy
import numbers

import torch
from torch import nn

from mgpu_lab.parallel.timeline import Timeline

__all__ = ["TwoStageNet", "mlp", "split", "stage_devices", "replica_devices", "Timeline", "ideal_timeline",
           "ddp_replica_rank"]


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name}={value!r} ({type(value).__name__}) must be a whole number >= 1, e.g. {name}=4")
    if value < 1:
        raise ValueError(f"{name}={value} must be >= 1: a pipeline has at least one stage and one micro-batch")
    return int(value)


class TwoStageNet(nn.Module):
    """``stage2(stage1(x))`` with ``stage1`` on ``dev1`` and ``stage2`` on ``dev2``.

    The activations cross from ``dev1`` to ``dev2`` in :meth:`forward`; the
    output stays on ``dev2``, so move the labels there for the loss. Autograd
    sends the gradient back across the same copy.

    Example:
        >>> net = TwoStageNet(nn.Linear(4, 8), nn.Linear(8, 2), "cpu", "cpu")  # cuda:0, cuda:1 on 2 GPUs
        >>> net(torch.randn(3, 4)).shape
        torch.Size([3, 2])
    """

    def __init__(self, stage1: nn.Module, stage2: nn.Module, dev1, dev2):
        super().__init__()
        self.dev1, self.dev2 = torch.device(dev1), torch.device(dev2)
        self.stage1 = stage1.to(self.dev1)
        self.stage2 = stage2.to(self.dev2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stage1(x.to(self.dev1))
        return self.stage2(h.to(self.dev2))


def mlp(features: int = 64, width: int = 512, depth: int = 8, classes: int = 10, seed: int = 0) -> nn.Sequential:
    """A plain MLP, the same weights for the same seed: ``depth`` hidden Linear+ReLU layers.

    Example:
        >>> len(mlp(depth=4))
        9
    """
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    layers, size = [], features
    for _ in range(depth):
        layers += [nn.Linear(size, width), nn.ReLU()]
        size = width
    layers.append(nn.Linear(size, classes))
    torch.random.set_rng_state(gen_state)
    return nn.Sequential(*layers)


def split(model: nn.Sequential, n_stages: int = 2) -> list[nn.Sequential]:
    """Cut a Sequential into ``n_stages`` consecutive stages with about equal parameter counts.

    The stages share the model's layers (no copies).

    Raises:
        ValueError: fewer layers than stages.

    Example:
        >>> [len(s) for s in split(mlp(depth=4), 2)]
        [4, 5]
    """
    n_stages = _positive_int("n_stages", n_stages)
    layers = list(model)
    if len(layers) < n_stages:
        raise ValueError(f"a Sequential of {len(layers)} layers cannot be cut into n_stages={n_stages}; "
                         f"use n_stages<={len(layers)}")
    prefix = [0]
    for layer in layers:
        prefix.append(prefix[-1] + sum(p.numel() for p in layer.parameters()))
    bounds = [0]
    for k in range(1, n_stages):  # cut nearest to k/n of the parameters; ties: later (ReLUs stay behind)
        allowed = range(bounds[-1] + 1, len(layers) - (n_stages - k) + 1)
        bounds.append(min(allowed, key=lambda j: (abs(prefix[j] - prefix[-1] * k / n_stages), -j)))
    bounds.append(len(layers))
    return [nn.Sequential(*layers[a:b]) for a, b in zip(bounds, bounds[1:])]


def stage_devices(n_stages: int = 2, gpus: int | None = None) -> list[torch.device]:
    """One device per stage: cuda:0, cuda:1, ... when there are enough GPUs, else the CPU for all.

    Example:
        >>> stage_devices(2, gpus=0), stage_devices(2, gpus=2)
        ([device(type='cpu'), device(type='cpu')], [device(type='cuda', index=0), device(type='cuda', index=1)])
    """
    n_stages = _positive_int("n_stages", n_stages)
    gpus = (torch.cuda.device_count() if torch.cuda.is_available() else 0) if gpus is None else gpus
    if gpus >= n_stages:
        return [torch.device("cuda", i) for i in range(n_stages)]
    return [torch.device("cpu")] * n_stages


def replica_devices(rank: int, devices_per_replica: int = 2, gpus: int | None = None) -> list[torch.device]:
    """The devices of model replica ``rank`` when every replica spans ``devices_per_replica`` GPUs.

    Replica ``r`` owns cuda:r*k .. cuda:r*k+k-1 (k = devices_per_replica), so
    world size = GPU count // k; with no GPU every stage is on the CPU.

    Raises:
        ValueError: GPUs visible but too few for this replica.

    Example:
        >>> replica_devices(1, 2, gpus=4)
        [device(type='cuda', index=2), device(type='cuda', index=3)]
        >>> replica_devices(1, 2, gpus=0)
        [device(type='cpu'), device(type='cpu')]
    """
    k = _positive_int("devices_per_replica", devices_per_replica)
    gpus = (torch.cuda.device_count() if torch.cuda.is_available() else 0) if gpus is None else gpus
    if gpus == 0:
        return [torch.device("cpu")] * k
    if (rank + 1) * k > gpus:
        raise ValueError(f"replica {rank} needs cuda:{rank * k}..cuda:{rank * k + k - 1} but {gpus} GPU(s) are "
                         f"visible: {gpus} GPUs hold {gpus // k} replica(s) of {k} devices; "
                         f"use world_size<={gpus // k}")
    return [torch.device("cuda", rank * k + i) for i in range(k)]


def ideal_timeline(n_stages: int, n_micro: int, t_forward: float = 1.0, t_backward: float = 2.0) -> Timeline:
    """GPipe's schedule with equal stages and free communication: all forwards, then all backwards.

    Its idle fraction is exactly ``(n_stages - 1) / (n_micro + n_stages - 1)``.

    Example:
        >>> round(ideal_timeline(2, 4).idle_fraction(), 6)
        0.2
    """
    from mgpu_lab.pipelining.schedule import gpipe_schedule  # not at the top: lesson 06's notebook imports this module

    p, m = _positive_int("n_stages", n_stages), _positive_int("n_micro", n_micro)
    return gpipe_schedule([t_forward] * p, [t_backward] * p, m)


def ddp_replica_rank(stages, x, y, loss_fn, steps: int = 3, lr: float = 0.1, gpus: int | None = None) -> dict:
    """DDP over model replicas that span two devices each; rank r is replica r.

    Each replica is a :class:`TwoStageNet` on
    :func:`replica_devices` ``(rank, 2, gpus)`` (CPU
    for both stages when ``gpus=0``), wrapped in DDP with ``device_ids=None``:
    a module on several devices must not name one. Each rank trains on its
    ``torch.chunk(x, world_size)`` shard with SGD.

    Returns:
        ``{"rank", "devices", "losses", "params"}`` after ``steps`` steps.
    """
    import torch.distributed as tdist
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = tdist.get_rank(), tdist.get_world_size()
    devices = replica_devices(rank, 2, gpus)
    if devices[0].type == "cuda":
        torch.cuda.set_device(devices[0])  # NCCL talks from the replica's first GPU
    model = TwoStageNet(copy.deepcopy(stages[0]), copy.deepcopy(stages[1]), *devices)
    ddp = DDP(model, device_ids=None)  # the gradients of both stages are averaged across replicas
    optimizer = torch.optim.SGD(ddp.parameters(), lr=lr)
    xs, ys = torch.chunk(x, world)[rank], torch.chunk(y, world)[rank]
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        out = ddp(xs)
        loss = loss_fn(out, ys.to(out.device))
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return {"rank": rank, "devices": [str(d) for d in devices], "losses": losses,
            "params": [p.detach().cpu() for p in model.parameters()]}

"""Pipelines across real processes: one stage per rank, activations and gradients sent between ranks.

:func:`run_gpipe` launches the hand-written GPipe step of
:mod:`mgpu_lab.parallel.gpipe` (``dist.isend``/``dist.recv`` forward, gradients back,
timed per micro-batch) and returns one :class:`~mgpu_lab.parallel.timeline.Timeline`
per configuration.
:func:`torch_gpipe_rank` does the same with ``torch.distributed.pipelining``
(``PipelineStage`` + ``ScheduleGPipe``), and :func:`ddp_replica_rank` trains
DDP over replicas that each span two devices.

On a machine without GPUs every rank is pinned to its own CPU core with one
thread (:func:`pin_to_core`): the stages then really run at the same time, as
they would on two GPUs.

Example:
    >>> import torch
    >>> from mgpu_lab.parallel.model_parallel import mlp, split
    >>> stages = split(mlp(features=32, width=64, depth=4), 2)
    >>> x, y = torch.randn(64, 32), torch.randint(0, 10, (64,))
    >>> runs = run_gpipe(stages, x, y, torch.nn.CrossEntropyLoss(), n_micros=(1, 4), steps=1)
    launch: 2 ranks · ...
    >>> [round(r["formula"], 2) for r in runs]
    [0.5, 0.2]
"""
from __future__ import annotations

import copy
import time

import torch
import torch.distributed as tdist

from mgpu_lab import dist
from mgpu_lab.parallel.model_parallel import TwoStageNet, replica_devices
from mgpu_lab.parallel.pinning import pin_to_core
from mgpu_lab.parallel.timeline import Timeline

__all__ = ["pin_to_core", "run_gpipe", "torch_gpipe_rank", "ddp_replica_rank"]

def run_gpipe(stages, x, y, loss_fn, n_micros=(1, 2, 4, 8), steps: int = 3, warmup: int = 1,
              pin: bool = True, timeout: float = 300) -> list[dict]:
    """Launch :func:`gpipe_rank` with one rank per stage; summarise each micro-batch count.

    Returns:
        One dict per ``n_micro``: ``timeline`` (the timed step of median length,
        every rank's lane), ``step_time`` (its seconds), ``bubble`` (its idle
        fraction), ``formula`` (the idle fraction of GPipe's ideal schedule, ``(p - 1) / (m + p - 1)``),
        ``loss``, ``grads`` (every stage's, in order) and ``cpu_share`` (the
        lowest rank's CPU time over wall time in its compute spans: well below 1
        means other processes shared the cores and stretched the timings; None on GPUs).
    """
    from mgpu_lab import launch
    from mgpu_lab.parallel.gpipe import gpipe_rank  # not at the top: lesson 06's notebook imports this module

    ranks = launch(gpipe_rank, len(stages), stages, x, y, loss_fn, tuple(n_micros), steps, warmup, pin,
                   timeout=timeout)
    out = []
    for j, n_micro in enumerate(n_micros):
        per_step = [Timeline(s for r in ranks for s in r["results"][j]["spans"][k]) for k in range(steps)]
        median = sorted(per_step, key=lambda tl: tl.makespan)[len(per_step) // 2]
        out.append({"n_micro": n_micro, "timeline": median.shifted(), "step_time": median.makespan,
                    "bubble": median.idle_fraction(), "formula": (len(stages) - 1) / (n_micro + len(stages) - 1),
                    "loss": ranks[-1]["results"][j]["loss"],
                    "grads": [g for r in ranks for g in r["results"][j]["grads"]],
                    "cpu_share": min((r["results"][j]["cpu_share"] for r in ranks
                                      if r["results"][j]["cpu_share"] is not None), default=None)})
    return out


def torch_gpipe_rank(stages, x, y, loss_fn, n_micro: int = 4, steps: int = 3, pin: bool = True) -> dict:
    """The GPipe step with ``torch.distributed.pipelining``: ``PipelineStage`` + ``ScheduleGPipe``.

    ``ScheduleGPipe`` cuts the batch into ``n_micro`` micro-batches and divides
    the gradients by ``n_micro`` (``scale_grads=True``): with equal micro-batches
    (``n_micro`` divides the batch) they are the gradients of the batch's mean
    loss, as in :func:`mgpu_lab.parallel.gpipe.gpipe_rank`.

    Returns:
        ``{"rank", "times": [seconds per timed step], "losses": [the micro-batch
        losses, last rank], "grads": [this stage's gradients]}``.

    Raises:
        ValueError: ``n_micro`` does not divide the batch.
    """
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    if len(x) % n_micro:
        raise ValueError(f"n_micro={n_micro} does not divide the batch of {len(x)}: ScheduleGPipe scales every "
                         f"micro-batch by 1/{n_micro}, the mean over the batch only for equal micro-batches; "
                         f"pick a divisor of {len(x)}")
    rank, world = tdist.get_rank(), tdist.get_world_size()
    dev = dist.device()
    if pin and dev.type == "cpu":
        pin_to_core(rank)
    module = stages[rank].to(dev)
    schedule = ScheduleGPipe(PipelineStage(module, rank, world, dev), n_microbatches=n_micro, loss_fn=loss_fn)
    times, losses = [], []
    for step in range(steps + 1):  # the first step is warm-up
        module.zero_grad(set_to_none=True)
        losses = []
        tdist.barrier()
        start = time.perf_counter()
        if rank == 0:
            schedule.step(x.to(dev))
        elif rank == world - 1:
            schedule.step(target=y.to(dev), losses=losses)
        else:
            schedule.step()
        if step:
            times.append(time.perf_counter() - start)
    return {"rank": rank, "times": times, "losses": [float(v.detach()) for v in losses],
            "grads": [p.grad.detach().cpu() for p in module.parameters()]}


def ddp_replica_rank(stages, x, y, loss_fn, steps: int = 3, lr: float = 0.1, gpus: int | None = None) -> dict:
    """DDP over model replicas that span two devices each; rank r is replica r.

    Each replica is a :class:`~mgpu_lab.parallel.model_parallel.TwoStageNet` on
    :func:`~mgpu_lab.parallel.model_parallel.replica_devices` ``(rank, 2, gpus)`` (CPU
    for both stages when ``gpus=0``), wrapped in DDP with ``device_ids=None``:
    a module on several devices must not name one. Each rank trains on its
    ``torch.chunk(x, world_size)`` shard with SGD.

    Returns:
        ``{"rank", "devices", "losses", "params"}`` after ``steps`` steps.
    """
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

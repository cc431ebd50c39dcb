"""Pipelines across real processes: one stage per rank, activations and gradients sent between ranks.

:func:`gpipe_rank` is the hand-written GPipe step (``dist.isend``/``dist.recv``
forward, gradients back), timed per micro-batch; :func:`run_gpipe` launches it
and returns one :class:`~mgpu_lab.parallel.timeline.Timeline` per configuration.
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
import os
import time

import torch
import torch.distributed as tdist

from mgpu_lab import dist
from mgpu_lab.parallel.model_parallel import TwoStageNet, bubble_fraction, replica_devices
from mgpu_lab.parallel.timeline import Timeline

__all__ = ["pin_to_core", "gpipe_rank", "run_gpipe", "torch_gpipe_rank", "ddp_replica_rank"]

_MAX_DIM = 8  # the shape header of a sent activation: [ndim, size0, size1, ...]


def pin_to_core(rank: int | None = None, threads: int = 1) -> int | None:
    """Pin this process to CPU core ``rank % cores`` and ``threads`` intra-op threads.

    Returns:
        The core, or None where affinity cannot be set (then only the thread count is set).

    Example:
        >>> from mgpu_lab import launch
        >>> launch(pin_to_core, 1)   # in a rank: pinning the caller would pin this process for good
        launch: 1 rank · ...
        [0]
    """
    rank = dist.rank() if rank is None else rank
    torch.set_num_threads(threads)
    if not hasattr(os, "sched_setaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    core = cores[rank % len(cores)]
    os.sched_setaffinity(0, {core})
    return core


def _isend(tensor: torch.Tensor, dst: int, header: bool) -> list:
    """Send the tensor, after its shape when ``header`` (the receiver need not know the shape)."""
    shape = list(tensor.shape)
    if len(shape) > _MAX_DIM - 1:
        raise ValueError(f"cannot send a tensor of {len(shape)} dimensions; at most {_MAX_DIM - 1}")
    sent = []
    if header:  # messages between two ranks arrive in the order they were sent: the shape first
        head = torch.tensor([len(shape), *shape] + [0] * (_MAX_DIM - 1 - len(shape)), device=tensor.device)
        sent.append((tdist.isend(head, dst), head))
    tensor = tensor.contiguous()
    return sent + [(tdist.isend(tensor, dst), tensor)]


def _recv(src: int, device, shape=None, dtype=torch.float32) -> torch.Tensor:
    """Receive a tensor of ``shape``, or of the shape sent first when ``shape`` is None."""
    if shape is None:
        head = torch.empty(_MAX_DIM, dtype=torch.int64, device=device)
        tdist.recv(head, src)
        shape = [int(v) for v in head[1:1 + int(head[0])]]
    out = torch.empty(shape, dtype=dtype, device=device)
    tdist.recv(out, src)
    return out


def _gpipe_step(stage, dev, x, y, loss_fn, n_micro, timeline, lane) -> torch.Tensor | None:
    """One GPipe step of this rank's stage: every forward, then every backward."""
    rank, world = tdist.get_rank(), tdist.get_world_size()
    first, last = rank == 0, rank == world - 1
    xs, ys = torch.chunk(x, n_micro), torch.chunk(y, n_micro)
    ins, outs, pending = [], [], []
    for i, chunk in enumerate(xs):
        if first:
            h_in = chunk.to(dev)
        else:  # only the first activation comes with its shape: the others differ in batch size only
            h_in = _recv(rank - 1, dev, None if i == 0 else (len(chunk), *ins[0].shape[1:])).requires_grad_()
        with timeline.span(lane, f"F{i}", dev):
            out = stage(h_in)
            if last:  # weighted by the micro-batch's share: the gradient of the batch's mean loss
                out = loss_fn(out, ys[i].to(dev)) * (len(chunk) / len(x))
        if not last:
            pending += _isend(out.detach(), rank + 1, header=i == 0)  # async: the next forward starts at once
        ins.append(h_in)
        outs.append(out)
    for i in range(len(xs)):
        grad = None
        if not last:
            grad = torch.empty_like(outs[i])
            tdist.recv(grad, rank + 1)
        with timeline.span(lane, f"B{i}", dev):
            outs[i].backward(grad)
        if not first:
            pending.append((tdist.isend(ins[i].grad.contiguous(), rank - 1), ins[i].grad))
    for work, _ in pending:
        work.wait()
    return torch.stack([o.detach() for o in outs]).sum() if last else None


def gpipe_rank(stages, x, y, loss_fn, n_micros=(1, 2, 4, 8), steps: int = 3, warmup: int = 1,
               pin: bool = True, return_grads: bool = True) -> dict:
    """Run in every rank of a launch with ``len(stages)`` ranks: rank r holds ``stages[r]``.

    For each micro-batch count, ``warmup`` untimed steps then ``steps`` timed
    ones (no optimizer: the weights stay fixed, so every step has the same
    gradients). Every rank gets the whole batch; the first rank feeds ``x``,
    the last one uses ``y``.

    Returns:
        ``{"rank", "lane", "results": [{"n_micro", "spans": [spans of each timed step],
        "loss", "grads", "cpu_share"}]}``; ``loss`` is the batch's mean loss on the
        last rank, ``cpu_share`` the CPU time the rank got in its compute spans over
        their wall time (None on a GPU).
    """
    rank, world = tdist.get_rank(), tdist.get_world_size()
    if len(stages) != world:
        raise ValueError(f"{len(stages)} stages but world_size={world}; launch one rank per stage")
    dev = dist.device()
    core = pin_to_core(rank) if pin and dev.type == "cpu" else None
    lane = f"stage {rank + 1} · rank {rank} · " + (f"cpu core {core}" if core is not None else str(dev))
    stage = stages[rank].to(dev)
    results = []
    for n_micro in n_micros:
        spans, loss, cpu = [], None, [0.0, 0.0]
        for step in range(warmup + steps):
            stage.zero_grad(set_to_none=True)
            tdist.barrier()
            timeline = Timeline()
            loss = _gpipe_step(stage, dev, x, y, loss_fn, n_micro, timeline, lane)
            if step >= warmup:
                spans.append(timeline.resolve().spans)
                cpu = [cpu[0] + timeline.cpu_seconds, cpu[1] + timeline.cpu_wall_seconds]
        grads = [p.grad.detach().cpu() for p in stage.parameters()] if return_grads else None
        results.append({"n_micro": n_micro, "spans": spans, "grads": grads,
                        "loss": None if loss is None else float(loss),
                        "cpu_share": cpu[0] / cpu[1] if cpu[1] else None})
    return {"rank": rank, "lane": lane, "results": results}


def run_gpipe(stages, x, y, loss_fn, n_micros=(1, 2, 4, 8), steps: int = 3, warmup: int = 1,
              pin: bool = True, timeout: float = 300) -> list[dict]:
    """Launch :func:`gpipe_rank` with one rank per stage; summarise each micro-batch count.

    Returns:
        One dict per ``n_micro``: ``timeline`` (the timed step of median length,
        every rank's lane), ``step_time`` (its seconds), ``bubble`` (its idle
        fraction), ``formula`` (:func:`~mgpu_lab.parallel.model_parallel.bubble_fraction`),
        ``loss``, ``grads`` (every stage's, in order) and ``cpu_share`` (the
        lowest rank's CPU time over wall time in its compute spans: well below 1
        means other processes shared the cores and stretched the timings; None on GPUs).
    """
    from mgpu_lab import launch

    ranks = launch(gpipe_rank, len(stages), stages, x, y, loss_fn, tuple(n_micros), steps, warmup, pin,
                   timeout=timeout)
    out = []
    for j, n_micro in enumerate(n_micros):
        per_step = [Timeline(s for r in ranks for s in r["results"][j]["spans"][k]) for k in range(steps)]
        median = sorted(per_step, key=lambda tl: tl.makespan)[len(per_step) // 2]
        out.append({"n_micro": n_micro, "timeline": median.shifted(), "step_time": median.makespan,
                    "bubble": median.idle_fraction(), "formula": bubble_fraction(len(stages), n_micro),
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
    loss, as in :func:`gpipe_rank`.

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

"""Pipelines across real processes: one stage per rank, activations and gradients sent between ranks.

:func:`run_gpipe` launches torch's GPipe schedule (``torch.distributed.pipelining``:
``PipelineStage`` + ``ScheduleGPipe``, which sends the activations forward and their
gradients back with asynchronous point-to-point calls) with every micro-batch's forward
and backward timed on each rank (:class:`TimedStage`), and returns one
:class:`~mgpu_lab.parallel.timeline.Timeline` per configuration.
:func:`torch_gpipe_rank` runs the same schedule untimed.

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
    >>> [round(r["formula"], 2) for r in runs], [len(r["timeline"].spans) for r in runs]
    ([0.5, 0.2], [4, 16])
"""
from __future__ import annotations

import time

import torch
import torch.distributed as tdist
from torch import nn

from mgpu_lab import dist
from mgpu_lab.parallel.timeline import Timeline
from mgpu_lab.pipelining.pinning import pin_to_core

__all__ = ["pin_to_core", "run_gpipe", "TimedStage", "timed_gpipe_rank", "torch_gpipe_rank"]


class TimedStage(nn.Module):
    """A stage whose every forward and backward is a span of ``timeline`` (labels ``F<i>``, ``B<i>``).

    The forward is timed around the wrapped module's call; a backward from the moment the
    gradient of the stage's output exists (a hook on the output) to the moment the last of
    the stage's parameters has its gradient (hooks after each gradient is accumulated), so
    that timing adds no work: the first stage computes no gradient for its input. Every
    parameter must take part in every micro-batch. Micro-batches are numbered in the order
    of their forwards, backwards timed in the order they run; :meth:`restart` starts a new step.

    Example:
        >>> stage = TimedStage(nn.Linear(3, 2), Timeline(), "stage 1")
        >>> stage(torch.ones(4, 3)).sum().backward()
        >>> [label for _, label, _, _ in stage.timeline.spans]
        ['F0', 'B0']
    """

    def __init__(self, module: nn.Module, timeline: Timeline, lane: str, device=None):
        super().__init__()
        self.module, self.timeline, self.lane, self.device = module, timeline, lane, device
        self._params = [p for p in module.parameters() if p.requires_grad]
        for p in self._params:
            p.register_post_accumulate_grad_hook(self._accumulated)
        self.restart()

    def restart(self, timeline: Timeline | None = None) -> None:
        """Number micro-batches from 0 again, into ``timeline`` (default: the same one)."""
        self.timeline = self.timeline if timeline is None else timeline
        self.count, self._began, self._grads = 0, [], 0

    def _begin_backward(self, i: int) -> None:
        self._began.append((i, self.timeline.stamp(self.device), time.thread_time()))

    def _accumulated(self, _param) -> None:
        self._grads += 1
        if self._grads == len(self._params) and self._began:
            self._grads = 0
            i, start, cpu = self._began.pop(0)
            self._span(f"B{i}", start, cpu)

    def _span(self, label: str, start, cpu: float) -> None:
        end = self.timeline.stamp(self.device)
        self.timeline.add_stamped(self.lane, label, start, end, self.device)
        if isinstance(start, float):  # CPU time the thread got in the span: low when other processes took the core
            self.timeline.cpu_seconds += time.thread_time() - cpu
            self.timeline.cpu_wall_seconds += end - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "meta" or not torch.is_grad_enabled():  # a shape inference, not a micro-batch
            return self.module(x)
        i, self.count = self.count, self.count + 1
        start, cpu = self.timeline.stamp(self.device), time.thread_time()
        out = self.module(x)
        out.register_hook(lambda grad, i=i: self._begin_backward(i))
        self._span(f"F{i}", start, cpu)
        return out


def _step(schedule, rank: int, world: int, x, y, losses: list) -> None:
    """One step of a schedule on this rank: the first stage feeds the input, the last the target (and collects
    the micro-batches' losses), the others only pass activations on."""
    if rank == 0:
        schedule.step(x)
    elif rank == world - 1:
        schedule.step(target=y, losses=losses)
    else:
        schedule.step()


def timed_gpipe_rank(stages, x, y, loss_fn, n_micros=(1, 2, 4, 8), steps: int = 3, warmup: int = 1,
                     pin: bool = True) -> dict:
    """Run in every rank of a launch with ``len(stages)`` ranks: ``ScheduleGPipe`` over rank r's ``stages[r]``, timed.

    For each micro-batch count, ``warmup`` untimed steps then ``steps`` timed ones (no
    optimizer: the weights stay fixed, so every step has the same gradients). Every rank
    gets the whole batch; the first rank feeds ``x``, the last one uses ``y``.

    Returns:
        ``{"rank", "lane", "results": [{"n_micro", "spans": [spans of each timed step],
        "loss", "grads", "cpu_share"}]}``; ``loss`` is the batch's mean loss on the
        last rank, ``cpu_share`` the CPU time the rank got in its compute spans over
        their wall time (None on a GPU).

    Raises:
        ValueError: one stage per rank is not what was given, or a micro-batch count does
            not divide the batch (``ScheduleGPipe`` then weights the pieces unequally).
    """
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    rank, world = tdist.get_rank(), tdist.get_world_size()
    if len(stages) != world:
        raise ValueError(f"{len(stages)} stages but world_size={world}; launch one rank per stage")
    if any(len(x) % m for m in n_micros):
        raise ValueError(f"n_micros={tuple(n_micros)}: each must divide the batch of {len(x)} (ScheduleGPipe "
                         f"scales every micro-batch by 1/n_micro)")
    dev = dist.device()
    core = pin_to_core(rank) if pin and dev.type == "cpu" else None
    lane = f"stage {rank + 1} · rank {rank} · " + (f"cpu core {core}" if core is not None else str(dev))
    timed = TimedStage(stages[rank].to(dev), Timeline(), lane, dev)
    results = []
    for n_micro in n_micros:
        schedule = ScheduleGPipe(PipelineStage(timed, rank, world, dev), n_microbatches=n_micro, loss_fn=loss_fn)
        spans, losses, cpu = [], [], [0.0, 0.0]
        for step in range(warmup + steps):
            timed.zero_grad(set_to_none=True)
            timed.restart(Timeline())
            losses = []
            tdist.barrier()
            _step(schedule, rank, world, x.to(dev), y.to(dev), losses)
            if step >= warmup:
                spans.append(timed.timeline.resolve().spans)
                cpu = [cpu[0] + timed.timeline.cpu_seconds, cpu[1] + timed.timeline.cpu_wall_seconds]
        results.append({"n_micro": n_micro, "spans": spans,
                        "grads": [p.grad.detach().cpu() for p in timed.module.parameters()],
                        "loss": float(sum(float(v.detach()) for v in losses) / n_micro) if losses else None,
                        "cpu_share": cpu[0] / cpu[1] if cpu[1] else None})
    return {"rank": rank, "lane": lane, "results": results}


def run_gpipe(stages, x, y, loss_fn, n_micros=(1, 2, 4, 8), steps: int = 3, warmup: int = 1,
              pin: bool = True, timeout: float = 300) -> list[dict]:
    """Launch :func:`timed_gpipe_rank` with one rank per stage; summarise each micro-batch count.

    Returns:
        One dict per ``n_micro``: ``timeline`` (the timed step of median length,
        every rank's lane), ``step_time`` (its seconds), ``bubble`` (its idle
        fraction), ``formula`` (the idle fraction of GPipe's ideal schedule, ``(p - 1) / (m + p - 1)``),
        ``loss``, ``grads`` (every stage's, in order) and ``cpu_share`` (the
        lowest rank's CPU time over wall time in its compute spans: well below 1
        means other processes shared the cores and stretched the timings; None on GPUs).
    """
    from mgpu_lab import launch

    ranks = launch(timed_gpipe_rank, len(stages), stages, x, y, loss_fn, tuple(n_micros), steps, warmup, pin,
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
    loss, as in :func:`run_gpipe`, which times this schedule.

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
        _step(schedule, rank, world, x.to(dev), y.to(dev), losses)
        if step:
            times.append(time.perf_counter() - start)
    return {"rank": rank, "times": times, "losses": [float(v.detach()) for v in losses],
            "grads": [p.grad.detach().cpu() for p in module.parameters()]}

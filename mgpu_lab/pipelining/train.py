"""Training with ``torch.distributed.pipelining``'s schedules, PP alone or PP x DP.

:func:`train` trains an ``nn.Sequential`` cut into equal runs of layers
(:func:`split_layers`), one stage per rank for GPipe and 1F1B, several per rank
for interleaved 1F1B (stages ``rank, rank + p, ...``) and two in a V for ZBV
(stages ``rank`` and ``2p - 1 - rank``, :func:`stage_ids`), with MSE loss and SGD,
and gathers the whole model's ``state_dict`` on rank 0. With ``dp > 1`` the ranks
form a ``(dp, pp)`` mesh: each pipeline trains on its share of every batch and
the gradients are averaged across the replicas before the step (PP x DP).
:func:`schedule_rank` runs a schedule on fixed-work layers with every action
timed (:mod:`.record`), for the lesson's drawings and :mod:`bench`.
Scripts (``scripts/pp_train.py``, as ``train.train``) and later lessons import it.

Example:
    >>> from mgpu_lab import launch
    >>> from mgpu_lab.pipelining.work import work_model
    >>> batches = [(torch.randn(8, 4), torch.randn(8, 4)) for _ in range(2)]
    >>> out = launch(train, 2, lambda: work_model(4, 4), 2, "zbv", 4, batches, 0.1)
    launch: 2 ranks · ...
    >>> sorted(out[0])[:2], out[1]
    (['0.linear.bias', '0.linear.weight'], None)
"""
from __future__ import annotations

import torch
import torch.distributed as tdist
from torch import nn

from mgpu_lab.core import compat

compat.install()  # torch < 2.12: no warm-up send from a stage to its own rank (ZBV under torchrun, gloo)

__all__ = ["SCHEDULES", "stage_ids", "split_layers", "make_schedule", "train", "one_process",
           "schedule_rank"]

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zbv")


def stage_ids(schedule: str, n_stages: int, rank: int, world: int) -> list[int]:
    """The stages rank ``rank`` of a ``world``-rank pipeline holds under ``schedule``.

    Example:
        >>> stage_ids("interleaved", 6, 1, 2), stage_ids("zbv", 4, 0, 2), stage_ids("1f1b", 2, 1, 2)
        ([1, 3, 5], [0, 3], [1])
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}: pick one of {SCHEDULES}")
    per = n_stages // world
    if n_stages % world or (schedule in ("gpipe", "1f1b") and per != 1) or (schedule == "zbv" and per != 2):
        need = {"gpipe": "world", "1f1b": "world", "zbv": "2 x world"}.get(schedule, "a multiple of world")
        raise ValueError(f"{schedule} on {world} ranks cannot run {n_stages} stages: n_stages must be {need}")
    if schedule == "zbv":
        return [rank, n_stages - 1 - rank]
    return [rank + k * world for k in range(per)]


def split_layers(model: nn.Sequential, n_stages: int) -> list[nn.Sequential]:
    """``model`` cut into ``n_stages`` equal runs of consecutive layers (the layers themselves, not copies).

    Example:
        >>> [len(s) for s in split_layers(nn.Sequential(*[nn.Identity()] * 6), 3)]
        [2, 2, 2]
    """
    if len(model) % n_stages:
        raise ValueError(f"{len(model)} layers do not cut into {n_stages} equal stages; use a multiple of "
                         f"{n_stages} layers")
    per = len(model) // n_stages
    return [nn.Sequential(*list(model)[k * per:(k + 1) * per]) for k in range(n_stages)]


def make_schedule(schedule: str, stages: list, n_micro: int, loss_fn):
    """torch's schedule object for ``schedule`` over this rank's ``PipelineStage`` objects."""
    from torch.distributed import pipelining as pp

    if schedule in ("gpipe", "1f1b"):
        cls = pp.ScheduleGPipe if schedule == "gpipe" else pp.Schedule1F1B
        return cls(stages[0], n_microbatches=n_micro, loss_fn=loss_fn)
    cls = pp.ScheduleInterleaved1F1B if schedule == "interleaved" else pp.ScheduleZBVZeroBubble
    return cls(stages, n_microbatches=n_micro, loss_fn=loss_fn)


def _build(model: nn.Sequential, schedule: str, n_stages: int, n_micro: int, group, device):
    """This rank's modules (stage id -> module), PipelineStages and schedule."""
    from torch.distributed.pipelining import PipelineStage

    rank, world = tdist.get_rank(group), tdist.get_world_size(group)
    parts = split_layers(model, n_stages)
    ids = stage_ids(schedule, n_stages, rank, world)
    modules = {k: parts[k].to(device) for k in ids}
    stages = [PipelineStage(modules[k], k, n_stages, device, group=group) for k in ids]
    return modules, stages, make_schedule(schedule, stages, n_micro, nn.MSELoss())


def _step(sched, ids: list, n_stages: int, x, y) -> list:
    """One ``step()``: the input goes to the rank holding stage 0, the target to the one holding the last."""
    losses: list = []
    args = (x,) if 0 in ids else ()
    kwargs = {"target": y, "losses": losses} if n_stages - 1 in ids else {}
    sched.step(*args, **kwargs)
    return losses


def _gather_state(modules: dict, n_stages: int, n_layers: int) -> dict | None:
    """Every stage's weights, named as in the whole ``nn.Sequential``, on global rank 0 (None elsewhere)."""
    per = n_layers // n_stages
    mine = {}
    for k, module in modules.items():
        for name, value in module.state_dict().items():
            index, rest = name.split(".", 1)
            mine[f"{k * per + int(index)}.{rest}"] = value.detach().cpu().clone()
    parts = [None] * tdist.get_world_size() if tdist.get_rank() == 0 else None
    tdist.gather_object(mine, parts, dst=0)
    if tdist.get_rank() != 0:
        return None
    state = {k: v for part in parts for k, v in part.items()}
    return dict(sorted(state.items(), key=lambda kv: (int(kv[0].split(".")[0]), kv[0])))


def train(model_fn, n_stages: int, schedule: str, n_micro: int, batches, lr: float,
          dp: int = 1, virtual: int = 2) -> dict | None:
    """Train ``model_fn()`` with ``schedule`` over this process group; the whole ``state_dict`` on rank 0.

    Args:
        model_fn: returns the ``nn.Sequential`` (the same weights on every rank).
        n_stages: the ranks of one pipeline; the model is cut into that many stages for GPipe and
            1F1B, ``virtual`` per rank for interleaved and two per rank for ZBV.
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved"`` or ``"zbv"``.
        n_micro: micro-batches per step (they must divide the batch).
        batches: ``(x, y)`` pairs, one step each; MSE loss, SGD with ``lr``.
        dp: data-parallel replicas of the pipeline (a ``(dp, world // dp)`` mesh; each replica trains
            on its chunk of every batch and the gradients are averaged across replicas).
        virtual: stages per rank under interleaved 1F1B.
    """
    world = tdist.get_world_size()
    pp_group, dp_group = tdist.group.WORLD, None
    if dp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("dp", "pp"))
        pp_group, dp_group = mesh["pp"].get_group(), mesh["dp"].get_group()
    model = model_fn()
    total = n_stages * {"interleaved": virtual, "zbv": 2}.get(schedule, 1)
    modules, stages, sched = _build(model, schedule, total, n_micro, pp_group, torch.device("cpu"))
    params = [p for m in modules.values() for p in m.parameters()]
    optimizer = torch.optim.SGD(params, lr=lr)
    for x, y in batches:
        if dp > 1:
            x, y = torch.chunk(x, dp)[tdist.get_rank(dp_group)], torch.chunk(y, dp)[tdist.get_rank(dp_group)]
        optimizer.zero_grad()
        _step(sched, list(modules), total, x, y)
        if dp_group is not None:
            for p in params:
                tdist.all_reduce(p.grad, group=dp_group)
                p.grad /= dp
        optimizer.step()
    return _gather_state(modules, total, len(model))


def one_process(model_fn, batches, lr: float) -> dict:
    """The same training in one process: the whole model, the whole batch, MSE, SGD."""
    model = model_fn()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for x, y in batches:
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def schedule_rank(model_fn, schedule: str, n_stages: int, n_micro: int, x, y, steps: int = 2) -> dict:
    """Run ``steps`` steps of ``schedule`` (the first warms up); time every action of the others.

    Returns:
        ``{"rank", "spans": [(lane, label, start, end)] of the last step, "timed": the spans of every step but
        the first, "losses"}``: labels ``F3/s1`` (forward of micro-batch 3 on stage 1), ``B``, ``I`` (input
        gradient), ``W`` (weight gradient) and ``wait`` (waiting for a message).
    """
    from mgpu_lab.pipelining.record import record_actions

    rank = tdist.get_rank()
    model = model_fn()
    modules, stages, sched = _build(model, schedule, n_stages, n_micro, tdist.group.WORLD, torch.device("cpu"))
    losses, timed = [], []
    for step in range(steps):
        for m in modules.values():
            m.zero_grad(set_to_none=True)
        tdist.barrier()
        if step == 0:
            _step(sched, list(modules), n_stages, x, y)
            continue
        with record_actions(stages, f"rank {rank}") as timeline:
            losses = _step(sched, list(modules), n_stages, x, y)
        timed.append(list(timeline.spans))
    return {"rank": rank, "spans": timed[-1], "timed": timed, "losses": [float(v.detach()) for v in losses]}


def schedules_rank(configs: list, x, y, steps: int = 2) -> list:
    """:func:`schedule_rank` for every ``(schedule, n_layers, n_stages, n_micro, t_f, t_b, t_w)`` in one launch."""
    from mgpu_lab.pipelining.work import work_model

    out = []
    for schedule, n_layers, n_stages, n_micro, t_f, t_b, t_w in configs:
        def model_fn():
            return work_model(n_layers, x.shape[1], t_f, t_b, t_w)
        out.append(schedule_rank(model_fn, schedule, n_stages, n_micro, x, y, steps))
    return out

"""torch's own pipeline orders, read without a process group (lesson 12).

:func:`torch_orders` builds torch's interleaved 1F1B or ZBV schedule on stand-ins for a rank's stages and
reads every rank's order from its public ``pipeline_order``; :func:`stages_per_rank` says how many stages a
rank holds under each schedule. :mod:`.measure` (which lesson 12's notebook imports) and
:mod:`.orders` both use them, so they live here, below both.
"""
from __future__ import annotations

__all__ = ["stages_per_rank", "torch_orders"]


def stages_per_rank(schedule: str, virtual: int = 2) -> int:
    """1 for GPipe and 1F1B, ``virtual`` for interleaved, 2 for ZBV."""
    return {"interleaved": virtual, "zbv": 2}.get(schedule, 1)


def torch_orders(schedule: str, n_ranks: int, n_micro: int, virtual: int = 2) -> dict[int, list[str]]:
    """Every rank's compute actions under torch's interleaved 1F1B or ZBV, read from a built schedule.

    A schedule of several stages per rank works out every rank's order when it is made and keeps it in its
    public ``pipeline_order`` (``{rank: [action or None]}``; None is a time step the rank idles). Making one
    needs only what each stage tells it (its index, the stage count, the group's size), so the schedule is
    built here on stand-ins for rank 0's stages, without a process group. Actions come as labels ``F3/s1``
    (forward, micro-batch 3, stage 1), ``B`` (whole backward), ``I`` (input gradient), ``W`` (weight gradient).

    Args:
        schedule: ``"interleaved"`` (``virtual`` stages per rank, in a loop) or ``"zbv"`` (two, in a V).
        n_ranks: ranks of the pipeline.
        n_micro: micro-batches per step.
        virtual: stages per rank under interleaved.

    Raises:
        ValueError: another schedule (GPipe and 1F1B have one stage per rank; their orders follow from their
            rules), or an ``n_micro`` torch's schedule refuses (its message).

    Example:
        >>> torch_orders("zbv", 2, 2)[1][:4]
        ['F0/s1', 'F0/s2', 'F1/s1', 'F1/s2']
        >>> torch_orders("interleaved", 2, 2)[0][:3]
        ['F0/s0', 'F1/s0', 'F0/s2']
    """
    import types

    from torch.distributed import pipelining

    classes = {"interleaved": pipelining.ScheduleInterleaved1F1B, "zbv": pipelining.ScheduleZBVZeroBubble}
    if schedule not in classes:
        raise ValueError(f"schedule={schedule!r}: torch_orders reads the orders of 'interleaved' and 'zbv'; "
                         f"GPipe's and 1F1B's have one stage per rank and follow from their rules")
    per_rank = stages_per_rank(schedule, virtual)
    n_stages = per_rank * n_ranks
    ids = [0, n_stages - 1] if schedule == "zbv" else [k * n_ranks for k in range(per_rank)]
    stand_ins = [types.SimpleNamespace(stage_index=k, num_stages=n_stages, group_size=n_ranks, group_rank=0,
                                       is_first=k == 0, is_last=k == n_stages - 1, submod=None) for k in ids]
    built = classes[schedule](stand_ins, n_micro)
    return {r: [f"{a.computation_type.value}{a.microbatch_index}/s{a.stage_index}" for a in acts if a is not None]
            for r, acts in built.pipeline_order.items()}

"""Pipeline schedules run for real and measured, set against a model of them (lesson 12's notebook and bench).

:func:`measure` launches one rank per pipeline rank and runs each schedule of
``torch.distributed.pipelining`` on :class:`~mgpu_lab.parallel.pp_work.Work` layers
(fixed sleeps: simulated work, really scheduled), timing every action in the
ranks (:mod:`.pp_record`); it returns per schedule the per-rank
:class:`~mgpu_lab.parallel.timeline.Timeline`, the measured bubble (waits count as
idle), the peak number of micro-batches alive per rank, and the *fitted model*:
the schedule's own order replayed with the mean measured time of each action
kind on each stage. :func:`ideal` draws a schedule replayed with set times.

Example:
    >>> runs = measure(["1f1b"], n_ranks=2, n_micro=4, t_f=0.004, t_b=0.004)
    launch: 2 ranks · ...
    >>> runs["1f1b"]["in_flight"]
    {'rank 0': 2, 'rank 1': 1}
"""
from __future__ import annotations

import torch
from torch import nn

from mgpu_lab.parallel.pp_record import compute_bubble, in_flight, parse
from mgpu_lab.parallel.timeline import Timeline

__all__ = ["measure", "ideal", "fitted_bubble", "stages_per_rank", "mlp", "pp_dp"]


def stages_per_rank(schedule: str, virtual: int = 2) -> int:
    """1 for GPipe and 1F1B, ``virtual`` for interleaved, 2 for ZBV."""
    return {"interleaved": virtual, "zbv": 2}.get(schedule, 1)


def measure(schedules, n_ranks: int = 2, n_micro: int = 4, t_f: float = 0.02, t_b: float = 0.02,
            t_w: float = 0.0, virtual: int = 2, width: int = 8, timeout: float = 120) -> dict:
    """Run every schedule on ``n_ranks`` ranks (one launch) and measure it.

    Each stage is one :class:`~mgpu_lab.parallel.pp_work.Work` layer sleeping ``t_f``/``t_b``/``t_w``
    (seconds; schedules that do not split backward spend ``t_b + t_w`` in one backward); with ``virtual``
    stages per rank under interleaved (2 under ZBV) each stage is one layer, so a rank does ``virtual``
    times the work per micro-batch: compare the bubbles, not the step times.

    Returns:
        ``{schedule: {"timeline", "bubble", "model", "in_flight", "step_time", "losses"}}``.
    """
    from mgpu_lab import launch

    configs = []
    for s in schedules:
        n_stages = n_ranks * stages_per_rank(s, virtual)
        configs.append((s, n_stages, n_stages, n_micro, t_f, t_b, t_w))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(2 * n_micro, width, generator=g), torch.randn(2 * n_micro, width, generator=g)
    from mgpu_lab.parallel.pp_train import schedules_rank  # here: lesson 12's notebook must not reach it

    ranks = launch(schedules_rank, n_ranks, configs, x, y, timeout=timeout)
    out = {}
    for k, s in enumerate(schedules):
        spans = [span for r in ranks for span in r[k]["spans"]]
        tl = Timeline(spans)
        for r in range(n_ranks):
            tl.add_lane(f"rank {r}")
        out[s] = {"timeline": tl.shifted(), "bubble": compute_bubble(spans), "model": fitted_bubble(s, spans, n_ranks,
                  n_micro, virtual), "in_flight": in_flight(spans), "step_time": tl.makespan,
                  "losses": ranks[-1][k]["losses"] or ranks[0][k]["losses"]}
    return out


def fitted_bubble(schedule: str, spans, n_ranks: int, n_micro: int, virtual: int = 2) -> float:
    """The model fitted to a measured step: the schedule's order replayed with the mean measured duration of
    each action kind on each stage, plus the host's overhead between two actions of a rank (the median gap
    between consecutive actions: most gaps are that overhead, the few long ones are the bubble) and a
    transfer time per message (the median time from the end of an action on one rank to the start of the
    action waiting for it on another, where that rank had nothing else to do)."""
    from mgpu_lab.parallel import pp_orders  # here: the notebook imports this module, its learners write bubble()

    times: dict = {}
    ends: dict = {}
    for lane, label, start, end in sorted(spans, key=lambda s: s[2]):
        action = parse(label)
        if action:
            times.setdefault((action[0], action[2]), []).append(end - start)
            ends.setdefault(lane, []).append((start, end))
    gaps = sorted(b[0] - a[1] for acts in ends.values() for a, b in zip(acts, acts[1:]))
    overhead = _median(gaps)
    durations = {key: sum(v) / len(v) + overhead for key, v in times.items()}
    order = pp_orders.orders(schedule, n_ranks, n_micro, virtual)
    transfer = _transfer(spans, pp_orders)
    return compute_bubble(pp_orders.simulate(order, durations, max(transfer - overhead, 0.0)).spans)


def _median(values) -> float:
    values = sorted(values)
    return values[len(values) // 2] if values else 0.0


def _transfer(spans, pp_orders) -> float:
    """The median wait of an action for a message from another rank, where its own rank was free before."""
    acts = {parse(label): (lane, start, end) for lane, label, start, end in spans if parse(label)}
    last = max((a[2] for a in acts), default=0)
    prev = {}
    for lane, _, start, end in sorted((v[0], k, v[1], v[2]) for k, v in acts.items()):
        prev.setdefault(lane, []).append((start, end))
    waits = []
    for (kind, mb, stage), (lane, start, _) in acts.items():
        own = max((e for s, e in prev[lane] if e <= start), default=None)
        for need in pp_orders.needs(kind, mb, stage, last, acts):
            if need in acts and acts[need][0] != lane and (own is None or acts[need][2] > own):
                waits.append(start - acts[need][2])
    return _median(waits)


def ideal(schedule: str, n_ranks: int, n_micro: int, t_f: float = 1.0, t_b: float = 1.0, t_w: float = 0.0,
          virtual: int = 2) -> Timeline:
    """The schedule's order replayed with set times per action (backward ``t_b + t_w`` unless split)."""
    from mgpu_lab.parallel import pp_orders

    split = schedule == "zbv"
    times = {"F": t_f, "B": t_b + t_w, "I": t_b if split else t_b + t_w, "W": t_w}
    return pp_orders.simulate(pp_orders.orders(schedule, n_ranks, n_micro, virtual), times)


def mlp(n_layers: int, width: int, seed: int = 0) -> nn.Sequential:
    """``n_layers`` blocks of ``Linear(width, width)`` + tanh in a ``nn.Sequential``, seeded."""
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(n_layers)])


def pp_dp(schedule: str = "1f1b", pp: int = 2, dp: int = 2, n_micro: int = 2, steps: int = 3, width: int = 8,
          lr: float = 0.05, timeout: float = 120) -> dict:
    """PP x DP: ``dp`` pipelines of ``pp`` ranks on a ``(dp, pp)`` mesh, trained on ``pp * dp`` ranks, and
    the same training in one process.

    Returns:
        ``{"diff": the largest weight difference, "n_params", "ranks": pp * dp}``.
    """
    from functools import partial

    from mgpu_lab import launch
    from mgpu_lab.parallel.pp_train import one_process, pipeline_train  # here: the notebook must not reach them

    n_layers = pp * stages_per_rank(schedule)
    model_fn = partial(mlp, n_layers, width)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4 * dp * n_micro, width, generator=g), torch.randn(4 * dp * n_micro, width, generator=g))
               for _ in range(steps)]
    state = launch(pipeline_train, pp * dp, model_fn, pp, schedule, n_micro, batches, lr, dp=dp, timeout=timeout)[0]
    ref = one_process(model_fn, batches, lr)
    return {"diff": max(float((state[k] - ref[k]).abs().max()) for k in ref), "ranks": pp * dp,
            "n_params": sum(v.numel() for v in ref.values())}

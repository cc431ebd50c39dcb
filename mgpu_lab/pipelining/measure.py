"""Pipeline schedules run for real and measured, set against a model of them (lesson 12's notebook and bench).

:func:`measure` launches one rank per pipeline rank and runs each schedule of
``torch.distributed.pipelining`` on :class:`~mgpu_lab.pipelining.work.Work` layers
(fixed sleeps: simulated work, really scheduled), timing every action in the
ranks (:mod:`.record`); it returns per schedule the per-rank
:class:`~mgpu_lab.parallel.timeline.Timeline`, the measured bubble (waits count as
idle), the peak number of micro-batches alive per rank, and the *fitted model*:
the schedule's own order replayed with the mean measured time of each action
kind on each stage, the mean host time after it and the mean transfer time of a
message, idle counted as the measurement counts it (:func:`fitted_bubble`).
:func:`ideal` draws a schedule replayed with set times; :func:`torch_orders` reads torch's
interleaved and ZBV orders from a built schedule's public ``pipeline_order``.

Example:
    >>> runs = measure(["1f1b"], n_ranks=2, n_micro=4, t_f=0.004, t_b=0.004)
    launch: 2 ranks · ...
    >>> runs["1f1b"]["in_flight"]
    {'rank 0': 2, 'rank 1': 1}
"""
from __future__ import annotations

import torch
from torch import nn

from mgpu_lab.parallel.timeline import Timeline
from mgpu_lab.pipelining.record import compute_bubble, in_flight, parse
from mgpu_lab.pipelining.torch_orders import stages_per_rank, torch_orders  # the notebook reads them here

__all__ = ["measure", "ideal", "fitted_bubble", "stages_per_rank", "torch_orders", "mlp", "pp_dp"]


def measure(schedules, n_ranks: int = 2, n_micro: int = 4, t_f: float = 0.02, t_b: float = 0.02,
            t_w: float = 0.0, virtual: int = 2, width: int = 8, timeout: float = 120, repeats: int = 1) -> dict:
    """Run every schedule on ``n_ranks`` ranks (one launch) and measure it.

    Each stage is one :class:`~mgpu_lab.pipelining.work.Work` layer sleeping ``t_f``/``t_b``/``t_w``
    (seconds; schedules that do not split backward spend ``t_b + t_w`` in one backward); with ``virtual``
    stages per rank under interleaved (2 under ZBV) each stage is one layer, so a rank does ``virtual``
    times the work per micro-batch: compare the bubbles, not the step times. Each schedule runs a first
    step (which also exchanges the stages' shapes) and then ``repeats`` timed steps; a busy machine wakes
    sleeping ranks late now and then, so the numbers are the medians over the timed steps.

    Returns:
        ``{schedule: {"timeline", "bubble", "model", "in_flight", "step_time", "losses", "bubbles"}}``: the
        medians of the bubble, the fitted model and the step time; ``"bubbles"``, every timed step's bubble;
        the timeline and in-flight counts of the step whose bubble is the median.
    """
    import statistics

    from mgpu_lab import launch

    configs = []
    for s in schedules:
        n_stages = n_ranks * stages_per_rank(s, virtual)
        configs.append((s, n_stages, n_stages, n_micro, t_f, t_b, t_w))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(2 * n_micro, width, generator=g), torch.randn(2 * n_micro, width, generator=g)
    from mgpu_lab.pipelining.train import schedules_rank  # here: lesson 12's notebook must not reach it

    ranks = launch(schedules_rank, n_ranks, configs, x, y, 1 + repeats, timeout=timeout)
    out = {}
    for k, s in enumerate(schedules):
        steps = []
        for step in range(repeats):
            spans = [span for r in ranks for span in r[k]["timed"][step]]
            tl = Timeline(spans)
            for r in range(n_ranks):
                tl.add_lane(f"rank {r}")
            steps.append((compute_bubble(spans), fitted_bubble(s, spans, n_ranks, n_micro, virtual), tl, spans))
        middle = sorted(steps, key=lambda step: step[0])[(repeats - 1) // 2]
        out[s] = {"timeline": middle[2].shifted(), "bubble": middle[0], "in_flight": in_flight(middle[3]),
                  "model": statistics.median(step[1] for step in steps), "bubbles": [step[0] for step in steps],
                  "step_time": statistics.median(step[2].makespan for step in steps),
                  "losses": ranks[-1][k]["losses"] or ranks[0][k]["losses"]}
    return out


def fitted_bubble(schedule: str, spans, n_ranks: int, n_micro: int, virtual: int = 2) -> float:
    """The model fitted to a measured step, idle counted as the measurement counts it.

    The schedule's order is replayed (:func:`~mgpu_lab.parallel.orders.simulate`) with, for each action
    kind on each stage, the mean measured duration of the action and the mean *host time* after it (the time
    to the rank's next action outside any wait for a message: sending, the loss on the last stage, a late
    wake-up on a busy machine), and with the mean measured transfer time of a message. Host time is idle in
    the replay as in the measurement (:func:`~mgpu_lab.pipelining.record.compute_bubble` counts only the
    actions as busy). Means, not medians: the bubble is a sum, and a rank woken late now and then adds to it.

    Example:
        >>> from mgpu_lab.pipelining import orders
        >>> step = orders.simulate(orders.orders("1f1b", 2, 4), {"F": 1.1, "B": 2.3}, transfer=0.2)
        >>> measured = _measured(step.spans, {"F": 0.1, "B": 0.3})  # actions of 1 and 2 s, host 0.1 and 0.3 s
        >>> round(fitted_bubble("1f1b", measured, 2, 4), 6) == round(compute_bubble(measured), 6)
        True
    """
    from mgpu_lab.pipelining import orders  # here: the notebook imports this module, its learners write bubble()

    work, host = _action_times(spans)
    transfer = _transfer(spans, host, orders)
    durations = {key: work[key] + host[key] for key in work}
    replay = orders.simulate(orders.orders(schedule, n_ranks, n_micro, virtual), durations, transfer)
    busy = [(lane, label, start, end - host.get(_key(label), 0.0)) for lane, label, start, end in replay.spans]
    return compute_bubble(busy)


def _key(label: str) -> tuple[str, int]:
    kind, _, stage = parse(label)
    return kind, stage


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


def _by_lane(spans) -> dict:
    lanes: dict = {}
    for lane, label, start, end in sorted(spans, key=lambda s: s[2]):
        lanes.setdefault(lane, []).append((label, start, end))
    return lanes


def _action_times(spans) -> tuple[dict, dict]:
    """Per ``(kind, stage)``: the mean duration of the action and the mean host time after it (to the rank's
    next action, less the waits for messages in between; a rank's last action has none)."""
    work: dict = {}
    host: dict = {}
    for lane_spans in _by_lane(spans).values():
        acts = [s for s in lane_spans if parse(s[0])]
        for (label, start, end), after in zip(acts, acts[1:] + [None]):
            work.setdefault(_key(label), []).append(end - start)
            if after is not None:
                waits = sum(e - s for name, s, e in lane_spans if name == "wait" and s >= end and e <= after[1])
                host.setdefault(_key(label), []).append(after[1] - end - waits)
    every = _mean(h for hs in host.values() for h in hs)
    return ({key: _mean(v) for key, v in work.items()},
            {key: _mean(host[key]) if key in host else every for key in work})


def _transfer(spans, host: dict, orders) -> float:
    """The mean time a message takes: from the end of an action plus its host time (when its rank sends) to the
    start of the action on another rank that needs it, where that rank was ready before the message left."""
    acts = {parse(label): (lane, start, end) for lane, label, start, end in spans if parse(label)}
    last = max((a[2] for a in acts), default=0)
    ready: dict = {}
    first = min((a[1] for a in acts.values()), default=0.0)
    for lane_spans in _by_lane([s for s in spans if parse(s[1])]).values():
        for (label, start, _), (prev, _, prev_end) in zip(lane_spans, [(None, first, first)] + lane_spans):
            ready[parse(label)] = prev_end + (host[_key(prev)] if prev else 0.0)
    times = []
    for action, (lane, start, _) in acts.items():
        for need in orders.needs(*action, last, acts):
            if need in acts and acts[need][0] != lane:
                sent = acts[need][2] + host[need[0], need[2]]
                if ready[action] <= sent:
                    times.append(start - sent)
    return max(_mean(times), 0.0)


def _measured(replay_spans, host: dict) -> list:
    """Spans as the ranks record them from a replay whose actions include their host time ``{kind: s}``:
    each action without it, and a ``wait`` from the end of the host time to the rank's next action."""
    out = []
    for lane, lane_spans in _by_lane(replay_spans).items():
        for (label, start, end), after in zip(lane_spans, lane_spans[1:] + [None]):
            out.append((lane, label, start, end - host[label[0]]))
            if after is not None and after[1] > end:
                out.append((lane, "wait", end, after[1]))
    return out


def ideal(schedule: str, n_ranks: int, n_micro: int, t_f: float = 1.0, t_b: float = 1.0, t_w: float = 0.0,
          virtual: int = 2) -> Timeline:
    """The schedule's order replayed with set times per action (backward ``t_b + t_w`` unless split)."""
    from mgpu_lab.pipelining import orders

    split = schedule == "zbv"
    times = {"F": t_f, "B": t_b + t_w, "I": t_b if split else t_b + t_w, "W": t_w}
    return orders.simulate(orders.orders(schedule, n_ranks, n_micro, virtual), times)


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
    from mgpu_lab.pipelining import train  # here: the notebook must not reach it

    n_layers = pp * stages_per_rank(schedule)
    model_fn = partial(mlp, n_layers, width)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4 * dp * n_micro, width, generator=g), torch.randn(4 * dp * n_micro, width, generator=g))
               for _ in range(steps)]
    state = launch(train.train, pp * dp, model_fn, pp, schedule, n_micro, batches, lr, dp=dp, timeout=timeout)[0]
    ref = train.one_process(model_fn, batches, lr)
    return {"diff": max(float((state[k] - ref[k]).abs().max()) for k in ref), "ranks": pp * dp,
            "n_params": sum(v.numel() for v in ref.values())}

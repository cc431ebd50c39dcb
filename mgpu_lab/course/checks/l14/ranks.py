"""What lesson 14's check runs inside the ranks: every scenario of ring attention, recorded.

One launch per world size runs every scenario of :data:`SCENARIOS` in turn. Each call of
the learner's function is watched three ways at once: :mod:`mgpu_lab.comm.record` records
every send, receive and collective (a ring whose every rank blocks in a send raises its
Deadlock within a second); :func:`mgpu_lab.long_context.flops.counting_flops` counts the
attention's FLOPs; and :class:`mgpu_lab.long_context.measure.HeldRows` notes the most positions
any tensor of the call held in rows as wide as a head (a rank that holds the whole sequence's K or V has one with
``S`` rows). The inputs are shards of :func:`mgpu_lab.long_context.measure.inputs`, which
the judges recompute in full.

Example:
    >>> SCENARIOS[0]["layout"], SCENARIOS[0]["causal"]
    ('contiguous', True)
"""
from __future__ import annotations

# Each scenario: layout, causal, dtype, (batch, heads, rows per rank, head dim), q's scale, and whether torch's
# default device is meta during the call (a tensor made without device= is then not on the input's device, as a
# CPU tensor on a GPU rank would not be). Head dims differ from every row count, so rows tell K/V apart.
SCENARIOS = (
    {"layout": "contiguous", "causal": True, "dtype": "float32", "shape": (2, 2, 4, 5)},
    {"layout": "contiguous", "causal": False, "dtype": "float64", "shape": (1, 3, 6, 5)},
    {"layout": "zigzag", "causal": True, "dtype": "float32", "shape": (2, 2, 6, 5)},
    {"layout": "zigzag", "causal": False, "dtype": "float32", "shape": (1, 2, 4, 7)},
    {"layout": "zigzag", "causal": True, "dtype": "float64", "shape": (1, 3, 8, 3)},
    {"layout": "contiguous", "causal": True, "dtype": "float64", "shape": (2, 1, 6, 7)},
    {"layout": "contiguous", "causal": True, "dtype": "float32", "shape": (1, 2, 4, 5), "scale": 40.0},
    {"layout": "zigzag", "causal": True, "dtype": "float64", "shape": (1, 2, 4, 5), "scale": 400.0},
    {"layout": "zigzag", "causal": True, "dtype": "float32", "shape": (1, 2, 4, 5), "meta": True},
)
LARGE = (6, 7)  # the scenarios whose logits overflow a naive softmax: float32 past e^88, float64 past e^709
META = 8


def full_inputs(k: int, world: int) -> tuple:
    """The whole sequence's q, k, v of scenario ``k`` on ``world`` ranks."""
    import torch

    from mgpu_lab.long_context.measure import inputs

    s = SCENARIOS[k]
    batch, heads, rows, dim = s["shape"]
    return inputs(batch, heads, rows * world, dim, getattr(torch, s["dtype"]), seed=k, scale=s.get("scale", 1.0))


def _one(ring_attention, k: int) -> dict:
    """One scenario in this rank: the learner's rows, what it communicated, its FLOPs and longest K/V tensor.

    An error of the call (a Deadlock from the recorder, a device mix-up, the answer's own) is raised on, and
    saved as the scenario's outcome by :func:`..sim.scenarios.run_scenarios`.
    """
    import torch
    import torch.distributed as tdist

    from mgpu_lab.comm.record import record
    from mgpu_lab.long_context.flops import counting_flops
    from mgpu_lab.long_context.layout import shard
    from mgpu_lab.long_context.measure import HeldRows

    s, rank, world = SCENARIOS[k], tdist.get_rank(), tdist.get_world_size()
    q, kk, v = (shard(t, rank, world, s["layout"]) for t in full_inputs(k, world))
    held, counter = HeldRows(s["shape"][3]), counting_flops()
    with record(ring_attention, expect_device=q.device if s.get("meta") else None) as log:
        if s.get("meta"):
            torch.set_default_device("meta")
        try:
            with counter, held:
                got = ring_attention(q, kk, v, s["causal"], s["layout"])
        finally:
            torch.set_default_device(None)
    out = (got.detach().to("cpu") if isinstance(got, torch.Tensor) and got.device.type != "meta"
           else f"{type(got).__name__} on {getattr(got, 'device', '-')}")
    return {"out": out, "error": None, "stuck": False, "flops": int(counter.get_total_flops()), "rows": int(held.rows),
            "events": [[e["op"], e["bytes"], e["peer"], e["call"]] for e in log.events if e["op"] != "wait"]}


def ring_probe(ring_attention, scenarios, log_dir) -> list:
    """Probe: every scenario of :data:`SCENARIOS` in ``scenarios``, in order, through
    :func:`..sim.scenarios.run_scenarios` (each rank's evidence saved to ``log_dir`` as it goes; the first
    error ends the launch, and the checker reads what was saved)."""
    import functools

    from ..sim.scenarios import run_scenarios

    return run_scenarios(log_dir, functools.partial(_one, ring_attention), scenarios)


def entries(per_rank: list) -> list:
    """What :func:`ring_probe` saved, per rank, as entries: a raised outcome becomes ``{"error": ..., "stuck": ...}``."""
    out = []
    for outcomes in per_rank:
        mine = []
        for o in outcomes:
            if o[0] == "ok":
                mine.append(o[1])
            else:
                text = f"{o[1]}: " + (str(o[2]).strip().splitlines() or [""])[0][:300]
                mine.append({"out": None, "error": text, "events": [], "flops": 0, "rows": 0,
                             "stuck": o[1] == "Deadlock" or "imed out" in str(o[2])})
        out.append(mine)
    return out

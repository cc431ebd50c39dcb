"""What lesson 14's check runs inside the ranks: every scenario of ring attention, and of the MoE layer, recorded.

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


def _entries(per_rank: list, blank: dict, stuck: str) -> list:
    """Per rank, the saved outcomes as entries: a raised one becomes ``blank`` with its ``error`` and whether the
    rank was ``stuck`` (the recorder's ``stuck`` exception, or a timeout)."""
    out = []
    for outcomes in per_rank:
        mine = []
        for o in outcomes:
            if o[0] == "ok":
                mine.append(o[1])
            else:
                text = f"{o[1]}: " + (str(o[2]).strip().splitlines() or [""])[0][:300]
                mine.append({**blank, "error": text, "stuck": o[1] == stuck or "imed out" in str(o[2])})
        out.append(mine)
    return out


def entries(per_rank: list) -> list:
    """What :func:`ring_probe` saved, per rank, as entries: a raised outcome becomes ``{"error": ..., "stuck": ...}``."""
    return _entries(per_rank, {"out": None, "events": [], "flops": 0, "rows": 0}, "Deadlock")


# -- 14.moe_layer ----------------------------------------------------------------------------------------------
# Each scenario: the router ("uniform": small random logits; "skewed": most tokens want the first experts;
# "elsewhere": no token of any rank goes to rank 0's experts, so rank 0 sends all its tokens away and receives
# none), tokens per rank, experts E (a multiple of 4, so that 2 and 4 ranks both hold E/W), top_k, capacity per
# (expert, source rank), dtype. Model width D, experts D -> HIDDEN -> D.
MOE_SCENARIOS = (
    {"router": "uniform", "tokens": 6, "experts": 4, "top_k": 1, "capacity": 6, "dtype": "float64"},
    {"router": "uniform", "tokens": 5, "experts": 8, "top_k": 2, "capacity": 5, "dtype": "float32"},
    {"router": "skewed", "tokens": 6, "experts": 4, "top_k": 2, "capacity": 2, "dtype": "float64"},
    {"router": "skewed", "tokens": 7, "experts": 8, "top_k": 1, "capacity": 1, "dtype": "float64"},
    {"router": "uniform", "tokens": 8, "experts": 4, "top_k": 2, "capacity": 3, "dtype": "float64"},
    {"router": "elsewhere", "tokens": 5, "experts": 4, "top_k": 1, "capacity": 5, "dtype": "float64"},
)
D, HIDDEN = 8, 6


def moe_inputs(k: int, world: int) -> dict:
    """Scenario ``k`` on ``world`` ranks, whole: every rank's tokens ``xs`` and output gradient ``grads``, the
    router's weight (E, D) and every expert (a small MLP, global ids 0 .. E-1), all made from seeds."""
    import torch

    s = MOE_SCENARIOS[k]
    dtype, n_experts = getattr(torch, s["dtype"]), s["experts"]
    gen = torch.Generator().manual_seed(1000 + 17 * k + world)
    xs = [torch.randn(s["tokens"], D, generator=gen, dtype=dtype) for _ in range(world)]
    grads = [torch.randn(s["tokens"], D, generator=gen, dtype=dtype) for _ in range(world)]
    router = torch.randn(n_experts, D, generator=gen, dtype=dtype) * 0.5
    if s["router"] != "uniform":
        for x in xs:
            x[:, 0] = x[:, 0].abs() + 1.0  # feature 0 is positive on every token: the router's column 0 decides
        router[:, 0] = torch.linspace(2.0, -2.0, n_experts, dtype=dtype)
        if s["router"] == "elsewhere":
            router[:, 0] = torch.linspace(-6.0, 1.0, n_experts, dtype=dtype)  # rank 0's experts lowest
            router[: n_experts // world, 0] = -40.0
    experts = []
    for e in range(n_experts):
        torch.manual_seed(5000 + 31 * k + e)
        experts.append(torch.nn.Sequential(torch.nn.Linear(D, HIDDEN), torch.nn.Tanh(),
                                           torch.nn.Linear(HIDDEN, D)).to(dtype))
    return {"xs": xs, "grads": grads, "router": router, "experts": experts}


STUCK_AFTER = 6.0  # seconds one MoE call may take (a few hundredths here) before its rank reports itself stuck


def _watchdog(log_dir, k: int):
    """A started timer that, should this rank's call of scenario ``k`` not return within :data:`STUCK_AFTER`
    seconds (a collective that another rank never joins waits for ever), saves the scenario as stuck next to
    what :func:`..sim.scenarios.run_scenarios` saved and ends the rank, so the check says so within seconds."""
    import os
    import threading

    import torch
    import torch.distributed as tdist

    def fire():
        path = os.path.join(log_dir, f"rank{tdist.get_rank()}.pt")
        done = torch.load(path, weights_only=False) if os.path.exists(path) else []
        torch.save(done + [("raised", "Stuck", f"still inside moe_layer after {STUCK_AFTER:g} s: waiting in a "
                                               "collective that another rank never joined")], path)
        os._exit(3)

    timer = threading.Timer(STUCK_AFTER, fire)
    timer.daemon = True
    timer.start()
    return timer


class SplitMismatch(RuntimeError):
    """An all-to-all in which what a rank expects to receive from another is not what that rank sends it."""


class SkippedExchange(RuntimeError):
    """Ranks that meet in an all-to-all while at different ones of the call (one rank skipped one)."""


def _checked_all_to_all(real):
    """``torch.distributed.all_to_all_single`` that first compares, on every rank, what each rank sends to each
    other rank with what that rank expects to receive (an all-gather of the splits, which the recorder does
    not count: it runs inside the recorded call), and raises :class:`SplitMismatch` on every rank when they
    differ (gloo itself would drop a rank's connection or wait for ever), or :class:`SkippedExchange` when the
    ranks meet at different all-to-alls of the call (``checked.phase``: 0 forward, 1 backward)."""
    import torch
    import torch.distributed as tdist

    def checked(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        world = tdist.get_world_size(group)
        rank = tdist.get_rank(group)

        def splits(t, given):
            return [int(n) for n in given] if given is not None and len(given) else [t.shape[0] // world] * world

        checked.calls += 1
        where = [checked.phase, checked.calls] + [0] * (world - 2)
        mine = torch.tensor([splits(input, input_split_sizes), splits(output, output_split_sizes), where])
        every = [torch.empty_like(mine) for _ in range(world)]
        tdist.all_gather(every, mine, group=group)
        at = [tuple(e[2, :2].tolist()) for e in every]
        if len(set(at)) > 1:
            raise SkippedExchange("the ranks are at different all-to-alls (rank: (0 forward / 1 backward, which "
                                  f"all-to-all of it)): {dict(enumerate(at))}")
        sends = [e[0].tolist() for e in every]
        bad = [(s, r) for s in range(world) for r in range(world) if sends[s][r] != every[r][1][s]]
        if bad:
            s, r = bad[0]
            raise SplitMismatch(f"rank {r} sized its receive for {int(every[r][1][s])} rows from rank {s}, which "
                                f"sends it {sends[s][r]} (rank {rank}'s view; every rank's sends: {sends})")
        return real(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

    checked.phase, checked.calls = 0, 0
    return checked


def _moe_one(moe_layer, log_dir, k: int) -> dict:
    """One MoE scenario in this rank: the learner's output, the gradients of its tokens, the router's weight
    and its experts, and what it communicated forward and backward (each recorded apart)."""
    import torch
    import torch.distributed as tdist

    from mgpu_lab.comm.record import record

    s, rank, world = MOE_SCENARIOS[k], tdist.get_rank(), tdist.get_world_size()
    made = moe_inputs(k, world)
    per = s["experts"] // world
    x = made["xs"][rank].clone().requires_grad_(True)
    router = made["router"].clone().requires_grad_(True)
    experts = torch.nn.ModuleList(made["experts"][rank * per:(rank + 1) * per])
    timer, real = _watchdog(log_dir, k), tdist.all_to_all_single
    tdist.all_to_all_single = _checked_all_to_all(real)
    try:
        with record(moe_layer) as forward:
            out = moe_layer(x, router, experts, s["top_k"], s["capacity"])
        if not isinstance(out, torch.Tensor):
            return {"out": f"{type(out).__name__}", "error": None, "forward": [], "backward": [], "grads": None}
        tdist.all_to_all_single.phase, tdist.all_to_all_single.calls = 1, 0
        with record(moe_layer) as backward:
            if out.requires_grad:
                (out * made["grads"][rank]).sum().backward()
    finally:
        timer.cancel()
        tdist.all_to_all_single = real
    grads = {"x": x.grad, "router": router.grad,
             "experts": [[p.grad for p in e.parameters()] for e in experts]}
    keep = lambda log: [[e["op"], e["bytes"], e["dtype"], e["call"]] for e in log.events if e["op"] != "wait"]
    return {"out": out.detach(), "error": None, "forward": keep(forward), "backward": keep(backward),
            "grads": grads}


def moe_probe(moe_layer, scenarios, log_dir) -> list:
    """Probe: every scenario of :data:`MOE_SCENARIOS` in ``scenarios``, in order, through
    :func:`..sim.scenarios.run_scenarios` (as :func:`ring_probe`)."""
    import functools

    from ..sim.scenarios import run_scenarios

    return run_scenarios(log_dir, functools.partial(_moe_one, moe_layer, log_dir), scenarios)


def moe_entries(per_rank: list) -> list:
    """What :func:`moe_probe` saved, per rank, as entries: a raised outcome becomes ``{"error": ..., "stuck": ...}``."""
    return _entries(per_rank, {"out": None, "forward": [], "backward": [], "grads": None}, "Stuck")

"""What expert parallelism costs, measured: load per expert while a router trains, and the all-to-alls' bytes.

:func:`train_router` trains a small top-k mixture of experts on one process (every expert
computes its own tokens; nothing is exchanged) from a router that starts skewed, with and
without the load-balancing loss, and reports the tokens per expert as it goes.
:func:`exchange_bytes` runs a given MoE layer on real ranks with the course's recorder
(:mod:`mgpu_lab.comm.record`) and reports what its all-to-alls moved, against top-k and tokens.

Example:
    >>> loads = train_router(aux_weight=0.0, steps=2)
    >>> len(loads), len(loads[0]), sum(loads[0])   # steps + 1 snapshots of 8 experts, 256 tokens x top-2
    (3, 8, 512)
"""
from __future__ import annotations

import torch

from .router import load_balancing_loss, tokens_per_expert, top_k


def _skewed_task(d: int, n_experts: int, tokens: int, seed: int) -> tuple:
    """Tokens that share one direction, a router that starts by sending that direction to expert 0, a target."""
    gen = torch.Generator().manual_seed(seed)
    common = torch.randn(d, generator=gen)
    common = common / common.norm()
    x = torch.randn(tokens, d, generator=gen) * 0.5 + 1.5 * common
    router = torch.randn(n_experts, d, generator=gen) * 0.1
    router[0] += 3.0 * common
    target = torch.tanh(x @ torch.randn(d, d, generator=gen) / d ** 0.5)
    return x, router, target


def train_router(aux_weight: float, steps: int = 60, top_k_: int = 2, n_experts: int = 8, d: int = 16,
                 tokens: int = 256, lr: float = 0.05, seed: int = 0) -> list:
    """Tokens per expert (a list per snapshot: at the start and after each step) while a skewed router trains.

    The loss is the task's mean squared error plus ``aux_weight`` times :func:`.router.load_balancing_loss`.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tensors of a few thousand elements: a second thread only waits (40x slower loaded)
    try:
        return _train(aux_weight, steps, top_k_, n_experts, d, tokens, lr, seed)
    finally:
        torch.set_num_threads(threads)


def _train(aux_weight, steps, top_k_, n_experts, d, tokens, lr, seed) -> list:
    torch.manual_seed(seed)
    x, router_init, target = _skewed_task(d, n_experts, tokens, seed)
    router = torch.nn.Parameter(router_init.clone())
    experts = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(n_experts))
    opt = torch.optim.Adam([router, *experts.parameters()], lr=lr)
    loads = []
    for step in range(steps + 1):
        probs, chosen = top_k(x @ router.t(), top_k_)
        loads.append(tokens_per_expert(chosen, n_experts).tolist())
        if step == steps:
            break
        out = torch.zeros_like(x)
        for e, expert in enumerate(experts):
            rows = (chosen == e).any(dim=-1).nonzero().flatten()
            out = out.index_add(0, rows, probs[rows, e:e + 1] * expert(x[rows]))
        loss = torch.nn.functional.mse_loss(out, target) + aux_weight * load_balancing_loss(probs, chosen)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loads


def _exchanges(moe_layer, cases, n_experts: int, d: int) -> list:
    """In a rank: per ``(tokens, top_k)``, the bytes this rank's forward all-to-alls sent, tokens and the rest."""
    import torch.distributed as tdist

    from mgpu_lab.comm.record import record

    rank, world = tdist.get_rank(), tdist.get_world_size()
    out = []
    for tokens, k in cases:
        torch.manual_seed(100 + tokens + k)  # the same router and experts on every rank
        router = torch.randn(n_experts, d) * 0.1
        experts = [torch.nn.Linear(d, d) for _ in range(n_experts)]
        torch.manual_seed(1000 * (rank + 1) + tokens + k)  # each rank's own tokens
        x = torch.randn(tokens, d)
        per = n_experts // world
        with record(moe_layer) as log:
            moe_layer(x, router, torch.nn.ModuleList(experts[rank * per:(rank + 1) * per]), k, tokens)
        a2a = [e for e in log.events if e["op"] == "all_to_all"]
        out.append({"tokens": tokens, "top_k": k, "calls": len(a2a),
                    "token_bytes": sum(e["bytes"] for e in a2a if e["dtype"] == str(x.dtype)),
                    "other_bytes": sum(e["bytes"] for e in a2a if e["dtype"] != str(x.dtype))})
    return out


def exchange_bytes(moe_layer, world: int = 4, tokens=(16, 32, 64), top_ks=(1, 2, 4), n_experts: int = 8,
                   d: int = 16) -> list:
    """Run ``moe_layer`` on ``world`` ranks for every (tokens per rank, top_k), no token dropped; per case,
    the forward all-to-alls of a rank: calls, bytes of tokens (float32 rows of width ``d``, the mean over the
    ranks, out and back) and of the rest (rank 0's).

    Raises:
        ValueError: when ``n_experts`` is not a multiple of ``world``.
    """
    from mgpu_lab import launch

    if n_experts % world:
        raise ValueError(f"n_experts={n_experts} on world={world} ranks: each rank holds n_experts / world experts; "
                         f"pick n_experts as a multiple of {world}")
    cases = [(t, k) for k in top_ks for t in tokens]
    per_rank = launch(_exchanges, world, moe_layer, cases, n_experts, d)
    for i, row in enumerate(per_rank[0]):
        row["token_bytes"] = round(sum(r[i]["token_bytes"] for r in per_rank) / world)
    return per_rank[0]


def bytes_table(rows: list, d: int = 16) -> str:
    """:func:`exchange_bytes`'s rows as a table, beside ``2 x tokens x top_k x d x 4`` (out and back)."""
    lines = [f"{'tokens':>6} {'top_k':>5} {'all-to-alls':>11} {'token bytes':>11} {'2 T k d x 4':>11} "
             f"{'count bytes':>11}"]
    for r in rows:
        lines.append(f"{r['tokens']:>6} {r['top_k']:>5} {r['calls']:>11} {r['token_bytes']:>11} "
                     f"{2 * r['tokens'] * r['top_k'] * d * 4:>11} {r['other_bytes']:>11}")
    return "\n".join(lines)

"""How lesson 05's BalancedDistributedSampler check judges the lists the learner's sampler yields.

The cost distributions (:func:`case_costs`) are ones the notebook never shows;
a list of per-rank index lists is judged as a partition (equal lengths, every
index covered, only the padding repeated), per rank (max/mean of the ranks'
total costs) and per step (the same max/mean sample position by sample
position, :func:`mgpu_lab.data.workload.step_imbalance` with one sample per step).
"""
from __future__ import annotations

import math

import torch

from mgpu_lab.data.workload import distributed_sampler_lists, step_imbalance

BALANCE_TOL = 1.05  # max/mean of the ranks' total costs a balanced sampler must reach
STEP_TOL = 1.35  # per-step max/mean, one sample per step: the reference reaches <= 1.21, a rank's own shuffle >= 1.5
SAMPLER_HINT = ("sort the (shuffled) indices costliest first and give each to the rank with the smallest "
                "total cost so far that still has room; every rank computes this same plan")
STEP_HINT = ("position k must hold similar costs on every rank: keep each rank's samples costliest first and apply "
             "ONE permutation of positions, from the generator seeded with seed + epoch, to every rank's list "
             "(a seed with the rank in it shuffles each rank its own way)")
GLOBAL_HINT = ("the ranks' plans differ: the plan may depend only on costs, seed and epoch; draw every random "
               "number from torch.Generator().manual_seed(seed + epoch) (no rank in the seed), never from the "
               "global random state (torch.randperm(n) without generator=, random, numpy)")


def config(costs, world, drop_last=False, shuffle=True, seed=0, epochs=(0,)):
    return {"costs": list(costs), "num_replicas": world, "drop_last": drop_last, "shuffle": shuffle,
            "seed": seed, "epochs": tuple(epochs)}


def case_costs(kind: str, n: int, seed: int) -> list:
    """Heavy-tailed costs of a few shapes (the notebook shows none of these)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "lognormal":
        return (torch.randn(n, generator=g, dtype=torch.float64) * 1.2).exp().tolist()
    if kind == "pareto":  # capped, so that a balanced partition exists
        return torch.rand(n, generator=g, dtype=torch.float64).pow(-1 / 1.8).clamp(max=25).tolist()
    if kind == "lengths":  # integer token counts: many ties, some empty samples
        return (torch.randn(n, generator=g) + 3.5).exp().round().clamp(0, 2048).long().tolist()
    if kind == "bimodal":  # mostly short, 10% long
        long = torch.rand(n, generator=g) < 0.1
        return torch.where(long, 30 + 10 * torch.rand(n, generator=g), 1 + torch.rand(n, generator=g)).tolist()
    raise ValueError(f"unknown cost kind {kind!r}")


def partition_problem(lists, lengths, n, world, drop_last) -> str:
    """Why ``lists`` (one per rank) is not a valid epoch, or '' when it is."""
    per = n // world if drop_last else math.ceil(n / world)
    for r, (lst, length) in enumerate(zip(lists, lengths)):
        if length != per:
            return f"len() of rank {r}'s sampler is {length}, expected {per} (n={n}, num_replicas={world}, " \
                   f"drop_last={drop_last})"
        if len(lst) != per:
            return f"rank {r} yields {len(lst)} indices, expected {per}: every rank needs the same number"
        bad = [i for i in lst if not 0 <= i < n]
        if bad:
            return f"rank {r} yields index {bad[0]}, outside 0..{n - 1}"
    flat = [i for lst in lists for i in lst]
    owners: dict[int, list] = {}
    for r, lst in enumerate(lists):
        for i in lst:
            owners.setdefault(i, []).append(r)
    missing = sorted(set(range(n)) - set(owners))
    if drop_last:
        twice = sorted(i for i, rs in owners.items() if len(rs) > 1)
        if twice:
            return f"index {twice[0]} is yielded {len(owners[twice[0]])} times (ranks {owners[twice[0]]}); " \
                   "with drop_last=True every index appears at most once"
        return ""
    if missing:
        return f"{len(missing)} index(es) on no rank, e.g. {missing[:5]}: together the ranks must cover every index"
    extra = len(flat) - n
    if extra != per * world - n:
        return f"{extra} repeated indices; only the padding ({per * world - n}) may repeat"
    return ""


def rank_balance(lists, costs) -> float:
    totals = [sum(costs[i] for i in lst) for lst in lists]
    mean = sum(totals) / len(totals)
    return max(totals) / mean if mean > 0 else 1.0


def ds_lists(n, world) -> list:
    return distributed_sampler_lists(n, world).tolist()


def ds_balance(costs, world) -> float:
    return rank_balance(ds_lists(len(costs), world), costs)


def judge(t, got, cfg, check_balance=True, steps=False, epochs_differ=False, hint=""):
    """Fail the case unless every epoch of ``got`` is a valid, balanced partition (step by step too);
    with ``cfg["shuffle"]`` False every epoch must give the same lists, else ``epochs_differ`` asks for
    a new order in each epoch."""
    if got[0] == "raised":
        t.fail(hint, "a working sampler", f"your code raised {got[1]}: {got[2]}")
    res, n, world = got[1], len(cfg["costs"]), cfg["num_replicas"]
    if not all(res["is_sampler"]):
        t.fail("subclass torch.utils.data.Sampler", "a torch Sampler", "another type")
    for e, lists in res["epochs"]:
        problem = partition_problem(lists, res["len"], n, world, cfg["drop_last"])
        if problem:
            t.fail(GLOBAL_HINT if res.get("plans_differ") else hint,
                   "equal-length lists that together cover the indices once", f"epoch {e}: {problem}")
        if check_balance and rank_balance(lists, cfg["costs"]) > BALANCE_TOL:
            t.fail(f"max/mean of the ranks' total costs must be <= {BALANCE_TOL}; " + SAMPLER_HINT,
                   f"<= {BALANCE_TOL}", f"epoch {e}: {rank_balance(lists, cfg['costs']):.3f}")
        if steps and step_imbalance(lists, cfg["costs"], 1) > STEP_TOL:
            t.fail(f"per-step max/mean must be <= {STEP_TOL}; " + STEP_HINT, f"<= {STEP_TOL}",
                   f"epoch {e}: {step_imbalance(lists, cfg['costs'], 1):.3f}")
    by_epoch: dict = {}
    for e, lists in res["epochs"]:
        if by_epoch.setdefault(e, lists) != lists:
            t.fail("the plan must depend only on costs, seed and epoch: set_epoch(e) again must give the same "
                   "lists (seed a fresh torch.Generator with seed + epoch in __iter__)",
                   f"epoch {e} twice: the same lists", "different lists the second time")
    if not cfg["shuffle"] and any(v != res["epochs"][0][1] for v in by_epoch.values()):
        t.fail("with shuffle=False the plan must not depend on the epoch: no generator draws at all",
               "the same lists in every epoch", "different lists in another epoch")
    if epochs_differ and len(by_epoch) > 1 and all(v == res["epochs"][0][1] for v in by_epoch.values()):
        t.fail("shuffle with torch.Generator().manual_seed(seed + epoch) so each epoch gets a new order",
               "a different order in each epoch", "the same lists in every epoch")

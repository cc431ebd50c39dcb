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
from mgpu_lab.launcher.errors import LaunchError
from ..sim.outcome import in_words
from .ranks import join_batches, join_model


def _case(name, cfg, hint="", balance=False, steps=False, differ=False, hidden=False) -> dict:
    return {"name": name, "cfgs": cfg if isinstance(cfg, list) else [cfg], "hint": hint, "balance": balance,
            "steps": steps, "differ": differ, "hidden": hidden}


def sampler_cases() -> list[dict]:
    """05.BalancedDistributedSampler's cases in one process: name, configurations, hint, what to judge."""
    heavy = case_costs("lognormal", 400, 3)
    ds_step = step_imbalance(ds_lists(400, 4), heavy, 1)
    fresh = dict(balance=True, steps=True, differ=True, hidden=True)  # the hidden cases judge everything
    return [
        _case("a torch Sampler; len() is ceil(n / num_replicas): n=10, 3 ranks give 4 each", config([1.0] * 10, 3),
              "len() must be ceil(n / num_replicas) when drop_last=False (pad by repeating indices)"),
        _case("drop_last=False, n=103, 4 ranks: 26 each, together every index, repeats only the padding (1)",
              config(case_costs("lengths", 103, 1), 4),
              "pad the index list by repeating indices up to num_samples * num_replicas, then split it"),
        _case("drop_last=True, n=103, 4 ranks: 25 each, no index twice, only 103 % 4 = 3 left out",
              config(case_costs("lengths", 103, 2), 4, drop_last=True),
              "with drop_last, num_samples = n // num_replicas: drop the tail of the shuffled list, never repeat"),
        _case(f"balanced: max/mean per-rank cost <= {BALANCE_TOL} on heavy-tailed costs, n=400, 4 ranks "
              f"(DistributedSampler: {ds_balance(heavy, 4):.2f})", config(heavy, 4), SAMPLER_HINT, balance=True),
        _case(f"balanced step by step: the k-th samples of all ranks cost about the same, per-step max/mean <= "
              f"{STEP_TOL} with one sample per step (DistributedSampler: {ds_step:.2f}), epochs 0 and 1",
              config(heavy, 4, epochs=(0, 1)), STEP_HINT, balance=True, steps=True),
        _case("set_epoch: epoch 1 gives a new order, epoch 0 again the same lists; each a balanced partition",
              config(heavy, 4, epochs=(0, 1, 0)),
              "build the plan in __iter__ from a generator seeded with seed + epoch, not once in __init__",
              balance=True, differ=True),
        _case("shuffle=False: the same balanced lists in every epoch", config(heavy, 4, shuffle=False, epochs=(0, 5)),
              "with shuffle=False do not shuffle; the epoch must not change anything", balance=True),
        _case("fresh costs: log-normal, n=1001, 2 ranks, seed=7",
              config(case_costs("lognormal", 1001, 11), 2, seed=7, epochs=(0, 3)), **fresh),
        _case("fresh costs: capped Pareto, n=240, 3 ranks, drop_last=True",
              config(case_costs("pareto", 240, 5), 3, drop_last=True, epochs=(2, 4)), **fresh),
        _case("fresh costs: integer lengths with ties and zeros, n=515, 5 ranks, and bimodal, n=707, 7 ranks",
              [config(case_costs("lengths", 515, 8), 5, epochs=(0, 1)),
               config(case_costs("bimodal", 707, 9), 7, seed=3, epochs=(0, 1))], **fresh),
        _case("tiny data: n=5 on 8 ranks (drop_last False and True), n=1 on 1 rank, all costs zero",
              [config([0.0] * 5, 8, epochs=(0, 1)), config([0.0] * 5, 8, drop_last=True), config([0.0], 1)],
              **{**fresh, "differ": False}),
    ]


# -- train_with_join ------------------------------------------------------------------
def join_reference(counts: tuple, seed: int, initial: bool = True, reduction: str = "mean") -> list:
    """The weights Join gives: each step averages the gradients of the ranks that still have a
    batch, zeros from the others, divided by the world size (``initial=False``: by the ranks still
    training); every rank ends with the same model."""
    model = join_model(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [join_batches(seed, r, c) for r, c in enumerate(counts)]
    for k in range(max(counts)):
        total = [torch.zeros_like(p) for p in model.parameters()]
        for r in range(len(counts)):
            if k < counts[r]:
                model.zero_grad()
                x, y = batches[r][k]
                torch.nn.functional.mse_loss(model(x), y, reduction=reduction).backward()
                total = [s + p.grad for s, p in zip(total, model.parameters())]
        active = sum(1 for c in counts if k < c)
        for p, s in zip(model.parameters(), total):
            p.grad = s / (len(counts) if initial else active)
        optimizer.step()
    return [p.detach() for p in model.parameters()]


def same_tensors(a, b) -> bool:
    return all(torch.allclose(x, y, atol=1e-5) for x, y in zip(a, b))


def join_diagnosis(weights, counts, seed) -> str:
    if same_tensors(weights, join_reference(counts, seed, initial=False)):
        return ("your weights average each step over the ranks still training: keep Join's default "
                "divide_by_initial_world_size=True")
    if same_tensors(weights, join_reference(counts, seed, reduction="sum")):
        return "your weights match a summed loss: use F.mse_loss(model(x), y) (the mean)"
    return "per batch: optimizer.zero_grad(); F.mse_loss(model(x), y).backward(); optimizer.step()"


def scenario_evidence(t, evidence, k):
    try:
        return evidence.get(t, k)
    except LaunchError as exc:
        if exc.exc_type and "exhausted inputs" in str(exc):
            t.fail("Join(..., throw_on_early_termination=True) makes every rank raise as soon as one runs out "
                   "of batches: leave it False (the default) so that the others go on", "every rank finishes",
                   str(exc).splitlines()[0][:200])
        raise


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
        t.fail(hint, "a working sampler", in_words(got, raised="your code raised "))
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

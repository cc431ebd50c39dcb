"""Checks of lesson 05 (balanced samplers, uneven inputs): BalancedDistributedSampler, train_with_join.

- ``BalancedDistributedSampler`` is built for every rank in a fresh process,
  each rank after re-seeding the global random generators differently (as
  separate processes would be), so a plan drawn from the global generator
  instead of a ``seed + epoch`` one shows up as overlapping lists. It is judged
  on cost distributions the notebook never shows, and once in three real
  processes that each build only their own rank's sampler.
- ``train_with_join`` runs in real ranks with a DDP model and a different
  number of batches per rank, followed by a barrier (as before a checkpoint):
  without Join the rank that runs out waits in the barrier while the others
  wait in the gradient all-reduce, and the launch times out in bounded time.

What runs in those processes is :mod:`.probes05`; this module judges, in the kernel.
"""
from __future__ import annotations

import math

import torch

from ._core import exercise
from .probes05 import join_batches, join_model, probe_join, probe_sampler, probe_sampler_ranks

BALANCE_TOL = 1.05  # max/mean of the ranks' total costs a balanced sampler must reach
JOIN_TIMEOUT = 20.0  # seconds: a right answer takes about one
SAMPLER_HINT = ("sort the (shuffled) indices costliest first and give each to the rank with the smallest "
                "total cost so far that still has room; every rank computes this same plan")


# -- BalancedDistributedSampler -----------------------------------------------------
def _cfg(costs, world, drop_last=False, shuffle=True, seed=0, epochs=(0,)):
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


def _partition_problem(lists, lengths, n, world, drop_last) -> str:
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


def _balance(lists, costs) -> float:
    totals = [sum(costs[i] for i in lst) for lst in lists]
    mean = sum(totals) / len(totals)
    return max(totals) / mean if mean > 0 else 1.0


def _ds_balance(costs, world) -> float:
    from mgpu_lab.workload import distributed_sampler_lists

    return _balance(distributed_sampler_lists(len(costs), world).tolist(), costs)


def _judge(t, got, cfg, balance=True, epochs_differ=False, hint=""):
    """Fail the case unless every epoch of ``got`` is a valid, balanced partition."""
    if got[0] == "raised":
        t.fail(hint, "a working sampler", f"your code raised {got[1]}: {got[2]}")
    res, n, world = got[1], len(cfg["costs"]), cfg["num_replicas"]
    if not all(res["is_sampler"]):
        t.fail("subclass torch.utils.data.Sampler", "a torch Sampler", "another type")
    for e, lists in res["epochs"]:
        problem = _partition_problem(lists, res["len"], n, world, cfg["drop_last"])
        if problem:
            t.fail(hint, "equal-length lists that together cover the indices once", f"epoch {e}: {problem}")
        if balance and _balance(lists, cfg["costs"]) > BALANCE_TOL:
            t.fail(f"max/mean of the ranks' total costs must be <= {BALANCE_TOL}; " + SAMPLER_HINT,
                   f"<= {BALANCE_TOL}", f"epoch {e}: {_balance(lists, cfg['costs']):.3f}")
    by_epoch: dict = {}
    for e, lists in res["epochs"]:
        if by_epoch.setdefault(e, lists) != lists:
            t.fail("the plan must depend only on costs, seed and epoch: set_epoch(e) again must give the same "
                   "lists (seed a fresh torch.Generator with seed + epoch in __iter__)",
                   f"epoch {e} twice: the same lists", "different lists the second time")
    if epochs_differ and len(by_epoch) > 1 and all(v == res["epochs"][0][1] for v in by_epoch.values()):
        t.fail("shuffle with torch.Generator().manual_seed(seed + epoch) so each epoch gets a new order",
               "a different order in each epoch", "the same lists in every epoch")


@exercise("05.BalancedDistributedSampler", points=11, description="BalancedDistributedSampler(costs, "
          "num_replicas, rank, shuffle=True, seed=0, drop_last=False): equal-length, disjoint, covering, "
          "cost-balanced per-rank lists; a new order each epoch, the same in every process")
def _balanced(t, BalancedDistributedSampler):
    cls = BalancedDistributedSampler
    heavy = case_costs("lognormal", 400, 3)
    cases = [  # name, config, balance?, epochs differ?, hidden, hint
        ("a torch Sampler; len() is ceil(n / num_replicas): n=10, 3 ranks give 4 each",
         _cfg([1.0] * 10, 3), False, False, False,
         "len() must be ceil(n / num_replicas) when drop_last=False (pad by repeating indices)"),
        ("drop_last=False, n=103, 4 ranks: 26 each, together every index, repeats only the padding (1)",
         _cfg(case_costs("lengths", 103, 1), 4), False, False, False,
         "pad the index list by repeating indices up to num_samples * num_replicas, then split it"),
        ("drop_last=True, n=103, 4 ranks: 25 each, no index twice, only 103 % 4 = 3 left out",
         _cfg(case_costs("lengths", 103, 2), 4, drop_last=True), False, False, False,
         "with drop_last, num_samples = n // num_replicas: drop the tail of the shuffled list, never repeat"),
        (f"balanced: max/mean per-rank cost <= {BALANCE_TOL} on heavy-tailed costs, n=400, 4 ranks "
         f"(DistributedSampler: {_ds_balance(heavy, 4):.2f})",
         _cfg(heavy, 4), True, False, False, SAMPLER_HINT),
        ("set_epoch: epoch 1 gives a new order, epoch 0 again the same lists; each a balanced partition",
         _cfg(heavy, 4, epochs=(0, 1, 0)), True, True, False,
         "build the plan in __iter__ from a generator seeded with seed + epoch, not once in __init__"),
        ("shuffle=False: the same balanced lists in every epoch",
         _cfg(heavy, 4, shuffle=False, epochs=(0, 5)), True, False, False,
         "with shuffle=False do not shuffle; the epoch must not change anything"),
        ("fresh costs: log-normal, n=1001, 2 ranks, seed=7", _cfg(case_costs("lognormal", 1001, 11), 2,
                                                                      seed=7, epochs=(0, 3)), True, True, True, ""),
        ("fresh costs: capped Pareto, n=240, 3 ranks, drop_last=True",
         _cfg(case_costs("pareto", 240, 5), 3, drop_last=True, epochs=(2, 4)), True, True, True, ""),
        ("fresh costs: integer lengths with ties and zeros, n=515, 5 ranks, and bimodal, n=707, 7 ranks",
         [_cfg(case_costs("lengths", 515, 8), 5, epochs=(0, 1)),
          _cfg(case_costs("bimodal", 707, 9), 7, seed=3, epochs=(0, 1))], True, True, True, ""),
        ("tiny data: n=5 on 8 ranks (drop_last False and True), n=1 on 1 rank, all costs zero",
         [_cfg([0.0] * 5, 8, epochs=(0, 1)), _cfg([0.0] * 5, 8, drop_last=True), _cfg([0.0], 1)],
         True, False, True, ""),
    ]
    configs, spans = [], []
    for case in cases:
        group = case[1] if isinstance(case[1], list) else [case[1]]
        spans.append((len(configs), len(configs) + len(group)))
        configs += group
    got, tried = None, False
    for (name, _, balance, differ, hidden, hint), (a, b) in zip(cases, spans):
        with t.case(name, hidden=hidden, hint=hint):
            if got is None:
                if tried:
                    t.fail("not judged: your sampler did not run (see the first case)")
                tried = True
                got = t.call(probe_sampler, cls, configs)  # one fresh process for all of them
            for cfg, result in zip(configs[a:b], got[a:b]):
                _judge(t, result, cfg, balance, differ, hint)
    with t.case("3 real processes, each building only its own rank's sampler: the lists fit together "
                "in epochs 0 and 1, and match what another process computes for that rank",
                hint="use only costs, seed and epoch (a torch.Generator seeded with seed + epoch), never the "
                     "global random state: each process must compute the same plan"):
        costs = case_costs("lengths", 200, 4)
        res = t.ranks(probe_sampler_ranks, 3, cls, costs, 5, (0, 1), backend="gloo")
        for e in (0, 1):
            lists = [r["mine"][e] for r in res]
            problem = _partition_problem(lists, [len(x) for x in lists], 200, 3, False)
            if problem:
                t.fail("", "the three processes' lists together cover every index once", f"epoch {e}: {problem}")
        if [res[0]["seen"][r] for r in range(3)] != [r["mine"][1] for r in res]:
            t.fail("", "process 0's plan for rank r equal to rank r's own", "different lists")


# -- train_with_join ------------------------------------------------------------------
def join_reference(counts: tuple, seed: int) -> list:
    """The weights Join gives: each step averages the gradients of the ranks that still have a
    batch, zeros from the others, divided by the world size; every rank ends with the same model."""
    model = join_model(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [join_batches(seed, r, c) for r, c in enumerate(counts)]
    for k in range(max(counts)):
        total = [torch.zeros_like(p) for p in model.parameters()]
        for r in range(len(counts)):
            if k < counts[r]:
                model.zero_grad()
                x, y = batches[r][k]
                torch.nn.functional.mse_loss(model(x), y).backward()
                total = [s + p.grad for s, p in zip(total, model.parameters())]
        for p, s in zip(model.parameters(), total):
            p.grad = s / len(counts)
        optimizer.step()
    return [p.detach() for p in model.parameters()]


JOIN_HINT = ("wrap the loop in `with Join([model]):` (torch.distributed.algorithms.join); a rank that runs out "
             "of batches then shadows the others' gradient all-reduces instead of leaving them waiting")


@exercise("05.train_with_join", points=5, description="train_with_join(model, batches, optimizer) -> int: "
          "a DDP training loop under Join, so ranks with different numbers of batches all finish")
def _train_with_join(t, train_with_join):
    def run(counts, seed):
        # gloo on the CPU on any machine: the check judges the loop, not the GPUs
        return t.ranks(probe_join, len(counts), train_with_join, counts, seed, timeout=JOIN_TIMEOUT,
                       backend="gloo")

    res = None
    with t.case("2 ranks with 3 and 5 batches: no hang, and each returns its own step count (3, 5)",
                hint=JOIN_HINT):
        res = run((3, 5), 1)
        t.equal([r["steps"] for r in res], [3, 5],
                hint="return the number of optimizer steps this rank took: one per batch it was given")
    with t.case("after the loop every rank holds the same weights",
                hint="Join's DDP hook makes every rank end with the same model; keep the model "
                     "wrapped in DDP and use it (not model.module) in the loop"):
        if res is None:
            t.fail("not judged: the first case did not finish")
        if not all(torch.equal(a, b) for r in res for a, b in zip(r["weights"], res[0]["weights"])):
            t.fail("", "identical weights on ranks 0 and 1", "different weights")
    with t.case("the weights equal Join's updates (loss = mse_loss(model(x), y), zero_grad, backward, step "
                "for every batch)",
                hint="per batch: optimizer.zero_grad(); F.mse_loss(model(x), y).backward(); optimizer.step()"):
        if res is None:
            t.fail("not judged: the first case did not finish")
        ref = join_reference((3, 5), 1)
        if not all(torch.allclose(a, b, atol=1e-5) for a, b in zip(res[0]["weights"], ref)):
            t.fail("", "the weights of the reference loop", "different weights")
    for counts, seed in (((4, 0, 2), 2), ((2, 2, 2), 3)):
        with t.case(f"3 ranks with {', '.join(map(str, counts))} batches: counts, same weights, reference",
                    hidden=True):
            res3 = run(counts, seed)
            t.equal([r["steps"] for r in res3], list(counts))
            ref = join_reference(counts, seed)
            if not all(torch.allclose(a, b, atol=1e-5) for r in res3 for a, b in zip(r["weights"], ref)):
                t.fail("weights differ")

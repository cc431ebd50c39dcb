"""Checks of lesson 05 (balanced samplers, uneven inputs): BalancedDistributedSampler, train_with_join.

- ``BalancedDistributedSampler`` is built for every rank in a fresh process,
  each rank after re-seeding the global random generators differently (as
  separate processes would be), so a plan drawn from the global generator
  instead of a ``seed + epoch`` one shows up as overlapping lists. It is judged
  on cost distributions the notebook never shows, per rank (max/mean of the
  ranks' total costs) and per step (the same max/mean, sample position by
  sample position: :func:`mgpu_lab.data.workload.step_imbalance`), and once in
  three real processes that each build only their own rank's sampler.
- ``train_with_join`` runs in 3 real ranks, every scenario in one launch, with
  a DDP model and a different number of batches per rank, followed by a
  barrier (as before a checkpoint): without Join the rank that runs out waits
  in the barrier while the others wait in the gradient all-reduce, and the
  launch times out in bounded time.

Neither judges device placement: the sampler yields indices, and
train_with_join receives a model and batches already on their device.
What runs in those processes is :mod:`.probes05`; this module judges, in the kernel.
"""
from __future__ import annotations

import torch

from mgpu_lab.launcher.errors import LaunchError
from mgpu_lab.data.workload import step_imbalance
from ._core import exercise
from .judges05 import (BALANCE_TOL, SAMPLER_HINT, STEP_HINT, STEP_TOL, case_costs, config, ds_balance, ds_lists,
                       judge, partition_problem)
from .probes04 import launch_scenarios
from .probes05 import join_batches, join_model, probe_join, probe_sampler, probe_sampler_ranks

JOIN_TIMEOUT = 20.0  # seconds: a right answer takes about one


def _case(name, cfg, hint="", balance=False, steps=False, differ=False, hidden=False) -> dict:
    return {"name": name, "cfgs": cfg if isinstance(cfg, list) else [cfg], "hint": hint, "balance": balance,
            "steps": steps, "differ": differ, "hidden": hidden}


def _sampler_cases() -> list[dict]:
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


@exercise("05.BalancedDistributedSampler", points=12, description="BalancedDistributedSampler(costs, "
          "num_replicas, rank, shuffle=True, seed=0, drop_last=False): equal-length, disjoint, covering, "
          "cost-balanced per-rank lists, aligned step by step; a new order each epoch, the same in every process")
def _balanced(t, BalancedDistributedSampler):
    """Every configuration in one fresh process, then 3 real processes.

    Catches: len() not ceil(n / num_replicas) (or n // num_replicas with
    drop_last), no padding, repeats beyond the padding, unequal lengths (no
    room check), costs ignored or not sorted costliest first (totals
    unbalanced), each rank shuffling its own positions (a rank in the seed:
    per-step imbalance), the same order every epoch, set_epoch(e) not
    reproducible, shuffle=False not honoured, the global random state
    (plans differ between processes).
    """
    cls = BalancedDistributedSampler
    cases = _sampler_cases()
    configs = [cfg for case in cases for cfg in case["cfgs"]]
    got, tried, start = None, False, 0
    for case in cases:
        with t.case(case["name"], hidden=case["hidden"], hint=case["hint"]):
            if got is None:
                if tried:
                    t.fail("not judged: your sampler did not run (see the first case)")
                tried = True
                got = t.call(probe_sampler, cls, configs)  # one fresh process for all of them
            for cfg, result in zip(case["cfgs"], got[start:start + len(case["cfgs"])]):
                judge(t, result, cfg, case["balance"], case["steps"], case["differ"], case["hint"])
        start += len(case["cfgs"])
    with t.case("3 real processes, each building only its own rank's sampler: the lists fit together, "
                "step by step, in epochs 0 and 1, and match what another process computes for that rank",
                hint="use only costs, seed and epoch (a torch.Generator seeded with seed + epoch), never the "
                     "global random state: each process must compute the same plan"):
        costs = case_costs("lengths", 200, 4)
        res = t.ranks(probe_sampler_ranks, 3, cls, costs, 5, (0, 1), backend="gloo")
        for e in (0, 1):
            lists = [r["mine"][e] for r in res]
            problem = partition_problem(lists, [len(x) for x in lists], 200, 3, False)
            if problem:
                t.fail("" if len(set(map(len, lists))) == 1 else "every rank's list needs ceil(n / num_replicas) "
                       "indices", "the three processes' lists together cover every index once",
                       f"epoch {e}: {problem}")
            steps = step_imbalance(lists, costs, 1)
            if steps > STEP_TOL:
                t.fail(STEP_HINT, f"per-step max/mean <= {STEP_TOL}", f"epoch {e}: {steps:.3f}")
        if [res[0]["seen"][r] for r in range(3)] != [r["mine"][1] for r in res]:
            t.fail("", "process 0's plan for rank r equal to rank r's own", "different lists")


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


JOIN_HINT = ("wrap the loop in `with Join([model]):` (torch.distributed.algorithms.join); a rank that runs out "
             "of batches then shadows the others' gradient all-reduces instead of leaving them waiting")
JOIN_SCENARIOS = [((3, 5, 1), 1), ((4, 0, 2), 2), ((2, 2, 2), 3)]  # batches per rank, seed


def _same(a, b) -> bool:
    return all(torch.allclose(x, y, atol=1e-5) for x, y in zip(a, b))


def _join_diagnosis(weights, counts, seed) -> str:
    if _same(weights, join_reference(counts, seed, initial=False)):
        return ("your weights average each step over the ranks still training: keep Join's default "
                "divide_by_initial_world_size=True")
    if _same(weights, join_reference(counts, seed, reduction="sum")):
        return "your weights match a summed loss: use F.mse_loss(model(x), y) (the mean)"
    return "per batch: optimizer.zero_grad(); F.mse_loss(model(x), y).backward(); optimizer.step()"


def _scenario(t, evidence, k):
    try:
        return evidence.get(t, k)
    except LaunchError as exc:
        if exc.exc_type and "exhausted inputs" in str(exc):
            t.fail("Join(..., throw_on_early_termination=True) makes every rank raise as soon as one runs out "
                   "of batches: leave it False (the default) so that the others go on", "every rank finishes",
                   str(exc).splitlines()[0][:200])
        raise


@exercise("05.train_with_join", points=5, description="train_with_join(model, batches, optimizer) -> int: "
          "a DDP training loop under Join, so ranks with different numbers of batches all finish")
def _train_with_join(t, train_with_join):
    """One launch of 3 ranks (gloo on the CPU on any machine: the check judges the loop), three scenarios.

    Catches: no Join (a hang, reported after JOIN_TIMEOUT), Join over the
    optimizer, throw_on_early_termination=True, a wrong step count, no
    zero_grad, a summed loss, the step outside the loop,
    divide_by_initial_world_size=False.
    """
    evidence = launch_scenarios(t, probe_join, 3, train_with_join, JOIN_SCENARIOS, timeout=JOIN_TIMEOUT)
    counts, seed = JOIN_SCENARIOS[0]
    res = None
    with t.case("3 ranks with 3, 5 and 1 batches: no hang, and each returns its own step count (3, 5, 1)",
                hint=JOIN_HINT):
        res = _scenario(t, evidence, 0)
        t.equal([r["steps"] for r in res], list(counts),
                hint="return the number of optimizer steps this rank took: one per batch it was given")
    with t.case("after the loop every rank holds the same weights",
                hint="Join's DDP hook makes every rank end with the same model; keep the model "
                     "wrapped in DDP and use it (not model.module) in the loop"):
        if res is None:
            t.fail("not judged: the first case did not finish")
        if not all(torch.equal(a, b) for r in res for a, b in zip(r["weights"], res[0]["weights"])):
            t.fail("", "identical weights on ranks 0, 1 and 2", "different weights")
    with t.case("the weights equal Join's updates (loss = mse_loss(model(x), y), zero_grad, backward, step "
                "for every batch)"):
        if res is None:
            t.fail("not judged: the first case did not finish")
        if not _same(res[0]["weights"], join_reference(counts, seed)):
            t.fail(_join_diagnosis(res[0]["weights"], counts, seed), "the weights of the reference loop",
                   "different weights")
    for k, (counts, seed) in enumerate(JOIN_SCENARIOS[1:], start=1):
        with t.case(f"3 ranks with {', '.join(map(str, counts))} batches: counts, same weights, reference",
                    hidden=True):
            got = _scenario(t, evidence, k)
            t.equal([r["steps"] for r in got], list(counts))
            if not all(_same(r["weights"], join_reference(counts, seed)) for r in got):
                t.fail("weights differ")

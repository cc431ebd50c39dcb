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
What runs in those processes is :mod:`.ranks`; this module judges, in the kernel.
"""
from __future__ import annotations

import torch

from mgpu_lab.data.workload import step_imbalance
from .._core import exercise
from ..sim.scenarios import launch_scenarios
from .judges import (join_diagnosis, same_tensors, sampler_cases, scenario_evidence, case_costs, join_reference, judge,
                     partition_problem, STEP_HINT, STEP_TOL)
from .ranks import probe_join, probe_sampler, probe_sampler_ranks


JOIN_TIMEOUT = 20.0  # seconds: a right answer takes about one


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
    cases = sampler_cases()
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


JOIN_HINT = ("wrap the loop in `with Join([model]):` (torch.distributed.algorithms.join); a rank that runs out "
             "of batches then shadows the others' gradient all-reduces instead of leaving them waiting")


JOIN_SCENARIOS = [((3, 5, 1), 1), ((4, 0, 2), 2), ((2, 2, 2), 3)]  # batches per rank, seed


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
        res = scenario_evidence(t, evidence, 0)
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
        if not same_tensors(res[0]["weights"], join_reference(counts, seed)):
            t.fail(join_diagnosis(res[0]["weights"], counts, seed), "the weights of the reference loop",
                   "different weights")
    for k, (counts, seed) in enumerate(JOIN_SCENARIOS[1:], start=1):
        with t.case(f"3 ranks with {', '.join(map(str, counts))} batches: counts, same weights, reference",
                    hidden=True):
            got = scenario_evidence(t, evidence, k)
            t.equal([r["steps"] for r in got], list(counts))
            if not all(same_tensors(r["weights"], join_reference(counts, seed)) for r in got):
                t.fail("weights differ")

"""Checks of lesson 05 (balanced samplers, uneven inputs): BalancedDistributedSampler, train_uneven.

- ``BalancedDistributedSampler`` is built for every rank in a fresh process,
  each rank after re-seeding the global random generators differently (as
  separate processes would be), so a plan drawn from the global generator
  instead of a ``seed + epoch`` one shows up as overlapping lists. It is judged
  on cost distributions the notebook never shows, per rank (max/mean of the
  ranks' total costs) and per step (the same max/mean, sample position by
  sample position: :func:`mgpu_lab.data.workload.step_imbalance`), and once in
  three real processes that each build only their own rank's sampler.
- ``train_uneven`` runs in 3 real ranks, every scenario in one launch, with
  shards of different lengths (one empty) and a barrier after it (as before a
  checkpoint): a rank that leaves on its own waits in the barrier while the
  others wait in a collective, and the launch times out in bounded time. The
  weights are compared with the reference computed in one process, and with
  those of the known wrong answers, which the failure then names.

The sampler yields indices: nothing to place. ``train_uneven``'s last scenario runs
the ranks as NCCL ranks on simulated GPUs (:mod:`..sim`: ``model_fn()`` on
``cuda:rank``, gloo underneath) and judges only where things were: every batch
the model was given on the model's device, every tensor handed to a collective
(the "anyone has data" flag included) on the rank's GPU; the weights are judged
on the plain CPU scenarios.
What runs in those processes is :mod:`.ranks`; this module judges, in the kernel.
"""
from __future__ import annotations

from mgpu_lab.data.workload import step_imbalance
from .._core import exercise
from ..sim.scenarios import launch_scenarios
from .judges import (case_costs, judge, judge_same_lists, partition_problem, same_state, sampler_cases,
                     uneven_diagnosis, uneven_reference, STEP_HINT, STEP_TOL)
from .ranks import probe_sampler, probe_sampler_ranks, probe_uneven, uneven_model


UNEVEN_TIMEOUT = 20.0  # seconds: a right answer takes about one


SAMPLER_REFERENCES = ("mgpu_lab.data.balanced:plan_balanced", "mgpu_lab.data.balanced:CostBalancedSampler")


@exercise("05.BalancedDistributedSampler", points=12, description="BalancedDistributedSampler(costs, "
          "num_replicas, rank, shuffle=True, seed=0, drop_last=False): equal-length, disjoint, covering, "
          "cost-balanced per-rank lists, aligned step by step; a new order each epoch, the same in every process",
          references=SAMPLER_REFERENCES)
def _balanced(t, BalancedDistributedSampler):
    """Every configuration in one fresh process, then 3 real processes.

    Catches: len() not ceil(n / num_replicas) (or n // num_replicas with
    drop_last), no padding, repeats beyond the padding, unequal lengths (no
    room check), costs ignored or not sorted costliest first (totals
    unbalanced), each rank shuffling its own positions (a rank in the seed:
    per-step imbalance), the same order every epoch, set_epoch(e) not
    reproducible, shuffle=False not honoured (a new order every epoch, or a shuffle drawn from the seed
    alone), the global random state
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
            if case["same"]:
                judge_same_lists(t, got[start:start + len(case["cfgs"])])
        start += len(case["cfgs"])
    with t.case("3 real processes, each building only its own rank's sampler: the lists fit together, "
                "step by step, in epochs 0 and 1, and match what another process computes for that rank",
                hint="the processes computed different plans: the plan may depend only on costs, seed and epoch, "
                     "never on the global random state or the rank"):
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


HANG_HINT = ("a rank that ran out of data left the loop while the others waited for it in a gradient all-reduce "
             "(or the barrier after your function): every rank must take part in every step until the ranks "
             "agree that none of them has a batch left")


UNEVEN_REFERENCES = ("mgpu_lab.data.join:train_with_join", "torch.distributed.algorithms.join:Join")


UNEVEN_SCENARIOS = [((10, 23, 0), 2, 4, 1, False), ((7, 7, 7), 1, 3, 2, False), ((5, 0, 12), 3, 3, 3, False),
                    ((1, 9, 4), 2, 2, 4, False),
                    ((3, 5, 0), 1, 2, 5, True)]  # last: on simulated GPUs, judged for placement only


PLACEMENT_HINT = ("on a GPU the model's parameters are on the rank's GPU: each batch (inputs and labels) must be "
                  "moved to the model's device before the forward pass, and with NCCL every tensor handed to a "
                  "collective (the flag saying whether this rank has a batch too) must be made on that device; "
                  "gloo's CPU path hides both, NCCL and the GPU refuse them")


def _judge_placement(t, got) -> None:
    """Fail unless the model was given batches, every one on its device, and every collective's tensor
    (some collective ran) was on its rank's GPU."""
    inputs = [(r, *entry) for r, g in enumerate(got) for entry in g.get("inputs", [])]
    calls = [(r, op, on) for r, g in enumerate(got) for op, on in g.get("calls", [])]
    if not inputs or not calls:
        t.fail("not judged: on simulated GPUs your ranks gave the model no batch or called no collective",
               "batches through the model and collectives", f"{len(inputs)} forward passes, {len(calls)} collectives")
    wrong = [(r, on, model) for r, _, on, model in inputs if on != model]
    if wrong:
        r, on, model = wrong[0]
        t.fail("the batch was not moved to the model's device: " + PLACEMENT_HINT,
               f"rank {r}'s batches on {model}", f"rank {r} gave the model on {model} a batch on {on}")
    wrong = [(r, op, on) for r, op, on in calls if on != f"cuda:{r}"]
    if wrong:
        r, op, on = wrong[0]
        t.fail("a tensor handed to a collective (such as the flag saying whether this rank still has a batch) was "
               f"made on the CPU: {PLACEMENT_HINT}", f"rank {r}'s {op} given a tensor on cuda:{r}",
               f"rank {r}'s {op} given a tensor on {on}")


@exercise("05.train_uneven", points=7, description="train_uneven(model_fn, shards, epochs, batch_size, lr) -> "
          "state_dict: ranks with shards of unequal lengths train without Join, agree each step whether anyone "
          "still has a batch, and stop together", references=UNEVEN_REFERENCES)
def _train_uneven(t, train_uneven):
    """One launch of 3 ranks, five scenarios: four on gloo and the CPU (the weights: the loop), the last as NCCL
    ranks on simulated GPUs (placement only).

    Catches: the batch not moved to the model's device, the "anyone has data" flag made on the CPU, a rank that leaves on its own (a hang, reported after UNEVEN_TIMEOUT), division by the
    ranks still training, a summed loss, epochs run back to back, stopping when the first rank runs
    out, a stale gradient from a rank out of data, the last short batch dropped, Join or the library.
    """
    evidence = launch_scenarios(t, probe_uneven, 3, train_uneven, UNEVEN_SCENARIOS, timeout=UNEVEN_TIMEOUT)
    scenario = UNEVEN_SCENARIOS[0][:4]
    res = None
    with t.case("3 ranks with 10, 23 and 0 samples, batch_size=4, 2 epochs: every rank, the one without samples "
                "too, takes part in the steps and returns its model's state_dict (no hang, with a barrier after "
                "your function)", hint=HANG_HINT):
        res = evidence.get(t, 0)
        for r, got in enumerate(res):
            if got["state"] is None:
                t.fail("return model.state_dict() on every rank", "a state_dict",
                       f"rank {r} returned {got['returned']}")
            keys = sorted(uneven_model(scenario[3]).state_dict())
            if sorted(got["state"]) != keys:
                t.fail("return the state_dict of the model that model_fn() built (a DDP wrapper's keys start "
                       "with 'module.')", f"keys {keys}", f"rank {r}: keys {sorted(got['state'])[:4]}")
        idle = scenario[0].index(0)  # the rank without samples: only the others' steps can move its weights
        if same_state(res[idle]["state"], uneven_model(scenario[3]).state_dict()):
            t.fail(f"rank {idle} has no samples and its weights never moved: it took no part in the other ranks' "
                   "steps, so nothing made it wait, and no barrier could catch it leaving alone; every rank takes "
                   "part in every step while any rank still has a batch", f"rank {idle} trained with the others",
                   f"rank {idle} kept model_fn()'s weights")
    with t.case("every rank ends with the same weights, and they moved from the initial ones"):
        if res is None or any(got["state"] is None for got in res):
            t.fail("not judged: the first case did not pass")
        if not all(same_state(got["state"], res[0]["state"]) for got in res):
            t.fail("every rank applies the same averaged gradient at every step, so the models stay identical",
                   "identical weights on ranks 0, 1 and 2", "different weights")
        if same_state(res[0]["state"], uneven_model(scenario[3]).state_dict()):
            t.fail("the weights are those model_fn() returned: no step was taken", "trained weights",
                   "the initial weights")
    with t.case("the weights equal the reference: at each step the sum of the gradients of the ranks that still "
                "have a batch (zeros from the others) divided by the world size, 3; each epoch ends together"):
        if res is None or any(got["state"] is None for got in res):
            t.fail("not judged: the first case did not pass")
        if not same_state(res[0]["state"], uneven_reference(*scenario)):
            t.fail(uneven_diagnosis(res[0]["state"], scenario), "the weights of the reference",
                   "different weights")
    for k, (lengths, epochs, batch_size, seed, _) in enumerate(UNEVEN_SCENARIOS[1:-1], start=1):
        with t.case(f"3 ranks with {', '.join(map(str, lengths))} samples, batch_size={batch_size}, "
                    f"{epochs} epoch(s): the reference weights on every rank", hidden=True):
            got = evidence.get(t, k)
            want = uneven_reference(lengths, epochs, batch_size, seed)
            if not all(g["state"] is not None and same_state(g["state"], want) for g in got):
                bad = next(g["state"] for g in got if g["state"] is not None)
                t.fail(uneven_diagnosis(bad, UNEVEN_SCENARIOS[k][:4]) if bad else "return model.state_dict()",
                       "the reference weights", "different weights")
    with t.case("NCCL ranks on simulated GPUs (model_fn() on cuda:0-2, 3, 5 and 0 samples): every batch given to "
                "the model is on the model's device, and every tensor handed to a collective, the 'anyone has "
                "data' flag included, on the rank's GPU", hint=PLACEMENT_HINT):
        _judge_placement(t, evidence.get(t, len(UNEVEN_SCENARIOS) - 1))

"""Lesson 05's checkers: the solutions, stubs, a hang, DistributedSampler itself, the cases' tolerances.

The named wrong answers of every exercise (and correct variants, the library's
versions among them) are tests/mutants/test_mutants_05.py.
"""
from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import cloudpickle
import pytest
import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch.utils.data import DistributedSampler, Sampler

from mgpu_lab import check
from mgpu_lab.course.checks import _core, exercises
from mgpu_lab.course.checks.l05 import checkers, judges
from mgpu_lab.data.balanced import CostBalancedSampler, plan_balanced
from mgpu_lab.data.workload import distributed_sampler_lists, step_imbalance

pytestmark = pytest.mark.timeout(300)
# The answers below travel to the check's processes by value, as notebook
# functions do: by reference, every call would re-import this test module there.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

NOTEBOOK = Path(__file__).resolve().parents[3] / "solutions" / "05_balanced_samplers.ipynb"


def test_lesson_05_registers_its_two_exercises_with_one_point_per_case():
    assert {e.id: e.points for e in exercises("05")} == {"05.BalancedDistributedSampler": 12,
                                                          "05.train_uneven": 7}


def failed(result) -> list[str]:
    return [c.name for c in result.cases if not c.passed]


# -- BalancedDistributedSampler: answers ------------------------------------------------
class Stub(Sampler):
    def __init__(self, costs, num_replicas, rank, shuffle=True, seed=0, drop_last=False):
        raise NotImplementedError("write your solution here")


class IgnoresCosts(DistributedSampler):
    """Equal counts, random costs: what DistributedSampler does."""

    def __init__(self, costs, num_replicas, rank, shuffle=True, seed=0, drop_last=False):
        super().__init__(range(len(costs)), num_replicas, rank, shuffle=shuffle, seed=seed, drop_last=drop_last)


def test_the_library_sampler_is_a_reference_and_fails_every_case_saying_so():
    class Mine(CostBalancedSampler):  # a local class travels by value, as a notebook's does
        pass

    r = check("05.BalancedDistributedSampler", Mine)
    assert r.points == 0, str(r)
    assert "mgpu_lab.data.balanced.CostBalancedSampler" in r.cases[0].got + r.cases[0].hint, str(r)


def test_sampler_stub_is_not_attempted():
    r = check("05.BalancedDistributedSampler", Stub)
    assert (r.status, r.points) == ("not attempted", 0)


class Everything(Sampler):
    """Every index for every rank: a sampler that does nothing about ranks or costs."""

    def __init__(self, costs, num_replicas, rank, shuffle=True, seed=0, drop_last=False):
        self.n = len(costs)

    def set_epoch(self, epoch):
        pass

    def __len__(self):
        return self.n

    def __iter__(self):
        return iter(range(self.n))


def test_a_sampler_that_ignores_ranks_and_costs_passes_no_case():
    r = check("05.BalancedDistributedSampler", Everything)
    assert not any(c.passed for c in r.cases), str(r)


def test_distributed_sampler_itself_fails_exactly_the_balance_cases():
    r = check("05.BalancedDistributedSampler", IgnoresCosts)
    bad = failed(r)
    assert any(name.startswith("balanced: max/mean") for name in bad), str(r)
    assert not any(name.startswith(("a torch Sampler", "drop_last")) for name in bad), str(r)
    case = next(c for c in r.cases if c.name.startswith("balanced: max/mean"))
    assert "smallest total cost so far" in case.hint and float(case.got.split(": ")[1]) > 1.1
    steps = next(c for c in r.cases if c.name.startswith("3 real processes"))
    assert not steps.passed and "ONE permutation of positions" in steps.hint, str(r)


def test_the_reference_meets_both_tolerances_with_room_and_distributed_sampler_neither():
    heavy = judges.case_costs("lognormal", 400, 3)
    ds = distributed_sampler_lists(400, 4).tolist()
    assert judges.rank_balance(ds, heavy) >= 1.1 and step_imbalance(ds, heavy, 1) >= 2 * judges.STEP_TOL - 1
    for kind, n, seed, world, drop in [("lognormal", 400, 3, 4, False), ("lognormal", 1001, 11, 2, False),
                                       ("pareto", 240, 5, 3, True), ("lengths", 515, 8, 5, False),
                                       ("bimodal", 707, 9, 7, False), ("lengths", 200, 4, 3, False)]:
        costs = judges.case_costs(kind, n, seed)
        for epoch in range(3):
            lists = plan_balanced(costs, world, epoch=epoch, drop_last=drop).tolist()
            assert judges.rank_balance(lists, costs) <= 1.01, (kind, epoch)
            assert step_imbalance(lists, costs, 1) <= judges.STEP_TOL - 0.1, (kind, epoch)
            assert len(lists[0]) == (n // world if drop else math.ceil(n / world))


# -- train_uneven ---------------------------------------------------------------------
def leaves_on_its_own(model_fn, shards, epochs, batch_size, lr):
    """Averaged gradients, but each rank stops when its own data ends: the hang the exercise is about."""
    model = model_fn()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(epochs):
        for x, y in torch.utils.data.DataLoader(shards[tdist.get_rank()], batch_size=batch_size):
            optimizer.zero_grad()
            F.mse_loss(model(x), y).backward()
            for p in model.parameters():
                tdist.all_reduce(p.grad)
                p.grad /= tdist.get_world_size()
            optimizer.step()
    return model.state_dict()


def uneven_todo(model_fn, shards, epochs, batch_size, lr):
    raise NotImplementedError("write your solution here")


def returns_none(model_fn, shards, epochs, batch_size, lr):
    return None


def trains_nothing(model_fn, shards, epochs, batch_size, lr):
    return model_fn().state_dict()


def trains_alone(model_fn, shards, epochs, batch_size, lr):
    """Each rank trains on its own shard and never talks to the others: no hang, nothing shared."""
    model = model_fn()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(epochs):
        for x, y in torch.utils.data.DataLoader(shards[tdist.get_rank()], batch_size=batch_size):
            optimizer.zero_grad()
            F.mse_loss(model(x), y).backward()
            optimizer.step()
    return model.state_dict()


def test_uneven_stub_is_not_attempted():
    assert check("05.train_uneven", uneven_todo).status == "not attempted"


def test_trivial_answers_pass_no_case_naming_a_behaviour_they_lack():
    r = check("05.train_uneven", returns_none)
    assert r.points == 0 and "returned None" in r.cases[0].got, str(r)
    r = check("05.train_uneven", trains_nothing)  # returns, no hang, but the rank without samples took no step
    assert r.points == 0 and "took no part in the other ranks' steps" in r.cases[0].hint, str(r)
    assert "no step was taken" in r.cases[1].hint, str(r)
    r = check("05.train_uneven", trains_alone)  # each rank trains its own shard: a single-process version
    assert r.points == 0 and "took no part in the other ranks' steps" in r.cases[0].hint, str(r)


def test_a_rank_that_leaves_on_its_own_hangs_and_fails_in_bounded_time(monkeypatch):
    """The bug the exercise is about (so not repeated among the mutants, where it would cost a timeout too)."""
    monkeypatch.setattr(checkers, "UNEVEN_TIMEOUT", 6.0)
    start = time.monotonic()
    r = check("05.train_uneven", leaves_on_its_own)
    took = time.monotonic() - start
    assert r.points == 0 and "no answer within 6 s" in r.cases[0].got, str(r)
    assert "every rank must take part in every step" in r.cases[0].hint
    assert all(c.got == "skipped" or "did not pass" in c.hint for c in r.cases[1:] if c.hidden is False), str(r)
    assert took < 6 + 20, took  # one timeout; later cases are skipped, not waited for


def test_torchs_join_is_a_reference(monkeypatch):
    def with_join(model_fn, shards, epochs, batch_size, lr):
        from torch.distributed.algorithms.join import Join
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model_fn())
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        for _ in range(epochs):
            with Join([model]):
                for x, y in torch.utils.data.DataLoader(shards[tdist.get_rank()], batch_size=batch_size):
                    optimizer.zero_grad()
                    F.mse_loss(model(x), y).backward()
                    optimizer.step()
        return model.module.state_dict()

    r = check("05.train_uneven", with_join)
    assert r.points == 0 and "torch.distributed.algorithms.join.Join" in str(r), str(r)


def test_the_reference_tells_the_known_mistakes_apart():
    from mgpu_lab.course.checks.l05.judges import UNEVEN_BUGS, same_state, uneven_reference

    weighed = [s[:4] for s in checkers.UNEVEN_SCENARIOS if not s[4]]  # the last runs on simulated GPUs: placement
    for scenario in weighed[:1] + weighed[2:]:
        right = uneven_reference(*scenario)
        wrong = {bug: uneven_reference(*scenario, bug=bug) for bug in UNEVEN_BUGS}
        assert not any(same_state(right, w) for w in wrong.values()), scenario


def test_the_checks_default_timeout_leaves_room_for_a_slow_machine():
    assert checkers.UNEVEN_TIMEOUT >= 10 and _core.CALL_TIMEOUT >= 30

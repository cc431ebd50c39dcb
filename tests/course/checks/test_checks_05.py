"""The lesson 05 checkers against right answers, stubs, and the wrong answers they exist for."""
from __future__ import annotations

import math
import time

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DistributedSampler, Sampler

from mgpu_lab import check
from mgpu_lab.course.checks import _core, lesson05
from mgpu_lab.samplers import BalancedDistributedSampler, plan_balanced
from mgpu_lab.workload import distributed_sampler_lists

pytestmark = pytest.mark.timeout(300)


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


class SameEveryEpoch(BalancedDistributedSampler):
    def set_epoch(self, epoch):
        pass  # forgets the epoch: the same order every epoch


class Unpadded(Sampler):
    """Balanced, but splits n samples without padding: unequal lengths when n % num_replicas."""

    def __init__(self, costs, num_replicas, rank, shuffle=True, seed=0, drop_last=False):
        self.costs, self.world, self.rank, self.epoch = list(costs), num_replicas, rank, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return len(range(self.rank, len(self.costs), self.world))

    def __iter__(self):
        order = sorted(range(len(self.costs)), key=lambda i: -self.costs[i])
        return iter(order[self.rank::self.world])


class GlobalRandom(BalancedDistributedSampler):
    """Draws the shuffle from the global generator: each process gets another plan."""

    def plan(self):
        return plan_balanced(self.costs, self.num_replicas, seed=int(torch.randint(0, 10**6, ())),
                             shuffle=self.shuffle, drop_last=self.drop_last)


def test_sampler_solution_passes_with_full_points_even_defined_locally():
    class Mine(BalancedDistributedSampler):  # a local class travels by value, as a notebook's does
        pass

    start = time.monotonic()
    r = check("05.BalancedDistributedSampler", Mine)
    assert (r.status, r.points, r.max_points) == ("passed", 11, 11), str(r)
    print(f"check took {time.monotonic() - start:.1f} s")


def test_sampler_stub_is_not_attempted():
    r = check("05.BalancedDistributedSampler", Stub)
    assert (r.status, r.points) == ("not attempted", 0)


def test_sampler_that_ignores_costs_fails_exactly_the_balance_cases():
    r = check("05.BalancedDistributedSampler", IgnoresCosts)
    bad = failed(r)
    assert any(name.startswith("balanced: max/mean") for name in bad), str(r)
    assert not any(name.startswith(("a torch Sampler", "drop_last", "3 real processes")) for name in bad), str(r)
    case = next(c for c in r.cases if c.name.startswith("balanced"))
    assert "smallest total cost so far" in case.hint and float(case.got.split(": ")[1]) > 1.1


def test_sampler_that_ignores_the_epoch_fails_the_epoch_case():
    r = check("05.BalancedDistributedSampler", SameEveryEpoch)
    assert [n for n in failed(r) if not n.startswith("fresh")] == [
        "set_epoch: epoch 1 gives a new order, epoch 0 again the same lists; each a balanced partition"], str(r)
    assert "seed + epoch" in r.cases[4].hint and r.cases[4].got == "the same lists in every epoch"


def test_sampler_with_unequal_lengths_fails_the_padding_cases():
    r = check("05.BalancedDistributedSampler", Unpadded)
    bad = failed(r)
    assert any(n.startswith("a torch Sampler; len()") for n in bad)
    assert any(n.startswith("drop_last=False, n=103") for n in bad)
    case = next(c for c in r.cases if c.name.startswith("drop_last=False"))
    assert "expected 26" in case.got, case.got


def test_sampler_drawing_from_the_global_generator_fails_across_processes():
    r = check("05.BalancedDistributedSampler", GlobalRandom)
    assert any(n.startswith("3 real processes") for n in failed(r)), str(r)
    case = next(c for c in r.cases if c.name.startswith("3 real processes"))
    assert "global random state" in case.hint


def test_hidden_cases_are_balanced_by_the_reference_and_the_visible_one_not_by_distributed_sampler():
    heavy = lesson05.case_costs("lognormal", 400, 3)
    assert lesson05._balance(distributed_sampler_lists(400, 4).tolist(), heavy) >= 1.1
    for kind, n, seed, world, drop in [("lognormal", 1001, 11, 2, False), ("pareto", 240, 5, 3, True),
                                       ("lengths", 515, 8, 5, False), ("bimodal", 707, 9, 7, False)]:
        costs = lesson05.case_costs(kind, n, seed)
        for epoch in range(3):
            lists = plan_balanced(costs, world, epoch=epoch, drop_last=drop).tolist()
            assert lesson05._balance(lists, costs) <= 1.01, (kind, epoch)
            assert len(lists[0]) == (n // world if drop else math.ceil(n / world))


# -- train_with_join ------------------------------------------------------------------
def with_join(model, batches, optimizer):
    from torch.distributed.algorithms.join import Join

    steps = 0
    with Join([model]):
        for x, y in batches:
            optimizer.zero_grad()
            F.mse_loss(model(x), y).backward()
            optimizer.step()
            steps += 1
    return steps


def ddp_join_method(model, batches, optimizer):
    with model.join():  # DDP's own context manager: the same thing
        for x, y in batches:
            optimizer.zero_grad()
            F.mse_loss(model(x), y).backward()
            optimizer.step()
    return len(batches)


def without_join(model, batches, optimizer):
    for x, y in batches:
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    return len(batches)


def no_zero_grad(model, batches, optimizer):
    from torch.distributed.algorithms.join import Join

    with Join([model]):
        for x, y in batches:
            F.mse_loss(model(x), y).backward()
            optimizer.step()
    return len(batches)


def join_todo(model, batches, optimizer):
    raise NotImplementedError("write your solution here")


@pytest.mark.parametrize("answer", [with_join, ddp_join_method])
def test_join_solutions_pass_with_full_points(answer):
    r = check("05.train_with_join", answer)
    assert (r.status, r.points, r.max_points) == ("passed", 5, 5), str(r)


def test_join_stub_is_not_attempted():
    assert check("05.train_with_join", join_todo).status == "not attempted"


def test_loop_without_join_hangs_and_fails_in_bounded_time(monkeypatch):
    monkeypatch.setattr(lesson05, "JOIN_TIMEOUT", 6.0)
    start = time.monotonic()
    r = check("05.train_with_join", without_join)
    took = time.monotonic() - start
    assert r.points == 0 and "no answer within 6 s" in r.cases[0].got, str(r)
    assert "Join([model])" in r.cases[0].hint
    assert all(c.got == "skipped" or "did not finish" in c.hint for c in r.cases[1:] if c.hidden is False), str(r)
    assert took < 6 + 20, took  # one timeout; later cases are skipped, not waited for


def test_loop_without_zero_grad_fails_the_reference_case():
    r = check("05.train_with_join", no_zero_grad)
    assert failed(r)[:1] == ["the weights equal Join's updates (loss = mse_loss(model(x), y), zero_grad, "
                             "backward, step for every batch)"], str(r)


def test_the_checks_default_timeout_leaves_room_for_a_slow_machine():
    assert lesson05.JOIN_TIMEOUT >= 10 and _core.CALL_TIMEOUT >= 30

"""mgpu_lab.data.balanced, .samplers, .uneven and .join: planning, weighted draws, timed epochs on real ranks."""
from __future__ import annotations

import heapq
import math

import matplotlib
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from mgpu_lab import launch
from mgpu_lab.data import balanced, join, uneven
from mgpu_lab.data.balanced import CostBalancedSampler, plan_balanced
from mgpu_lab.data.samplers import DistributedWeightedSampler, class_balanced_weights
from mgpu_lab.data.workload import distributed_sampler_lists, heavy_tailed_lengths, imbalance, step_imbalance

matplotlib.use("Agg")
pytestmark = pytest.mark.timeout(120)


def lpt_oracle(costs, world, seed, epoch, shuffle, drop_last):
    """The plan written out in plain Python, as the lesson describes it."""
    n = len(costs)
    per = n // world if drop_last else math.ceil(n / world)
    g = torch.Generator().manual_seed(seed + epoch)
    order = torch.randperm(n, generator=g).tolist() if shuffle else list(range(n))
    order = (order * (per * world // n + 1))[: per * world]
    order.sort(key=lambda i: -float(costs[i]))
    heap, lists = [(0.0, r) for r in range(world)], [[] for _ in range(world)]
    for i in order:
        load, r = heapq.heappop(heap)
        lists[r].append(i)
        if len(lists[r]) < per:
            heapq.heappush(heap, (load + float(costs[i]), r))
    if shuffle:
        perm = torch.randperm(per, generator=g).tolist()
        lists = [[lst[p] for p in perm] for lst in lists]
    return lists


def assert_partition(lists, n, world, drop_last):
    per = n // world if drop_last else math.ceil(n / world)
    assert lists.shape == (world, per)
    flat = lists.flatten().tolist()
    assert all(0 <= i < n for i in flat)
    if drop_last:
        assert len(set(flat)) == len(flat)
    else:
        assert set(flat) == set(range(n)) and len(flat) - n == per * world - n


@pytest.mark.parametrize("n,world,drop_last", [(1000, 4, False), (1003, 4, False), (1003, 4, True),
                                               (5, 8, False), (5, 8, True), (1, 1, False), (0, 3, False)])
def test_plan_is_an_equal_length_partition(n, world, drop_last):
    costs = heavy_tailed_lengths(n, seed=n)
    for epoch in (0, 1):
        assert_partition(plan_balanced(costs, world, epoch=epoch, drop_last=drop_last), n, world, drop_last)


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [True, False])
def test_plan_equals_the_plain_python_greedy(shuffle, drop_last):
    costs = heavy_tailed_lengths(301, seed=3)
    got = plan_balanced(costs, 3, seed=5, epoch=2, shuffle=shuffle, drop_last=drop_last).tolist()
    assert got == lpt_oracle(costs.tolist(), 3, 5, 2, shuffle, drop_last)


def test_plan_balances_heavy_tails_where_distributed_sampler_does_not():
    costs = heavy_tailed_lengths(2000, seed=0, sigma=1.2)
    for world in (2, 4, 8):
        plan, ds = plan_balanced(costs, world), distributed_sampler_lists(2000, world)
        assert imbalance(plan, costs) <= 1.01
        assert step_imbalance(plan, costs, 8) < step_imbalance(ds, costs, 8) - 0.15
    assert step_imbalance(distributed_sampler_lists(2000, 4), costs, 8) >= 1.1


def test_plan_depends_only_on_seed_and_epoch():
    costs = heavy_tailed_lengths(500, seed=1)
    a, b = plan_balanced(costs, 4, seed=3, epoch=1), plan_balanced(costs, 4, seed=3, epoch=1)
    assert torch.equal(a, b)
    assert not torch.equal(a, plan_balanced(costs, 4, seed=3, epoch=2))
    assert not torch.equal(a, plan_balanced(costs, 4, seed=4, epoch=1))
    torch.manual_seed(123)  # the global generator plays no part
    assert torch.equal(a, plan_balanced(costs, 4, seed=3, epoch=1))
    fixed = plan_balanced(costs, 4, shuffle=False, epoch=0)
    assert torch.equal(fixed, plan_balanced(costs, 4, shuffle=False, epoch=9))


def test_positions_line_up_by_cost_so_steps_are_balanced():
    costs = heavy_tailed_lengths(4000, seed=2)
    plan = plan_balanced(costs, 4)
    per_position = costs[plan].double()  # [ranks, positions]
    spread = (per_position.max(0).values - per_position.min(0).values).mean()
    assert spread < 0.05 * costs.double().mean()
    assert step_imbalance(plan, costs, 1) < 1.03


def test_a_huge_epoch_plans_the_cheap_tail_in_rounds(monkeypatch):
    monkeypatch.setattr(balanced, "EXACT_LIMIT", 1000)  # the path a million samples take, on 20k
    costs = heavy_tailed_lengths(20_003, seed=4)
    for world, drop_last in ((2, False), (7, False), (7, True)):
        plan = plan_balanced(costs, world, drop_last=drop_last)
        assert_partition(plan, 20_003, world, drop_last)
        assert imbalance(plan, costs) < 1.001


def test_bad_arguments_say_the_values_and_the_fix():
    with pytest.raises(ValueError, match=r"costs\[2\] = -1.0: every cost must be a finite number >= 0"):
        plan_balanced([1, 2, -1], 2)
    with pytest.raises(ValueError, match=r"costs\[0\] = nan"):
        CostBalancedSampler([float("nan")], 1, 0)
    with pytest.raises(ValueError, match=r"num_replicas=0: pass the number of ranks"):
        plan_balanced([1, 2], 0)
    with pytest.raises(ValueError, match=r"rank=2 with num_replicas=2: the rank must lie in 0..1"):
        CostBalancedSampler([1, 2], 2, 2)
    with pytest.raises(ValueError, match=r"replacement=False needs num_replicas \* len\(self\) = 4 <= 3"):
        DistributedWeightedSampler([1, 1, 1, 0], num_samples=4, num_replicas=2, rank=0, replacement=False)
    with pytest.raises(ValueError, match=r"sum\(weights\)=0"):
        DistributedWeightedSampler([0, 0], num_replicas=1, rank=0)


def test_sampler_yields_its_row_and_follows_set_epoch():
    costs = heavy_tailed_lengths(103, seed=5)
    s = CostBalancedSampler(costs.tolist(), 4, 2, seed=1)
    assert len(s) == 26
    s.set_epoch(3)
    assert list(s) == plan_balanced(costs, 4, seed=1, epoch=3)[2].tolist()
    assert len(CostBalancedSampler(costs, 4, 0, drop_last=True)) == 25


def test_weighted_sampler_shares_one_draw_disjointly_and_reproducibly():
    labels = torch.multinomial(torch.tensor([0.9, 0.08, 0.02]), 3000, True, generator=torch.Generator().manual_seed(0))
    w = class_balanced_weights(labels)
    shares = [DistributedWeightedSampler(w, num_replicas=3, rank=r, seed=4) for r in range(3)]
    for s in shares:
        s.set_epoch(1)
    drawn = [list(s) for s in shares]
    assert [len(d) for d in drawn] == [1000] * 3 and drawn == [list(s) for s in shares]
    freq = torch.bincount(labels[sum(drawn, [])], minlength=3).double() / 3000
    assert torch.allclose(freq, torch.full((3,), 1 / 3, dtype=torch.float64), atol=0.04)
    shares[0].set_epoch(2)
    assert list(shares[0]) != drawn[0]
    unique = [DistributedWeightedSampler(w, num_samples=2000, num_replicas=2, rank=r, replacement=False)
              for r in range(2)]
    a, b = (list(s) for s in unique)
    assert len(set(a) | set(b)) == 2000


def test_class_balanced_weights():
    assert class_balanced_weights([0, 0, 1]).tolist() == [0.5, 0.5, 1.0]


# -- on real ranks ----------------------------------------------------------------------
def _epoch_through_a_loader(costs, seed):
    rank, world = dist.get_rank(), dist.get_world_size()
    sampler = CostBalancedSampler(costs, world, rank, seed=seed)
    sampler.set_epoch(1)
    return [int(i) for batch in DataLoader(range(len(costs)), batch_size=4, sampler=sampler) for i in batch]


def test_every_rank_plans_alone_and_the_plans_fit_together():
    costs = heavy_tailed_lengths(50, seed=6).tolist()
    got = launch(_epoch_through_a_loader, 3, costs, 2, timeout=60)
    assert got == plan_balanced(costs, 3, seed=2, epoch=1).tolist()


def test_timed_epoch_records_every_step_and_the_summary_adds_up():
    costs = [10.0] * 24 + [200.0] * 8
    make = lambda rank, world: DistributedSampler(range(32), world, rank, shuffle=False)  # noqa: E731
    results = launch(uneven.timed_epoch, 2, make, costs, batch_size=4, unit_s=2e-5, timeout=60)
    assert [len(r["start"]) for r in results] == [4, 4]
    s = uneven.summarize(results)
    assert s["steps"] == 4 and s["cost"] == [sum(costs[0::2]), sum(costs[1::2])]
    for r in results:
        assert all(a <= b <= c for a, b, c in zip(r["start"], r["computed"], r["end"]))
    assert s["wall_s"] >= max(s["compute_s"]) and 0 <= s["lost"]
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2)
    uneven.plot_rank_bars({"x": results}, a)
    uneven.plot_timeline(results, b, steps=3)
    plt.close(fig)


def test_timed_epoch_rejects_bad_arguments():
    with pytest.raises(ValueError, match="batch_size=0"):
        uneven.timed_epoch(None, [1], batch_size=0)


def test_spin_takes_about_the_time_asked():
    import time

    start = time.perf_counter()
    uneven.spin(0.02)
    assert time.perf_counter() - start >= 0.02


def _join_loop(counts):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 1))
    g = torch.Generator().manual_seed(dist.get_rank())
    batches = [(torch.randn(2, 4, generator=g), torch.randn(2, 1, generator=g))
               for _ in range(counts[dist.get_rank()])]
    steps = join.train_with_join(model, batches, torch.optim.SGD(model.parameters(), lr=0.1))
    dist.barrier()  # hangs if a rank were still in a gradient all-reduce
    return steps, model.module.weight.detach().clone()


def test_train_with_join_lets_ranks_with_different_batch_counts_finish_with_one_model():
    (steps0, w0), (steps1, w1) = launch(_join_loop, 2, (3, 5), timeout=60)
    assert (steps0, steps1) == (3, 5) and torch.equal(w0, w1)

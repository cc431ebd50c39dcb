"""mgpu_lab.comm.collectives in real ranks: every collective's before/after, and the hand-written ring."""
from __future__ import annotations

import matplotlib
import pytest
import torch
import torch.distributed as dist

from mgpu_lab import launch
from mgpu_lab.comm import collectives

matplotlib.use("Agg")
pytestmark = pytest.mark.timeout(120)


def _everything():
    world, rank = dist.get_world_size(), dist.get_rank()
    sums = []
    for shape, dtype in (((1,), torch.float32), ((7,), torch.float32), ((3, 5), torch.float64),
                         ((2 * world + 1,), torch.int64)):
        x = (torch.arange(torch.Size(shape).numel()) * (rank + 1)).reshape(shape).to(dtype)
        expected = x.clone()
        dist.all_reduce(expected)
        got = collectives.ring_allreduce(x)
        sums.append(bool(torch.equal(got, expected)) and got.shape == x.shape and got.dtype == x.dtype)
    return {"shown": collectives.show_all(), "sums": sums, "trace": collectives.ring_trace()}


@pytest.fixture(scope="module")
def four():
    return launch(_everything, 4)


def test_every_collective_leaves_what_its_definition_says(four):
    world = 4
    start = [[10.0 * r + i for i in range(4)] for r in range(world)]
    column_sums = [sum(start[r][i] for r in range(world)) for i in range(4)]
    for r, res in enumerate(four):
        shown = res["shown"]
        assert shown["broadcast"] == (start[r], start[0])
        assert shown["all_reduce"] == (start[r], column_sums)
        assert shown["all_gather"] == ([10.0 * r], [10.0 * q for q in range(world)])
        assert shown["reduce_scatter"] == (start[r], [column_sums[r]])
        assert shown["all_to_all"] == (start[r], [10.0 * q + r for q in range(world)])
        assert shown["send/recv"] == (start[r], start[(r - 1) % world])
    assert four[0]["shown"]["reduce"][1] == column_sums  # only dst's result is defined


def test_the_ring_sums_any_shape_dtype_and_size_like_all_reduce(four):
    assert all(all(res["sums"]) for res in four), [res["sums"] for res in four]


def test_the_ring_trace_shows_partial_sums_then_the_total_and_2_w_minus_1_over_w_traffic(four):
    for r, res in enumerate(four):
        trace = res["trace"]
        steps = trace["steps"]
        assert len(steps) == 1 + 2 * 3 and trace["same"]
        assert steps[0] == [[10.0 ** r]] * 4
        after_reduce_scatter = steps[3]
        assert after_reduce_scatter[(r + 1) % 4] == [1111.0]  # rank r owns the full sum of chunk r+1
        assert steps[-1] == [[1111.0]] * 4
        assert trace["sent"] == 2 * 3 * trace["bytes"] // 4


def test_plots_draw_one_panel_per_collective_and_per_ring_step(four):
    fig = collectives.plot_collectives([res["shown"] for res in four])
    assert [ax.get_title() for ax in fig.axes if ax.get_title()] == list(collectives.OPS)
    ring = collectives.plot_ring([res["trace"] for res in four])
    assert [ax.get_title() for ax in ring.axes] == ["start", "RS 1", "RS 2", "RS 3", "AG 1", "AG 2", "AG 3"]
    assert collectives._ranks_in(1011, 4) == "013" and collectives._ranks_in(1111, 4) == "all"


def _single():
    return collectives.ring_allreduce(torch.arange(3.0)).tolist()


def test_one_rank_returns_its_own_tensor():
    assert launch(_single, 1) == [[0.0, 1.0, 2.0]]

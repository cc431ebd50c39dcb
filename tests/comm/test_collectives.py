"""mgpu_lab.comm.collectives in real ranks: every collective's before/after, and what a ring all-reduce sends
(the ring itself, mgpu_lab.comm.ring, is tested in test_ring.py)."""
from __future__ import annotations

import matplotlib
import pytest
import torch
import torch.distributed as dist

from mgpu_lab import launch
from mgpu_lab.comm import collectives, ring

matplotlib.use("Agg")
pytestmark = pytest.mark.timeout(120)


def _everything():
    return {"shown": collectives.show_all(), "trace": collectives.ring_trace(ring.all_reduce)}


def _everyone_to_everyone(tensor):
    """A correct sum that is no ring: every rank sends its whole tensor to every other rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    peers = [p for p in range(world) if p != rank]
    incoming = [torch.empty_like(tensor) for _ in peers]
    reqs = [dist.isend(tensor, p) for p in peers] + [dist.irecv(buf, p) for buf, p in zip(incoming, peers)]
    for req in reqs:
        req.wait()
    return tensor + sum(incoming)


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


def test_the_ring_trace_decodes_each_message_partial_sums_then_totals_and_2_w_minus_1_over_w_traffic(four):
    for r, res in enumerate(four):
        trace = res["trace"]
        assert trace["same"] and len(trace["messages"]) == 2 * 3
        assert trace["messages"][0] == (r, str(r))  # first step: its own chunk r, its own values
        assert trace["messages"][1] == ((r - 1) % 4, "".join(sorted(f"{(r - 1) % 4}{r}")))
        assert [ranks for _, ranks in trace["messages"][2:]] == ["all"] * 4 or trace["messages"][2][1] != "all"
        assert [ranks for _, ranks in trace["messages"][3:]] == ["all"] * 3  # the all-gather passes full sums
        assert trace["sent"] == 2 * 3 * trace["bytes"] // 4


def test_a_trace_of_a_sum_that_is_no_ring_shows_whole_tensors():
    trace = launch(collectives.ring_trace, 3, _everyone_to_everyone)[0]
    assert trace["same"] and trace["messages"] == [(None, "?"), (None, "?")] and trace["sent"] == 2 * trace["bytes"]


def test_plots_draw_one_panel_per_collective_and_per_ring_step(four):
    fig = collectives.plot_collectives([res["shown"] for res in four])
    assert [ax.get_title() for ax in fig.axes if ax.get_title()] == list(collectives.OPS)
    drawn = collectives.plot_ring([res["trace"] for res in four])
    labels = [t.get_text() for t in drawn.axes[0].get_xticklabels()]
    assert labels == ["RS 1", "RS 2", "RS 3", "AG 1", "AG 2", "AG 3"]
    assert collectives._ranks_in(1011, 4) == "013" and collectives._ranks_in(1111, 4) == "all"
    assert collectives._decode(torch.tensor([3303.0]), 4) == (2, "023")
    assert collectives._decode(torch.tensor([1.0, 2.0]), 4) == (None, "?")

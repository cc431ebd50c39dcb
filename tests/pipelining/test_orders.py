"""Each schedule's order of actions and its replay (mgpu_lab.pipelining.orders), in one process; the idle
fraction through lesson 12's check's own replay (mgpu_lab.course.checks.l12.judges.reference_bubble)."""
from __future__ import annotations

import pytest

from mgpu_lab.course.checks.l12.judges import reference_bubble  # the check's own replay (tests may use it)
from mgpu_lab.pipelining.orders import formula, needs, orders, simulate


@pytest.mark.parametrize("p, m", [(2, 1), (2, 4), (4, 2), (4, 8), (3, 7)])
def test_1f1b_warms_up_with_p_minus_rank_minus_one_forwards_and_keeps_the_memory_bound(p, m):
    for rank, labels in orders("1f1b", p, m).items():
        assert {a.split("/s")[1] for a in labels} == {str(rank)}
        order = [a.split("/s")[0] for a in labels]
        assert sorted(order) == sorted([f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)])
        assert order[:min(p - rank - 1, m)] == [f"F{i}" for i in range(min(p - rank - 1, m))]
        alive = peak = 0
        for a in order:
            alive += 1 if a[0] == "F" else -1
            peak = max(peak, alive)
        assert peak <= min(p - rank, m)


@pytest.mark.parametrize("schedule, v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3)])
@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (3, 6)])
def test_with_equal_times_the_replay_gives_the_closed_formulas(schedule, v, p, m):
    want = formula(schedule, p, m, v)
    assert reference_bubble(schedule, p, m, 1.0, 2.0, virtual=v) == pytest.approx(want, abs=1e-12)


def test_zbv_fills_the_bubble_with_weight_gradients_and_gains_nothing_without_them():
    assert reference_bubble("zbv", 4, 8, 1.0, 1.0, 1.0) < reference_bubble("1f1b", 4, 8, 1.0, 1.0, 1.0) / 4
    assert reference_bubble("zbv", 2, 64, 1.0, 1.0, 1.0) < 0.01
    zbv_orders = orders("zbv", 2, 4)
    assert {a.split("/s")[1] for a in zbv_orders[0]} == {"0", "3"}  # rank 0 holds the first and last stage: a V
    assert {a.split("/s")[1] for a in zbv_orders[1]} == {"1", "2"}


def test_interleaved_places_stages_in_a_loop_and_the_formula_fails_with_fewer_micro_batches_than_ranks():
    assert {a.split("/s")[1] for a in orders("interleaved", 2, 4, 2)[1]} == {"1", "3"}
    assert reference_bubble("interleaved", 4, 2, 1.0, 1.0, virtual=2) > formula("interleaved", 4, 2, 2) + 0.1


def test_a_deadlocking_order_is_named_with_each_rank_s_next_action():
    wrong = {0: ["F0/s0", "B0/s0"], 1: ["B0/s1", "F0/s1"]}
    with pytest.raises(RuntimeError, match=r"deadlock.*\{0: 'B0/s0', 1: 'B0/s1'\}"):
        simulate(wrong, {"F": 1.0, "B": 1.0})


def test_a_transfer_time_delays_every_message_between_ranks_only():
    per_rank = orders("gpipe", 2, 1)
    assert simulate(per_rank, {"F": 1.0, "B": 1.0}, transfer=0.5).makespan == pytest.approx(5.0)
    assert simulate({0: ["F0/s0", "F0/s1", "B0/s1", "B0/s0"]}, {"F": 1, "B": 1}, transfer=9).makespan == 4


def test_an_unknown_schedule_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="pick one of 'gpipe', '1f1b', 'interleaved', 'zbv'"):
        orders("dualpipe", 2, 4)
    assert callable(needs)


def test_torch_s_orders_come_from_a_built_schedule_s_pipeline_order_and_gpipe_s_are_refused():
    from torch.distributed.pipelining import schedules

    from mgpu_lab.pipelining.measure import torch_orders

    got = torch_orders("interleaved", 2, 4, virtual=2)
    assert sorted(got) == [0, 1] and got[0][0] == "F0/s0" and {a.split("/s")[1] for a in got[1]} == {"1", "3"}
    assert not hasattr(schedules.ScheduleInterleaved1F1B, "pipeline_order")  # an instance's: it was built
    zbv = torch_orders("zbv", 4, 8)
    assert {a.split("/s")[1] for a in zbv[0]} == {"0", "7"} and any(a.startswith("W") for a in zbv[0])
    with pytest.raises(ValueError, match="'interleaved' and 'zbv'"):
        torch_orders("gpipe", 2, 4)

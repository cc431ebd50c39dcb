"""Recording a schedule's actions in the ranks (record), fixed-work layers (work), real schedules (train,
measure), in mgpu_lab.pipelining."""
from __future__ import annotations

import time

import pytest
import torch

from mgpu_lab import launch
from mgpu_lab.pipelining import measure, train
from mgpu_lab.pipelining.record import compute_bubble, in_flight, parse
from mgpu_lab.pipelining.train import one_process, split_layers, stage_ids
from mgpu_lab.pipelining.work import Work, work_model

pytestmark = pytest.mark.timeout(300)


def test_labels_parse_and_waits_count_as_idle():
    assert parse("W12/s3") == ("W", 12, 3) and parse("wait") is None and parse("F1") is None
    spans = [("rank 0", "F0/s0", 0.0, 1.0), ("rank 1", "wait", 0.0, 1.0), ("rank 1", "F0/s1", 1.0, 2.0)]
    assert compute_bubble(spans) == pytest.approx(0.5)
    assert in_flight(spans) == {"rank 0": 1, "rank 1": 1}


def test_in_flight_holds_a_micro_batch_until_its_last_backward_part():
    spans = [("r", "F0/s0", 0, 1), ("r", "F1/s0", 1, 2), ("r", "I0/s0", 2, 3), ("r", "F2/s0", 3, 4),
             ("r", "W0/s0", 4, 5), ("r", "B1/s0", 5, 6), ("r", "B2/s0", 6, 7)]
    assert in_flight(spans) == {"r": 3}  # micro-batch 0 lives until its W


def test_work_sleeps_its_times_and_keeps_exact_gradients():
    layer = Work(3, t_f=0.02, t_b=0.02, t_w=0.02)
    x = torch.randn(2, 3, requires_grad=True)
    start = time.perf_counter()
    layer(x).sum().backward()
    assert time.perf_counter() - start >= 0.06
    plain = torch.nn.Linear(3, 3)
    plain.load_state_dict(layer.linear.state_dict())
    x2 = x.detach().clone().requires_grad_()
    torch.tanh(plain(x2)).sum().backward()
    assert torch.allclose(layer.linear.weight.grad, plain.weight.grad) and torch.allclose(x.grad, x2.grad)
    with pytest.raises(ValueError, match="n_layers=0"):
        work_model(0, 4)


def test_stages_are_cut_in_equal_runs_placed_in_a_loop_or_a_v():
    assert stage_ids("interleaved", 4, 0, 2) == [0, 2] and stage_ids("zbv", 4, 0, 2) == [0, 3]
    with pytest.raises(ValueError, match="n_stages must be 2 x world"):
        stage_ids("zbv", 6, 0, 2)
    with pytest.raises(ValueError, match="5 layers do not cut into 2 equal stages"):
        split_layers(torch.nn.Sequential(*[torch.nn.Identity()] * 5), 2)


def test_every_schedule_trains_like_one_process_on_two_ranks():
    def model_fn():
        return measure.mlp(4, 6)

    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g)) for _ in range(2)]
    ref = one_process(model_fn, batches, 0.1)

    def every_schedule(model_fn, batches):
        return [train.train(model_fn, 2, s, 4, batches, 0.1) for s in ("gpipe", "1f1b", "interleaved", "zbv")]

    states, nothing = launch(every_schedule, 2, model_fn, batches)
    assert nothing == [None] * 4
    for state in states:
        assert sorted(state) == sorted(ref)
        assert max(float((state[k] - ref[k]).abs().max()) for k in ref) < 1e-5


def test_measured_timelines_show_each_schedule_s_shape():
    runs = measure.measure(["gpipe", "1f1b", "zbv"], n_ranks=2, n_micro=4, t_f=0.005, t_b=0.005, t_w=0.005)
    assert runs["gpipe"]["in_flight"] == {"rank 0": 4, "rank 1": 4}
    assert runs["1f1b"]["in_flight"] == {"rank 0": 2, "rank 1": 1}
    labels = {label[0] for _, label, _, _ in runs["zbv"]["timeline"].spans}
    assert {"F", "I", "W"} <= labels and "B" not in labels  # ZBV splits every backward
    assert runs["gpipe"]["timeline"].lanes == ["rank 0", "rank 1"]
    for run in runs.values():
        assert 0.0 <= run["model"] < 1.0 and 0.0 <= run["bubble"] < 1.0


def test_the_timeline_draws_weight_gradients_green_and_waits_grey():
    from mgpu_lab.parallel.timeline import Timeline

    tl = Timeline()
    assert [tl._colour(label) for label in ("F0/s1", "B2/s0", "I1/s3", "W1/s3", "wait", "scatter")] == \
        ["tab:blue", "tab:orange", "tab:orange", "tab:green", "0.85", "tab:orange"]


@pytest.mark.parametrize("schedule, n_ranks, n_micro", [("gpipe", 2, 4), ("1f1b", 3, 6), ("interleaved", 2, 4),
                                                        ("zbv", 2, 4), ("zbv", 3, 3)])
def test_the_fit_gives_the_bubble_of_a_step_with_known_work_host_time_and_transfer(schedule, n_ranks, n_micro):
    from mgpu_lab.pipelining import orders

    work = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 0.7}
    host = {"F": 0.15, "B": 0.3, "I": 0.05, "W": 0.2}
    step = orders.simulate(orders.orders(schedule, n_ranks, n_micro, 2),
                              {k: work[k] + host[k] for k in work}, transfer=0.25)
    measured = measure._measured(step.spans, host)
    assert {label for _, label, _, _ in measured} >= {"wait"}
    fitted = measure.fitted_bubble(schedule, measured, n_ranks, n_micro)
    assert fitted == pytest.approx(compute_bubble(measured), abs=1e-9)
    assert fitted > step.idle_fraction() + 0.01  # host time is idle in both, not busy as in the replay


def test_host_time_is_the_gap_to_the_next_action_less_the_waits_and_transfer_is_the_mean_message():
    from mgpu_lab.pipelining import orders

    spans = [("rank 0", "F0/s0", 0.0, 1.0), ("rank 0", "F1/s0", 1.5, 2.5), ("rank 0", "wait", 3.0, 5.5),
             ("rank 0", "B0/s0", 6.0, 8.0), ("rank 0", "B1/s0", 8.5, 10.5),
             ("rank 1", "wait", 0.0, 1.4), ("rank 1", "F0/s1", 1.5, 2.5), ("rank 1", "B0/s1", 3.0, 5.0),
             ("rank 1", "wait", 5.0, 5.1), ("rank 1", "F1/s1", 5.5, 6.5), ("rank 1", "B1/s1", 6.5, 8.0)]
    work, host = measure._action_times(spans)
    assert work[("F", 0)] == pytest.approx(1.0) and work[("B", 1)] == pytest.approx(1.75)
    assert host[("F", 0)] == pytest.approx((0.5 + 1.0) / 2) and host[("B", 0)] == pytest.approx(0.5)
    assert host[("B", 1)] == pytest.approx(0.4)  # 0.5 to F1 less 0.1 of wait; the rank's last action has none
    # B0/s0 waited for B0/s1 (ended 5.0, host 0.4 -> sent 5.4, started 6.0): 0.6; F0/s1 for F0/s0 (sent 1.75): -0.25
    assert measure._transfer(spans, host, orders) == pytest.approx((0.6 - 0.25) / 2)

"""Recording a schedule's actions in the ranks (pp_record), fixed-work layers (pp_work), real schedules (pp_train,
pp_measure)."""
from __future__ import annotations

import time

import pytest
import torch

from mgpu_lab import launch
from mgpu_lab.parallel import pp_measure
from mgpu_lab.parallel.pp_record import compute_bubble, in_flight, parse
from mgpu_lab.parallel.pp_train import one_process, pipeline_train, split_layers, stage_ids
from mgpu_lab.parallel.pp_work import Work, work_model

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
        return pp_measure.mlp(4, 6)

    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g)) for _ in range(2)]
    ref = one_process(model_fn, batches, 0.1)

    def every_schedule(model_fn, batches):
        return [pipeline_train(model_fn, 2, s, 4, batches, 0.1) for s in ("gpipe", "1f1b", "interleaved", "zbv")]

    states, nothing = launch(every_schedule, 2, model_fn, batches)
    assert nothing == [None] * 4
    for state in states:
        assert sorted(state) == sorted(ref)
        assert max(float((state[k] - ref[k]).abs().max()) for k in ref) < 1e-5


def test_measured_timelines_show_each_schedule_s_shape():
    runs = pp_measure.measure(["gpipe", "1f1b", "zbv"], n_ranks=2, n_micro=4, t_f=0.005, t_b=0.005, t_w=0.005)
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

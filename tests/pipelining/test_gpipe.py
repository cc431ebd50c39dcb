"""mgpu_lab.pipelining.gpipe, .schedule and .pipeline: GPipe timed on one process, its schedule and bubble model,
and pipelines across real ranks on the CPU (lesson 06)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from toy_training import all_close as _close, full_batch_grads as _full_batch_grads, toy_data as _data

from mgpu_lab import LaunchError, launch
from mgpu_lab.parallel.model_parallel import mlp, split
from mgpu_lab.parallel.timeline import Timeline, fit_gpipe
from mgpu_lab.pipelining.gpipe import fit_bubble, timed_step
from mgpu_lab.pipelining.pipeline import TimedStage, run_gpipe, torch_gpipe_rank
from mgpu_lab.pipelining.schedule import gpipe_schedule

pytestmark = pytest.mark.timeout(300)
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


# -- GPipe on one process ---------------------------------------------------------------
def test_timed_step_on_one_process_matches_the_full_batch_and_never_overlaps():
    model = mlp(features=8, width=16, depth=4, classes=3)
    x, y = _data(10)
    ref_loss, ref = _full_batch_grads(model, x, y)
    stages = split(copy.deepcopy(model), 2)
    tl = Timeline()
    loss = timed_step(stages, ["cpu", "cpu"], x, y, nn.CrossEntropyLoss(), 4, tl)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert _close([p.grad for s in stages for p in s.parameters()], ref)
    assert tl.lanes == ["stage 1 (cpu)", "stage 2 (cpu)"]
    assert [label for _, label, *_ in tl.spans] == ["F0", "F0", "F1", "F1", "F2", "F2", "F3", "F3",
                                                     "B0", "B0", "B1", "B1", "B2", "B2", "B3", "B3"]
    ordered = sorted(tl.spans, key=lambda s: s[2])  # one process, CPU: one stage at a time
    assert all(a[3] <= b[2] for a, b in zip(ordered, ordered[1:]))
    with pytest.raises(ValueError, match="2 stages but 1 devices"):
        timed_step(stages, ["cpu"], x, y, nn.CrossEntropyLoss(), 2)


# -- the bubble model: GPipe's schedule with measured stage and transfer times ---------------------
@pytest.mark.parametrize("p, m", [(1, 1), (2, 1), (2, 4), (3, 7), (4, 8), (8, 32)])
def test_equal_stages_and_free_transfers_give_gpipes_formula(p, m):
    tl = gpipe_schedule([1.5] * p, [3.0] * p, m)
    assert tl.idle_fraction() == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
    assert tl.makespan == pytest.approx((m + p - 1) * 4.5)


def test_unequal_stages_and_transfers_make_the_bubble_grow_beyond_the_formula():
    equal = gpipe_schedule([1, 1], [2, 2], 4).idle_fraction()
    unequal = gpipe_schedule([1, 1.5], [2, 3], 4).idle_fraction()
    slow = [gpipe_schedule([1, 1], [2, 2], 4, transfer=t).idle_fraction() for t in (0.0, 0.2, 0.5, 1.0)]
    assert equal == pytest.approx(0.2) and unequal > equal and slow == sorted(slow) and slow[-1] > 0.29
    with pytest.raises(ValueError, match="one duration per stage"):
        gpipe_schedule([1, 1], [2], 4)


@pytest.mark.parametrize("forward, backward, m, transfer, overhead", [
    ([1.0, 2.0], [2.0, 3.0], 4, 0.5, 0.1), ([1.0, 1.0, 1.0], [2.0, 2.0, 2.0], 8, 0.3, 0.05),
    ([2.0, 1.0], [3.0, 1.0], 3, 0.2, 0.4), ([1.0, 1.0], [2.0, 2.0], 6, 0.9, 0.0)])
def test_the_fit_recovers_stage_times_transfer_and_overhead_of_a_known_schedule(forward, backward, m, transfer,
                                                                                overhead):
    tl = gpipe_schedule(forward, backward, m, transfer, overhead)
    fit = fit_gpipe(tl)
    assert fit.forward == pytest.approx(forward) and fit.backward == pytest.approx(backward) and fit.n_micro == m
    assert (fit.transfer, fit.overhead) == (pytest.approx(transfer), pytest.approx(overhead, abs=1e-12))
    assert fit_bubble(fit) == pytest.approx(tl.idle_fraction())
    if len(set(forward)) == 1 and len(set(backward)) == 1:  # the limit: free transfers, equal stages
        assert fit_bubble(fit, transfer=0, overhead=0) == pytest.approx((len(forward) - 1) / (m + len(forward) - 1))


def _jittered(forward, backward, m, transfer, overhead, jitter, seed):
    """A "measured" GPipe step: every span, transfer and overhead drawn within +-jitter of its mean."""
    import random

    rnd = random.Random(seed)
    p, tl, free, ends = len(forward), Timeline(), [None] * len(forward), {}
    for phase, order, durations in (("F", range(p), forward), ("B", range(p - 1, -1, -1), backward)):
        for i in range(m):
            for s in order:
                ready = 0.0 if free[s] is None else free[s] + overhead * rnd.uniform(1 - jitter, 1 + jitter)
                sender = (phase, s - 1 if phase == "F" else s + 1, i)
                if sender in ends:
                    ready = max(ready, ends[sender] + transfer * rnd.uniform(1 - jitter, 1 + jitter))
                ends[phase, s, i] = free[s] = ready + durations[s] * rnd.uniform(1 - jitter, 1 + jitter)
                tl.add(f"stage {s + 1}", f"{phase}{i}", ready, free[s])
    return tl


@pytest.mark.parametrize("forward, backward", [([1.0, 1.3], [2.0, 2.4]), ([1.0, 0.8, 1.2], [2.0, 1.7, 2.5])])
def test_the_fitted_model_predicts_the_bubble_of_noisy_steps_within_ten_percent(forward, backward):
    for m in (1, 2, 4, 8, 16):
        for transfer, overhead in ((0.0, 0.0), (0.3, 0.05), (1.0, 0.2)):
            for seed in range(3):
                measured = _jittered(forward, backward, m, transfer, overhead, 0.1, seed)
                predicted = fit_bubble(fit_gpipe(measured))
                assert abs(predicted - measured.idle_fraction()) <= 0.1 * measured.idle_fraction(), (m, seed)


def test_the_fit_reads_only_gpipe_steps():
    tl = Timeline([("stage 1", "F0", 0, 1), ("stage 1", "X0", 1, 2)])
    with pytest.raises(ValueError, match="'X0' of 'stage 1' is not GPipe's"):
        fit_gpipe(tl)
    with pytest.raises(ValueError, match="expected F0..F1 and B0..B1 on every stage"):
        fit_gpipe(Timeline([("a", "F0", 0, 1), ("a", "F1", 1, 2), ("a", "B0", 2, 3)]))

# -- pipelines across ranks -------------------------------------------------------------
def test_gpipe_across_two_ranks_gives_the_full_batch_gradients_and_a_timeline():
    model = mlp(features=8, width=16, depth=4, classes=3)
    x, y = _data(12)
    ref_loss, ref = _full_batch_grads(model, x, y)
    runs = run_gpipe(split(copy.deepcopy(model), 2), x, y, nn.CrossEntropyLoss(), n_micros=(1, 4), steps=2,
                     pin=False, timeout=120)
    assert [r["n_micro"] for r in runs] == [1, 4] and [r["formula"] for r in runs] == [0.5, 0.2]
    for run in runs:
        assert run["loss"] == pytest.approx(ref_loss, rel=1e-5) and _close(run["grads"], ref)
        tl = run["timeline"]
        assert tl.lanes == ["stage 1 · rank 0 · cpu", "stage 2 · rank 1 · cpu"]
        assert len(tl.spans) == 2 * 2 * run["n_micro"] and 0 < run["bubble"] < 1 and run["step_time"] > 0
        assert 0 < run["cpu_share"] <= 1.05
        for lane in tl.lanes:  # every micro-batch's forward, then its backward, in order, on each rank
            labels = [label for name, label, _, _ in sorted(tl.spans, key=lambda s: s[2]) if name == lane]
            assert sorted(labels) == sorted([f"F{i}" for i in range(run["n_micro"])]
                                            + [f"B{i}" for i in range(run["n_micro"])]), labels
            assert labels[0] == "F0" and labels.index("B0") >= (run["n_micro"] if lane.startswith("stage 1") else 1)
    with pytest.raises(LaunchError, match="must divide the batch of 12"):
        run_gpipe(split(copy.deepcopy(model), 2), x, y, nn.CrossEntropyLoss(), n_micros=(5,), steps=1, pin=False,
                  timeout=120)


def test_a_timed_stage_spans_forward_and_backward_and_adds_no_input_gradient():
    stage = TimedStage(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)), Timeline(), "s")
    x = torch.ones(5, 3)
    for _ in range(2):
        stage(x).sum().backward()
    labels = [label for _, label, _, _ in stage.timeline.spans]
    assert labels == ["F0", "B0", "F1", "B1"] and x.grad is None
    (f0, b0) = [s for s in stage.timeline.spans[:2]]
    assert f0[2] <= f0[3] <= b0[2] <= b0[3]
    stage.restart(Timeline())
    stage(x).sum().backward()
    assert [label for _, label, _, _ in stage.timeline.spans] == ["F0", "B0"]


def test_torch_pipelining_gpipe_on_gloo_gives_the_full_batch_gradients():
    model = mlp(features=8, width=16, depth=4, classes=3)
    x, y = _data(12)
    ref_loss, ref = _full_batch_grads(model, x, y)
    ranks = launch(torch_gpipe_rank, 2, split(copy.deepcopy(model), 2), x, y, nn.CrossEntropyLoss(), 4, 1,
                   False, timeout=120)
    assert _close(ranks[0]["grads"] + ranks[1]["grads"], ref)
    assert sum(ranks[1]["losses"]) / 4 == pytest.approx(ref_loss, rel=1e-5) and len(ranks[0]["times"]) == 1
    with pytest.raises(LaunchError, match="n_micro=5 does not divide the batch of 12"):
        launch(torch_gpipe_rank, 2, split(copy.deepcopy(model), 2), x, y, nn.CrossEntropyLoss(), 5, 1, False,
               timeout=120)

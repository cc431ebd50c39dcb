"""mgpu_lab.parallel.model_parallel: stages on devices, timelines (one process), DDP over two-device replicas (ranks)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from toy_training import all_close as _close, full_batch_grads as _full_batch_grads, toy_data as _data

from mgpu_lab import launch
from mgpu_lab.parallel.model_parallel import (TwoStageNet, ddp_replica_rank, ideal_timeline, mlp, replica_devices, split,
                                              stage_devices)
from mgpu_lab.parallel.timeline import Timeline

pytestmark = pytest.mark.timeout(300)
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


# -- GPipe's ideal schedule -----------------------------------------------------------
@pytest.mark.parametrize("p, m", [(1, 1), (2, 1), (2, 3), (3, 8), (4, 4)])
def test_the_ideal_gpipe_schedule_idles_exactly_the_formula(p, m):
    tl = ideal_timeline(p, m)
    assert tl.idle_fraction() == pytest.approx((p - 1) / (m + p - 1))
    assert tl.makespan == pytest.approx((m + p - 1) * 3.0)
    assert tl.lanes == [f"stage {s}" for s in range(1, p + 1)] and len(tl.spans) == 2 * p * m


# -- placing stages -------------------------------------------------------------------
def test_two_stage_net_matches_the_unsplit_model_in_output_and_gradients():
    model = mlp(features=8, width=16, depth=4, classes=3)
    x, y = _data()
    ref_loss, ref = _full_batch_grads(model, x, y)
    net = TwoStageNet(*split(copy.deepcopy(model), 2), "cpu", torch.device("cpu"))
    out = net(x)
    loss = nn.CrossEntropyLoss()(out, y)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(ref_loss) and out.device == net.dev2
    assert _close([p.grad for p in net.parameters()], ref)


@pytest.mark.gpu
@pytest.mark.skipif(GPUS < 2, reason=f"needs 2 CUDA GPUs, {GPUS} visible")
def test_two_stage_net_on_two_gpus_places_stages_and_returns_on_dev2():
    net = TwoStageNet(nn.Linear(8, 16), nn.Linear(16, 3), "cuda:0", "cuda:1")
    assert net.stage1.weight.device == torch.device("cuda", 0) and net.stage2.weight.device == torch.device("cuda", 1)
    assert net(torch.randn(4, 8)).device == torch.device("cuda", 1)


def test_split_balances_parameters_shares_layers_and_rejects_too_many_stages():
    model = mlp(features=32, width=32, depth=8)
    s1, s2 = split(model, 2)
    counts = [sum(p.numel() for p in s.parameters()) for s in (s1, s2)]
    assert abs(counts[0] - counts[1]) <= 33 * 32 and s1[0] is model[0]
    assert [len(s) for s in split(model, 4)] == [4, 4, 4, 5]
    with pytest.raises(ValueError, match="cannot be cut into n_stages=4; use n_stages<=3"):
        split(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)), 4)


def test_stage_and_replica_devices_follow_the_gpu_count():
    assert stage_devices(2, gpus=1) == [torch.device("cpu")] * 2
    assert stage_devices(2, gpus=4) == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert replica_devices(0, 2, gpus=4) == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert replica_devices(1, 2, gpus=4) == [torch.device("cuda", 2), torch.device("cuda", 3)]
    assert replica_devices(3, 2, gpus=0) == [torch.device("cpu")] * 2
    with pytest.raises(ValueError, match=r"replica 1 needs cuda:2..cuda:3 but 2 GPU\(s\).*world_size<=1"):
        replica_devices(1, 2, gpus=2)


# -- timelines ------------------------------------------------------------------------
def test_timeline_busy_idle_and_plot():
    tl = Timeline()
    tl.add("a", "F0", 10.0, 11.0)
    tl.add("b", "F0", 11.0, 12.0)
    tl.add("a", "B0", 13.0, 14.0)
    assert tl.lanes == ["a", "b"] and tl.makespan == 4.0 and tl.busy("a") == 2.0
    assert tl.idle_fraction() == pytest.approx(1 - 3 / 8)
    assert tl.shifted().spans[0] == ("a", "F0", 0.0, 1.0)
    with tl.span("b", "B0"):
        sum(range(10000))
    assert tl.cpu_share is not None and 0 < tl.cpu_share <= 1.05 and Timeline().cpu_share is None
    assert tl.spans[-1][:2] == ("b", "B0") and Timeline().idle_fraction() == 0.0
    import matplotlib
    matplotlib.use("Agg")
    ax = ideal_timeline(2, 4).plot(title="ideal")
    assert ax.get_title() == "ideal" and len(ax.get_yticks()) == 2


@pytest.mark.gpu
@pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")
def test_timeline_times_cuda_spans_with_events():
    tl = Timeline()
    a = torch.randn(512, 512, device="cuda")
    with tl.span("cuda:0", "F0", "cuda:0"):
        a @ a
    assert tl.makespan > 0 and tl.lanes == ["cuda:0"]


# -- DDP over replicas that span two devices ---------------------------------------------------
def test_ddp_over_two_stage_replicas_trains_like_one_process_on_the_whole_batch():
    model = mlp(features=8, width=16, depth=4, classes=3)
    x, y = _data(12)
    ranks = launch(ddp_replica_rank, 2, split(copy.deepcopy(model), 2), x, y, nn.CrossEntropyLoss(), 3, 0.5, 0,
                   timeout=120)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for _ in range(3):
        opt.zero_grad()
        nn.CrossEntropyLoss()(ref(x), y).backward()
        opt.step()
    assert ranks[0]["devices"] == ["cpu", "cpu"]
    assert _close(ranks[0]["params"], ranks[1]["params"])
    assert _close(ranks[0]["params"], [p.detach() for p in ref.parameters()])

"""mgpu_lab.parallel.data_parallel: DataParallel's steps on CPU "devices" (and on GPUs where there are two)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mgpu_lab.parallel.data_parallel import (StepByStepDataParallel, cpu_threads, default_devices, gather,
                                             parallel_apply, scatter, time_steps, traced_step)
from mgpu_lab.parallel.timeline import Timeline

CPU2 = ["cpu", "cpu"]


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 4))


def test_scatter_matches_chunk_and_moves():
    x = torch.arange(10.0).reshape(5, 2)
    chunks = scatter(x, CPU2)
    assert [c.shape[0] for c in chunks] == [3, 2]
    assert all(torch.equal(a, b) for a, b in zip(chunks, x.chunk(2)))
    assert len(scatter(torch.zeros(2, 3), ["cpu"] * 4)) == 2  # fewer chunks than devices


def test_scatter_and_parallel_apply_errors():
    with pytest.raises(ValueError, match="devices is empty"):
        scatter(torch.zeros(3), [])
    with pytest.raises(ValueError, match="0-d tensor"):
        scatter(torch.tensor(1.0), CPU2)
    with pytest.raises(ValueError, match="2 replicas but 1 inputs"):
        parallel_apply([nn.Identity(), nn.Identity()], [torch.zeros(1)], CPU2)


def test_replicas_compute_like_the_model_and_send_gradients_back():
    model, x = _model(), torch.randn(8, 6)
    ref = copy.deepcopy(model)
    replicas = StepByStepDataParallel(model, ["cpu"] * 3).replicas()
    assert len(replicas) == 3 and all(r is not model for r in replicas)
    outs = [r(c) for r, c in zip(replicas, x.chunk(3))]
    torch.testing.assert_close(torch.cat(outs), ref(x))
    torch.cat(outs).pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_replicas_without_grad_detach():
    with torch.no_grad():
        out = StepByStepDataParallel(_model(), CPU2).replicas()[1](torch.randn(2, 6))
    assert not out.requires_grad


def test_parallel_apply_runs_threads_and_reports_errors():
    outs = parallel_apply([nn.Identity(), nn.Identity()], [torch.ones(1), torch.zeros(1)], CPU2)
    assert [o.item() for o in outs] == [1.0, 0.0]
    with pytest.raises(RuntimeError, match="replica 1 on cpu raised"):
        parallel_apply([nn.Identity(), nn.Linear(3, 3)], [torch.ones(1), torch.ones(2)], CPU2)


def test_gather_concatenates_on_the_device():
    assert torch.equal(gather([torch.ones(2), torch.zeros(1)], "cpu"), torch.tensor([1.0, 1.0, 0.0]))


def test_step_by_step_equals_plain_model_and_records_a_timeline():
    model = _model()
    ref = copy.deepcopy(model)
    tl = Timeline()
    dp = StepByStepDataParallel(model, CPU2, timeline=tl)
    x, y = torch.randn(10, 6), torch.randint(0, 4, (10,))
    torch.testing.assert_close(dp(x), ref(x))
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    loss = traced_step(dp, x, y, nn.CrossEntropyLoss(), opt, timeline=tl)
    ref_loss = traced_step(ref, x, y, nn.CrossEntropyLoss(), ref_opt)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)
    assert tl.lanes == ["cpu (replica 0)", "cpu (replica 1)"]
    phases = {s[1] for s in tl.spans}
    assert phases == {"scatter", "replicate", "forward", "gather", "loss+backward", "optimizer"}
    assert sum(s[1] == "forward" for s in tl.spans) == 4  # 2 forwards x 2 replicas
    assert set(tl.totals()) == phases


def test_one_device_is_a_pass_through():
    model = _model()
    assert torch.equal(StepByStepDataParallel(model, ["cpu"])(torch.ones(2, 6)), model(torch.ones(2, 6)))


def test_default_devices_and_time_steps():
    devices = default_devices()
    assert len(devices) >= 2
    if torch.cuda.device_count() < 2:
        assert devices == [torch.device("cpu")] * 2
    x, y = torch.randn(8, 6), torch.randint(0, 4, (8,))
    assert time_steps(_model(), x, y, steps=2, warmup=1) > 0


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_on_two_gpus_matches_nn_data_parallel():
    model = _model().cuda(0)
    x = torch.randn(10, 6, device="cuda:0")
    devices = ["cuda:0", "cuda:1"]
    ours = StepByStepDataParallel(model, devices)(x)
    torch.testing.assert_close(ours, nn.DataParallel(model, device_ids=[0, 1])(x))
    assert ours.device == torch.device("cuda", 0)
    outs = parallel_apply(StepByStepDataParallel(model, devices).replicas(), scatter(x, devices), devices)
    assert [o.device.index for o in outs] == [0, 1]


def test_cpu_threads_restores():
    before = torch.get_num_threads()
    with cpu_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="at least one thread"):
        with cpu_threads(0):
            pass

"""mgpu_lab.comm.ddp_buckets: PyTorch's bucketing, the buckets a real DDP forms, overlap and step times."""
from __future__ import annotations

import functools
import random

import matplotlib
import pytest
import torch

from mgpu_lab import launch
from mgpu_lab.comm import ddp_buckets
from mgpu_lab.comm.bucketing import torch_bucket_assignment

matplotlib.use("Agg")
pytestmark = pytest.mark.timeout(180)

CASES = [([1600, 16000, 160, 16000, 1600, 160], 20000), ([400] * 5, 800), ([400] * 5, 801), ([40, 5000, 60, 60], 100)]
_rng = random.Random(3)
CASES += [([4 * _rng.randint(1, 3000) for _ in range(_rng.randint(1, 8))], 4 * _rng.randint(1, 6000))
          for _ in range(6)]


def test_torch_buckets_fill_from_the_last_parameter_and_close_once_they_reach_the_cap():
    assert torch_bucket_assignment([400] * 5, 800) == [[4, 3], [2, 1], [0]]
    assert torch_bucket_assignment([400] * 5, 801) == [[4, 3, 2], [1, 0]]
    # 160 + 1600 + 16000 + 160 = 17920 < 20000: the next 16000 goes in, then the bucket closes
    assert torch_bucket_assignment([1600, 16000, 160, 16000, 1600, 160], 20000) == [[5, 4, 3, 2, 1], [0]]
    assert torch_bucket_assignment([], 10) == []


def test_torch_buckets_refuse_sizes_that_are_not_positive_ints():
    with pytest.raises(ValueError, match=r"param_bytes\[1\]=0 must be a positive int"):
        torch_bucket_assignment([4, 0], 10)
    with pytest.raises(ValueError, match="cap_bytes=2.5"):
        torch_bucket_assignment([4], 2.5)
    with pytest.raises(ValueError, match="multiples of 4 bytes"):
        ddp_buckets.SizedModel([6])


def _all(cases):
    model_fn = functools.partial(ddp_buckets.mlp, 64, 3)
    return {"buckets": [ddp_buckets.bucket_probe(sizes, cap, 2) for sizes, cap in cases],
            "named": ddp_buckets.named_buckets(model_fn, 0.02),
            "overlap": ddp_buckets.overlap_probe(model_fn, 0.02, 16, 2),
            "steps": ddp_buckets.step_time_probe(model_fn, [0.02, 25], 16, 2),
            "side by side": ddp_buckets.side_by_side_probe(_AtTheEnd, model_fn, 0.02, 8, 3)}


class _AtTheEnd(torch.nn.Module):
    """The plainest data parallelism: every gradient all-reduced on its own, after backward."""

    def __init__(self, module, cap_bytes):
        super().__init__()
        self.module = module
        for p in module.parameters():
            torch.distributed.broadcast(p.detach(), 0)

    def forward(self, x):
        return self.module(x)

    def finish_gradient_sync(self):
        for p in self.module.parameters():
            torch.distributed.all_reduce(p.grad)
            p.grad /= torch.distributed.get_world_size()


@pytest.fixture(scope="module")
def two():
    return launch(_all, 2, CASES)


def test_a_real_ddp_puts_everything_in_one_bucket_first_then_rebuilds_as_pytorch_assigns(two):
    for (sizes, cap), (first, second) in zip(CASES, two[0]["buckets"]):
        assert first == [list(range(len(sizes)))]
        assert second == torch_bucket_assignment(sizes, cap), (sizes, cap)


def test_named_buckets_start_at_the_classifier(two):
    steps = two[0]["named"]["steps"]
    assert len(steps[0]) == 1 and len(steps[1]) > 1
    assert steps[1][0][:2] == ["6.bias", "6.weight"]
    assert sorted(n for b in steps[1] for n in b) == sorted(two[0]["named"]["bytes"])


def test_overlap_has_every_layer_and_bucket_inside_backward(two):
    for rank, res in enumerate(two):
        ov = res["overlap"]
        assert ov["rank"] == rank
        assert sorted(label for label, *_ in ov["compute"]) == ["layer 0", "layer 2", "layer 4", "layer 6"]
        assert len(ov["comm"]) > 1
        assert all(0 <= a <= b <= ov["backward"] for _, a, b, *_ in ov["compute"] + ov["comm"])
    ax = ddp_buckets.plot_overlap([res["overlap"] for res in two])
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0 backward", "rank 0 all-reduce",
                                                            "rank 1 backward", "rank 1 all-reduce"]


def test_step_times_come_with_ddps_own_bucket_sizes(two):
    steps = two[0]["steps"]
    assert steps[0.02]["seconds"] > 0 and steps[25]["seconds"] > 0
    assert len(steps[0.02]["buckets"].split(",")) > 1 and len(steps[25]["buckets"].split(",")) == 1


def test_a_home_made_ddp_trains_side_by_side_with_ddp(two):
    for res in two:
        side = res["side by side"]
        assert side["losses"]["DDP"] == pytest.approx(side["losses"]["yours"], abs=1e-5)
        assert side["largest weight difference"] < 1e-5
        assert side["all-reduces per step"] == [8, 8, 8]  # 4 layers, weight and bias each: one per gradient

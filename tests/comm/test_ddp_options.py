"""mgpu_lab.comm.ddp_options in real ranks: unused parameters, no_sync, bucket views, batch statistics."""
from __future__ import annotations

import pytest
import torch

from mgpu_lab import launch
from mgpu_lab.comm import ddp_options

pytestmark = pytest.mark.timeout(120)


def _both():
    return {"options": ddp_options.options_probe(), "bn": ddp_options.batchnorm_probe()}


@pytest.fixture(scope="module")
def two():
    return launch(_both, 2, backend="gloo")


def test_an_unused_parameter_fails_by_default_and_both_fixes_train(two):
    unused = two[0]["options"]["unused"]
    assert unused["default"] == "Expected to have finished reduction in the prior iteration before starting a new one."
    for option in ("find_unused_parameters", "static_graph"):
        assert unused[option] == {"ok": True, "b.weight.grad": None, "a.weight.grad": "set"}


def test_no_sync_leaves_one_all_reduce_per_accumulated_step(two):
    assert two[0]["options"]["no_sync"] == {"plain": 4, "no_sync": 1}


def test_bucket_views_put_the_gradients_into_as_many_blocks_as_buckets(two):
    views = two[0]["options"]["views"]
    assert views["False"]["grad storages"] == views["False"]["parameters"] == 6
    assert views["True"]["grad storages"] < 6


def test_batch_statistics_synced_by_sums_equal_the_whole_batch(two):
    for r, res in enumerate(two):
        bn = res["bn"]
        torch.testing.assert_close(torch.tensor(bn["synced_mean"]), torch.tensor(bn["global_mean"]))
        torch.testing.assert_close(torch.tensor(bn["synced_var"]), torch.tensor(bn["global_var"]))
        assert abs(bn["local_mean"][0] - 2.0 * r) < 0.5  # rank r's data sits around 2r
        assert bn["sync_bn"].startswith("ValueError: SyncBatchNorm expected input tensor to be on GPU")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (NCCL, one per rank)")
def test_on_gpus_the_real_sync_batchnorm_keeps_the_global_mean():
    res = launch(ddp_options.batchnorm_probe, 2)
    for bn in res:
        torch.testing.assert_close(torch.tensor(bn["sync_bn"]), torch.tensor(bn["global_mean"]))

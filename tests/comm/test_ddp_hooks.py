"""mgpu_lab.comm.ddp_hooks in real ranks: communication hooks' bytes and losses, compile graphs, throughput."""
from __future__ import annotations

import functools

import pytest
import torch

from mgpu_lab import launch
from mgpu_lab.comm import ddp_buckets, ddp_hooks

pytestmark = pytest.mark.timeout(240)


def _hooks_and_throughput():
    return {"hooks": ddp_hooks.hooks_probe(steps=6, batch=8),
            "throughput": ddp_hooks.throughput_probe(functools.partial(ddp_buckets.mlp, 32, 2), 8, 2),
            "compiled": ddp_hooks.compile_probe(1.0, width=512, depth=2),
            "sequential": ddp_hooks.compile_probe(1.0, width=512, depth=2, model="sequential")}


@pytest.fixture(scope="module")
def two():
    return launch(_hooks_and_throughput, 2, backend="gloo")


def test_bf16_halves_the_bytes_and_powersgd_sends_far_fewer(two):
    hooks = two[0]["hooks"]
    full = hooks["fp32"]["bytes per step"]
    assert full == hooks["gradient bytes"]
    assert hooks["bf16"]["bytes per step"] == full // 2
    assert 0 < hooks["powerSGD"]["bytes per step"] < full // 4
    assert hooks["fp32"]["losses"][0] == hooks["bf16"]["losses"][0] == hooks["powerSGD"]["losses"][0]
    assert abs(hooks["bf16"]["losses"][-1] - hooks["fp32"]["losses"][-1]) < 1e-2
    assert hooks["powerSGD"]["losses"][-1] != hooks["fp32"]["losses"][-1]


def test_throughput_counts_every_ranks_samples(two):
    for res in two:
        t = res["throughput"]
        assert t["device"] == "cpu" and t["samples per second"] == pytest.approx(2 * 8 / t["seconds per step"])
        assert 0 < t["cpu share"] <= 4  # the rank process: its compute thread and gloo's
    assert two[0]["throughput"]["seconds per step"] == two[1]["throughput"]["seconds per step"]  # the max
    assert two[0]["throughput"]["cpu share"] == two[1]["throughput"]["cpu share"]  # the min


def test_a_model_of_its_own_class_compiles_the_same_graphs_either_way_one_per_bucket(two):
    compiled = two[0]["compiled"]  # mlp(512, 2): two 1 MiB layers and a classifier, cap 1 MiB: 2 buckets
    assert compiled["wrapped first"] == {"graphs": [2, 3], "buckets": [1.022, 1.002]}
    assert compiled["compiled first"] == {"graphs": [2, 3], "buckets": [1.022, 1.002]}
    assert compiled["same gradients"] is True


def test_nn_sequential_wrapped_first_gets_no_graph_and_compiled_first_one_per_bucket_from_torch_2_12(two):
    from torch.torch_version import TorchVersion

    compiled = two[0]["sequential"]
    assert compiled["wrapped first"] == {"graphs": [], "buckets": [1.022, 1.002]}
    # torch 2.11 does not trace nn.Sequential's forward from the top either way (measured on 2.11.0 and 2.14.1;
    # 2.12 and 2.13 not run)
    graphs = [2, 3] if TorchVersion(torch.__version__) >= (2, 12) else []
    assert compiled["compiled first"] == {"graphs": graphs, "buckets": [1.022, 1.002]}
    assert compiled["same gradients"] is True


def test_compile_probe_names_the_model_kinds_it_knows():
    with pytest.raises(ValueError, match="'own class'"):
        ddp_hooks.compile_probe(1.0, model="transformer")


def test_ddpoptimizer_refuses_a_cap_below_its_own_1_mib_first_bucket():
    compiled = launch(ddp_hooks.compile_probe, 2, 0.5, 64, 1)[0]
    assert compiled["compiled first"]["graphs"].startswith("AssertionError: First bucket should be smaller")


def test_single_process_throughput_needs_cuda_and_says_so():
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the error path needs a machine without one")
    with pytest.raises(RuntimeError, match=r"needs CUDA GPUs \[0\]; 0 visible"):
        ddp_hooks.single_process_throughput(torch.nn.Linear, 8, [0])


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_on_gpus_dataparallel_and_one_gpu_give_a_throughput():
    mlp = functools.partial(ddp_buckets.mlp, 64, 2)
    assert ddp_hooks.single_process_throughput(mlp, 32, [0], 2) > 0
    assert ddp_hooks.single_process_throughput(mlp, 64, [0, 1], 2) > 0

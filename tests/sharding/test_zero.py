"""mgpu_lab.sharding.zero (ZeRO formula, bytes held, ZeRO by hand), in real ranks on the CPU."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from mgpu_lab import launch
from mgpu_lab.comm.record import record, summarize
from mgpu_lab.sharding.fsdp import BlockNet, batch, train_steps
from mgpu_lab.sharding.flat import FlatZero
from mgpu_lab.sharding.zero import held_bytes, shard_size, zero_memory

pytestmark = pytest.mark.timeout(300)


# -- the formula -------------------------------------------------------------------------------
@pytest.mark.parametrize("args, expected", [
    ((1000, 4, 0), 16000), ((1000, 4, 1), 1000 * 8 + 250 * 8), ((1000, 4, 2), 1000 * 4 + 250 * 12),
    ((1000, 4, 3), 250 * 16), ((10, 4, 3), 3 * 16), ((10, 4, 1, 2, 2, 12), 10 * 4 + 3 * 12), ((7, 1, 3), 7 * 16),
])
def test_zero_memory_is_the_zero_papers_formula_with_shards_rounded_up(args, expected):
    got = zero_memory(*args)
    assert got == expected and type(got) is int


@pytest.mark.parametrize("args, match", [
    ((10, 4, 4), r"stage=4: ZeRO has stages 0 \(DDP\), 1, 2 and 3"), ((10, 4, True), "stage=True"),
    ((0, 4, 1), "n_params=0 must be a positive int"), ((10, -2, 1), "world_size=-2"),
    ((10, 4, 1, 4, 0), "grad_bytes=0"), ((10.0, 4, 1), r"n_params=10\.0"),
])
def test_zero_memory_rejects_bad_stages_and_sizes_naming_the_value(args, match):
    with pytest.raises(ValueError, match=match):
        zero_memory(*args)


def test_shard_size_rounds_up():
    assert [shard_size(n, 4) for n in (1, 4, 5, 8, 9)] == [1, 1, 2, 2, 3]


def test_held_bytes_counts_16_bytes_a_parameter_with_adam_and_each_storage_once():
    model = nn.Linear(10, 10)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 10)).sum().backward()
    optimizer.step()
    assert held_bytes(model, optimizer) == {"params": 440, "grads": 440, "optimizer": 880, "total": 1760}
    flat = torch.zeros(110)
    model.weight.data, model.bias.data = flat[:100].view(10, 10), flat[100:]  # views of one buffer: counted once
    assert held_bytes(model)["params"] == 440


def test_flat_zero_refuses_stage_3_and_says_where_it_is():
    with pytest.raises(ValueError, match="stage 3 is FSDP"):
        FlatZero(nn.Linear(2, 2), 3, torch.optim.SGD)


# -- in 3 real ranks ---------------------------------------------------------------------------
def _in_ranks():
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = {}
    x, y = batch(12, 8)
    adam = lambda ps: torch.optim.Adam(ps, lr=1e-2)  # noqa: E731
    model = BlockNet(width=10, depth=2)
    net = DDP(model, gradient_as_bucket_view=True)
    opt = adam(net.parameters())
    train_steps(net, opt, x, y, 3)
    out["ddp"] = {k: v.detach().clone() for k, v in model.named_parameters()}
    out["ddp_held"] = held_bytes(model, opt)["total"]
    for stage in (0, 1, 2):
        model = BlockNet(width=10, depth=2)
        zero = FlatZero(model, stage, adam)
        with record() as log:
            train_steps(model, zero, x, y, 3)
        out[f"zero{stage}"] = {k: v.detach().clone() for k, v in model.named_parameters()}
        out[f"zero{stage}_held"] = held_bytes(model, zero.optimizer)
        out[f"zero{stage}_log"] = summarize(log, "numel")
    return out


@pytest.fixture(scope="module")
def ranks():
    return launch(_in_ranks, 3)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_flat_zero_trains_like_ddp_and_holds_what_the_formula_says(ranks, stage):
    n = BlockNet.count(width=10, depth=2)  # 343: padded to 345 on 3 ranks
    for r in ranks:
        for name, ref in r["ddp"].items():
            assert torch.allclose(r[f"zero{stage}"][name], ref, atol=1e-6), name
        held = r[f"zero{stage}_held"]
        assert zero_memory(n, 3, stage) <= held["total"] <= zero_memory(n, 3, stage) + 16 * 2
        assert r["ddp_held"] == zero_memory(n, 3, 0)
    moved = ranks[0][f"zero{stage}_log"]
    assert moved == ({"all_reduce": 3 * n} if stage == 0 else {"reduce_scatter": 3 * 345, "all_gather": 3 * 345})
    if stage == 2:
        assert ranks[0]["zero2_held"]["grads"] == 4 * 115  # only the gradient shard survives the step

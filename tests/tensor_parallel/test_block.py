"""mgpu_lab.tensor_parallel.block and .plans: the lesson's block split over real ranks equals one process."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from mgpu_lab import LaunchError, launch
from mgpu_lab.tensor_parallel.block import Attention, Block, Stack, batch, make_mesh_2d
from mgpu_lab.tensor_parallel.plans import block_plan, shard_2d

pytestmark = pytest.mark.timeout(180)


def test_heads_must_divide_the_width_and_the_error_says_so():
    with pytest.raises(ValueError, match="heads=3 must divide dim=16"):
        Attention(16, 3)
    assert Stack(depth=3, dim=8, heads=2, hidden=16).blocks[2](torch.randn(1, 2, 8)).shape == (1, 2, 8)


def _tp_block(sp: bool, heads: int = 4):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from mgpu_lab.comm.record import record, summarize

    world, rank = dist.get_world_size(), dist.get_rank()
    ref = Block(16, heads, 32)
    block = parallelize_module(copy.deepcopy(ref), init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)),
                               block_plan(ref, sp))
    x, y = batch(2, 8, 16)
    xs, ys = (v.chunk(world, dim=1)[rank] for v in (x, y)) if sp else (x, y)
    with record() as fwd:
        out = block(xs)
    with record() as bwd:
        (out - ys).square().sum().backward()
    (ref(x) - y).square().sum().backward()
    want = ref(x).chunk(world, dim=1)[rank] if sp else ref(x)
    grads = max(float(((p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
                       - dict(ref.named_parameters())[n].grad).abs().max()) for n, p in block.named_parameters())
    return float((out - want).abs().max()), grads, summarize(fwd), summarize(bwd, "bytes")


@pytest.mark.parametrize("sp", [False, True])
def test_the_plan_splits_the_block_over_two_ranks_like_one_process_with_two_collectives_a_direction(sp):
    out, grads, fwd, bwd = launch(_tp_block, 2, sp)[0]
    assert out < 1e-5 and grads < 1e-4
    activation = 2 * 8 * 16 * 4  # bytes of the block's whole fp32 input, what each collective is counted by
    if sp:
        assert fwd == {"all_gather": 2, "reduce_scatter": 2, "wait": 4}
        assert bwd["all_gather"] + bwd["reduce_scatter"] == 4 * activation
    else:
        assert fwd == {"all_reduce": 2, "wait": 2}
        assert bwd["all_reduce"] == 2 * activation


def test_heads_that_do_not_divide_over_the_tp_ranks_fail_with_the_reason():
    with pytest.raises(LaunchError, match="number of heads must be divisible by the TP degree"):
        launch(_tp_block, 2, False, 1)


def _two_d():
    mesh = make_mesh_2d(2, 2)
    ref = Stack(2, 16, 4, 32)
    model = shard_2d(copy.deepcopy(ref), mesh)
    d, t = mesh.get_coordinate()
    x, y = batch(4, 8, 16)
    xs, ys = (v.chunk(2)[d].chunk(2, dim=1)[t] for v in (x, y))
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        ((model(xs) - ys).square().sum() / (x.numel() / 2)).backward()
        opt.step()
        ref_opt.zero_grad()
        (ref(x) - y).square().mean().backward()
        ref_opt.step()
    meshes = {p.device_mesh.mesh_dim_names for p in model.parameters()}
    return meshes, max(float((p.full_tensor() - dict(ref.named_parameters())[n]).abs().max())
                       for n, p in model.named_parameters())


def test_tp_then_fsdp_on_a_2d_mesh_trains_like_one_process_and_every_parameter_lives_on_both_dimensions():
    meshes, diff = launch(_two_d, 4)[0]
    assert meshes == {("dp", "tp")} and diff < 1e-6


def _wrong_mesh():
    make_mesh_2d(3, 1)


def test_a_2d_mesh_that_does_not_cover_the_world_says_the_sizes():
    with pytest.raises(LaunchError, match=r"dp=3 x tp=1 = 3 ranks, but the world has 2"):
        launch(_wrong_mesh, 2)


def test_the_plan_is_for_the_lesson_s_block_and_says_so_for_another_module():
    with pytest.raises(ValueError, match="the block has no submodule 'attn'"):
        block_plan(torch.nn.Linear(2, 2), sequence_parallel=False)

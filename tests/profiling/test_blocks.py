"""mgpu_lab.profiling.blocks: what autograd saves from a transformer block matches the formula."""
from __future__ import annotations

import pytest
import torch

from mgpu_lab.course.checks.l13.ranks import reference_saved_bytes  # the check's own count (tests may use it)
from mgpu_lab.profiling import blocks


@pytest.mark.parametrize("batch, seq, dim, heads, ratio", [(2, 8, 16, 2, 4), (3, 5, 32, 4, 2), (1, 16, 24, 3, 1),
                                                            (4, 7, 40, 5, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_counted_saved_bytes_of_a_block_match_the_formula(batch, seq, dim, heads, ratio, dtype):
    model = torch.nn.Sequential(blocks.Block(dim, heads, ratio).to(dtype))
    counted = reference_saved_bytes(model, blocks.tokens(batch, seq, dim, dtype=dtype))["0"]
    assert counted == (blocks.block_activation_bytes(batch, seq, dim, heads, ratio, dtype)
                       + blocks.block_weight_bytes(dim, ratio, dtype))


def test_a_stack_s_blocks_each_save_their_own_share_and_it_grows_linearly_with_the_sequence():
    model = blocks.BlockStack(dim=32, heads=4, ratios=(4, 2))
    short, long = (reference_saved_bytes(model.blocks, blocks.tokens(2, s, 32)) for s in (16, 32))
    for name, ratio in (("0", 4), ("1", 2)):
        weights = blocks.block_weight_bytes(32, ratio)
        assert short[name] == blocks.block_activation_bytes(2, 16, 32, 4, ratio) + weights
        assert long[name] - weights == 2 * (short[name] - weights)  # no seq x seq term


def test_a_width_that_the_heads_do_not_divide_is_refused():
    with pytest.raises(ValueError, match="multiple of heads=3"):
        blocks.Block(32, 3)


def test_the_matmul_policy_saves_products_and_recomputes_the_rest():
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten
    assert blocks.matmul_policy(None, aten.addmm.default) is CheckpointPolicy.MUST_SAVE
    assert blocks.matmul_policy(None, aten.gelu.default) is CheckpointPolicy.PREFER_RECOMPUTE

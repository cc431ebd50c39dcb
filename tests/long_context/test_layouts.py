"""Contiguous and zig-zag shards of a sequence (mgpu_lab.long_context.layout), and their errors."""
from __future__ import annotations

import pytest
import torch

from mgpu_lab.long_context.layout import chunks_of, layout_table, shard, unshard


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_the_shards_put_back_together_are_the_sequence(layout, world):
    x = torch.randn(2, 3, 8 * world, 5)
    shards = [shard(x, r, world, layout) for r in range(world)]
    assert all(s.shape == (2, 3, 8, 5) for s in shards)
    assert torch.equal(unshard(shards, layout), x)


def test_zigzag_gives_rank_r_chunks_r_and_2w_minus_1_minus_r_in_that_order():
    pos = torch.arange(16)
    assert [chunks_of(r, 4, "zigzag") for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert shard(pos, 1, 4, "zigzag", dim=0).tolist() == [2, 3, 12, 13]
    assert shard(pos, 3, 4, "contiguous", dim=0).tolist() == [12, 13, 14, 15]
    assert "zigzag      0-1, 14-15" in layout_table(16, 4)


def test_errors_say_what_and_the_fix():
    with pytest.raises(ValueError, match="layout='ring': use one of"):
        chunks_of(0, 2, "ring")
    with pytest.raises(ValueError, match="rank=2 is not one of the 2 ranks"):
        chunks_of(2, 2, "zigzag")
    with pytest.raises(ValueError, match="does not split into 4 equal chunks .* pad it to a multiple of 4"):
        shard(torch.arange(6), 0, 2, "zigzag", dim=0)

"""mgpu_lab.experts.measure.exchange_bytes and bytes_table on real ranks, with a layer whose traffic is known:
every token to the next rank and back, after an all-to-all of counts."""
from __future__ import annotations

import pytest

from mgpu_lab.experts.measure import bytes_table, exchange_bytes


def next_rank_layer(x, router_weight, experts, top_k, capacity):
    """Not a mixture of experts: each of the T x top_k rows goes to the next rank and comes back unchanged."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    rows = x.repeat_interleave(top_k, dim=0)
    send = [0] * world
    send[(rank + 1) % world] = rows.shape[0]
    counts = torch.empty(world, dtype=torch.long)
    dist.all_to_all_single(counts, torch.tensor(send))
    there = rows.new_empty(int(counts.sum()), rows.shape[1])
    dist.all_to_all_single(there, rows, counts.tolist(), send)
    back = rows.new_empty(rows.shape)
    dist.all_to_all_single(back, there, send, counts.tolist())
    return back.view(x.shape[0], top_k, -1).sum(1)


def test_token_bytes_are_rows_out_and_back_and_counts_are_the_rest():
    rows = exchange_bytes(next_rank_layer, world=2, tokens=(4, 8), top_ks=(1, 3), n_experts=4, d=16)
    assert [(r["tokens"], r["top_k"]) for r in rows] == [(4, 1), (8, 1), (4, 3), (8, 3)]
    for r in rows:
        assert r["calls"] == 3 and r["other_bytes"] == 2 * 8  # two int64 counts
        assert r["token_bytes"] == 2 * r["tokens"] * r["top_k"] * 16 * 4
    table = bytes_table(rows).splitlines()
    assert table[0].split()[:2] == ["tokens", "top_k"] and table[4].split() == ["8", "3", "3", "3072", "3072", "16"]


def test_experts_that_do_not_divide_among_the_ranks_say_so():
    with pytest.raises(ValueError, match="n_experts=6 on world=4 ranks.*multiple of 4"):
        exchange_bytes(next_rank_layer, world=4, n_experts=6)

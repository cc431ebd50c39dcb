"""All-gather context parallelism (Llama 3's choice): gather every rank's K and V, attend locally.

Each rank keeps its own queries and all-gathers the keys and values of the whole sequence,
then attends its rows to all of them, masking by the rows' positions in the sequence when
causal. Simple: one all-gather of K and V per layer, which can start as soon as they are projected
(Llama 3 leaves it exposed: with grouped-query attention K and V are small next to Q); its price
is that every rank holds the whole sequence's K and V (``2 B H S D`` elements, growing with ``S``
whatever the CP degree) and, when causal, an ``S/W x S`` mask shared by every head
(boolean, plus the float copy ``scaled_dot_product_attention`` makes of it on the CPU).

Example:
    >>> from mgpu_lab import launch
    >>> from mgpu_lab.long_context.layout import shard
    >>> def rank_part():
    ...     q = torch.randn(1, 2, 8, 4, generator=torch.Generator().manual_seed(0))
    ...     mine = shard(q, tdist.get_rank(), 2, "zigzag")
    ...     got = allgather_attention(mine, mine, mine, causal=True, layout="zigzag")
    ...     want = shard(F.scaled_dot_product_attention(q, q, q, is_causal=True), tdist.get_rank(), 2, "zigzag")
    ...     return torch.allclose(got, want, atol=1e-6)
    >>> launch(rank_part, 2)
    launch: 2 ranks · ...
    [True, True]
"""
from __future__ import annotations

import torch
import torch.distributed as tdist
import torch.nn.functional as F

from .layout import shard, unshard

__all__ = ["allgather_attention"]


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                        layout: str = "contiguous") -> torch.Tensor:
    """This rank's rows of attention over the whole sequence, K and V all-gathered.

    Args:
        q, k, v: this rank's shards ``(B, H, S/W, D)`` of the sequence, in ``layout``.
        causal: each position attends to itself and the positions before it only.
        layout: ``"contiguous"`` or ``"zigzag"`` (:mod:`.layout`).

    Returns:
        This rank's rows of the attention, ``(B, H, S/W, D)``, in ``layout``.
    """
    world, rank = tdist.get_world_size(), tdist.get_rank()
    keys, values = [torch.empty_like(k) for _ in range(world)], [torch.empty_like(v) for _ in range(world)]
    tdist.all_gather(keys, k.contiguous())
    tdist.all_gather(values, v.contiguous())
    k_all, v_all = unshard(keys, layout), unshard(values, layout)
    mask = None
    if causal:
        everywhere = torch.arange(k_all.shape[-2], device=q.device)
        mine = shard(everywhere, rank, world, layout, dim=0)
        mask = mine[:, None] >= everywhere[None, :]
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)

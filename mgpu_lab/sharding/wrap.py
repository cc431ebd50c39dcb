"""FSDP2 applied to a model: ``fully_shard`` on every block, then the root (lesson 08).

:func:`shard_model` is what ``scripts/fsdp_train.py`` and lesson 08's measurements
(:mod:`mgpu_lab.sharding.side_by_side`) shard with.

Example:
    >>> from mgpu_lab import launch
    >>> from mgpu_lab.sharding.fsdp import BlockNet, make_mesh
    >>> def sharded():                              # in every rank
    ...     model = shard_model(BlockNet(), make_mesh())
    ...     return type(model.blocks[0][0].weight).__name__
    >>> launch(sharded, 2)
    launch: 2 ranks · ...
    ['DTensor', 'DTensor']
"""
from __future__ import annotations

from torch import nn

__all__ = ["shard_model"]


def shard_model(model: nn.Module, mesh, **fully_shard_kwargs) -> nn.Module:
    """``fully_shard`` every block of ``model.blocks``, then the root; returns ``model``.

    Bottom-up: each block becomes a group of its own (all-gathered on its own
    just before it runs), and the root's call groups what is left (the input
    layer and the head). Keyword arguments (``reshard_after_forward``,
    ``mp_policy``, ...) go to every call.
    """
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh, **fully_shard_kwargs)
    fully_shard(model, mesh=mesh, **fully_shard_kwargs)
    return model

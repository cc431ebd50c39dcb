"""Tensor-parallel plans for lesson 11's :class:`~mgpu_lab.tensor_parallel.block.Block` and the 2D wrap.

``scripts/tp_train.py`` trains with them; the course's checks and the tests use them.

- :func:`block_plan`: ``wq``, ``wk``, ``wv`` and ``fc1`` split by columns, ``wo`` and
  ``fc2`` by rows; ``PrepareModuleInput`` on ``attn`` and ``mlp`` makes each take one
  DTensor input, so the three projections share one backward all-reduce (without it
  each of ``wq``, ``wk``, ``wv`` all-reduces the gradient of the same input). With
  sequence parallelism the norms run on this rank's slice of the sequence
  (``SequenceParallel``), ``attn``/``mlp`` all-gather it, ``wo``/``fc2`` reduce-scatter.
- :func:`shard_2d`: TP over ``mesh["tp"]`` inside every block, then ``fully_shard``
  over ``mesh["dp"]`` block by block and the root (FSDP shards what TP left: the other
  order fails, a DTensor of the "dp" mesh cannot be redistributed onto "tp").
"""
from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

__all__ = ["block_plan", "shard_2d"]


def block_plan(block: nn.Module, sequence_parallel: bool) -> dict:
    """The ``parallelize_module`` plan of a :class:`~mgpu_lab.tensor_parallel.block.Block`.

    Args:
        block: the block (its submodule names are the plan's keys).
        sequence_parallel: the block's input and output are this rank's slice of the
            sequence (dim 1) instead of the whole activation.

    Returns:
        ``{submodule name: ParallelStyle}``.

    Example:
        >>> from mgpu_lab.tensor_parallel.block import Block
        >>> sorted(block_plan(Block(), sequence_parallel=True))
        ['attn', 'attn.wk', 'attn.wo', 'attn.wq', 'attn.wv', 'mlp', 'mlp.fc1', 'mlp.fc2', 'norm1', 'norm2']
    """
    layout = Shard(1) if sequence_parallel else Replicate()
    plan = {}
    for part, (*cols, row) in (("attn", ("wq", "wk", "wv", "wo")), ("mlp", ("fc1", "fc2"))):
        if not hasattr(block, part):
            raise ValueError(f"the block has no submodule {part!r}: block_plan is for lesson 11's Block")
        plan[part] = PrepareModuleInput(input_layouts=(layout,), desired_input_layouts=(Replicate(),))
        plan.update({f"{part}.{name}": ColwiseParallel() for name in cols})
        plan[f"{part}.{row}"] = RowwiseParallel(output_layouts=layout)
    if sequence_parallel:
        plan.update(norm1=SequenceParallel(), norm2=SequenceParallel())
    return plan


def shard_2d(model: nn.Module, mesh) -> nn.Module:
    """TP (with sequence parallelism) over ``mesh["tp"]`` in every block of ``model.blocks``, then FSDP over "dp".

    The model's input and output are then this rank's slice of its DP group's batch and of
    the sequence (dim 1) among its TP group.

    Args:
        model: a :class:`~mgpu_lab.tensor_parallel.block.Stack` (blocks in ``model.blocks``).
        mesh: a 2D DeviceMesh named ``("dp", "tp")``.

    Returns:
        ``model``, changed in place: every parameter a DTensor on both mesh dimensions.

    Example:
        >>> from mgpu_lab import launch
        >>> from mgpu_lab.tensor_parallel.block import Stack, make_mesh_2d
        >>> def placements():
        ...     model = shard_2d(Stack(depth=1), make_mesh_2d(2, 2))
        ...     wq, norm = model.blocks[0].attn.wq.weight, model.blocks[0].norm1.weight
        ...     return [[type(p).__name__ for p in w.placements] for w in (wq, norm)]   # over ("dp", "tp")
        >>> launch(placements, 4)[0]   # FSDP's shard over "dp" is a slice of TP's slice: a strided shard
        launch: 4 ranks · ...
        [['_StridedShard', 'Shard'], ['Shard', 'Replicate']]
    """
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        parallelize_module(block, mesh["tp"], block_plan(block, sequence_parallel=True))
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model

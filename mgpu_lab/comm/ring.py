"""A ring all-reduce built from isend/irecv: reduce-scatter, then all-gather, one chunk per step.

``bench/collectives.py`` times it against ``dist.all_reduce`` (through
:func:`mgpu_lab.comm.cost_model.time_ops`); the course's checks and the library's tests use it.

Example:
    >>> from mgpu_lab import launch
    >>> launch(lambda: all_reduce(torch.arange(3.0) * (tdist.get_rank() + 1)).tolist(), 2)[0]
    launch: 2 ranks · ...
    [0.0, 3.0, 6.0]
"""
from __future__ import annotations

import torch
import torch.distributed as tdist

__all__ = ["all_reduce"]


def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of ``tensor`` over all ranks, by isend/irecv around a ring.

    The flat tensor is cut into ``world_size`` chunks (``tensor_split``: any size
    works). Reduce-scatter: in ``W - 1`` steps every rank passes one chunk to its
    right neighbour and adds the chunk coming from its left, so that rank ``r``
    ends with the full sum of chunk ``r + 1``. All-gather: ``W - 1`` more steps
    pass the finished chunks around. Each rank sends ``2 (W - 1) / W`` of the tensor.

    Args:
        tensor: this rank's tensor (any shape, on this rank's device).

    Returns:
        A new tensor of the same shape: the element-wise sum over ranks.
    """
    rank, world = tdist.get_rank(), tdist.get_world_size()
    flat = tensor.detach().reshape(-1).clone()
    chunks = list(flat.tensor_split(world))  # views into flat
    right, left = (rank + 1) % world, (rank - 1) % world
    for step in range(world - 1):  # reduce-scatter
        send_i, recv_i = (rank - step) % world, (rank - step - 1) % world
        incoming = torch.empty_like(chunks[recv_i])
        reqs = [tdist.isend(chunks[send_i], right), tdist.irecv(incoming, left)]
        for req in reqs:
            req.wait()
        chunks[recv_i] += incoming
    for step in range(world - 1):  # all-gather: pass the finished chunks on
        send_i, recv_i = (rank + 1 - step) % world, (rank - step) % world
        reqs = [tdist.isend(chunks[send_i], right), tdist.irecv(chunks[recv_i], left)]
        for req in reqs:
            req.wait()
    return flat.view_as(tensor)

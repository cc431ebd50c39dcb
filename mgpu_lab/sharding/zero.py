"""ZeRO's accounting: what a rank holds, and the formula for it.

Lesson 08's library: the memory formula of ZeRO stages 0-3 (:func:`zero_memory`)
and the bytes a rank really holds, counted from the storages of its tensors
(:func:`held_bytes`). FSDP2 (stage 3) is in :mod:`mgpu_lab.sharding.fsdp`.

Example:
    >>> zero_memory(1_000_000, 4, stage=0) / 2**20     # DDP: 16 bytes a parameter, on every rank
    15.2587890625
    >>> zero_memory(1_000_000, 4, stage=3) / 2**20     # ZeRO-3 / FSDP: a quarter of it
    3.814697265625
"""
from __future__ import annotations


import torch
from torch import nn

__all__ = ["zero_memory", "shard_size", "held_bytes", "local"]


def _positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int")


def shard_size(n: int, world_size: int) -> int:
    """Elements of one rank's shard: ``ceil(n / world_size)`` (the last shards are padded).

    Example:
        >>> shard_size(10, 4)
        3
    """
    return -(-n // world_size)


def zero_memory(n_params: int, world_size: int, stage: int, param_bytes: int = 4, grad_bytes: int = 4,
                optim_bytes: int = 8) -> int:
    """Bytes of parameters, gradients and optimizer state one rank holds under ZeRO ``stage``.

    Stage 0 is DDP (everything on every rank); stage 1 shards the optimizer state,
    stage 2 the gradients too, stage 3 the parameters too (FSDP). A shard is
    ``ceil(n_params / world_size)`` elements.

    Args:
        n_params: parameters of the model.
        world_size: ranks sharing the shards.
        stage: 0, 1, 2 or 3.
        param_bytes, grad_bytes, optim_bytes: bytes per parameter of each kind
            (fp32 Adam: 4, 4, 8; mixed precision: 2, 2, 12 with the fp32 master copy).

    Raises:
        ValueError: a stage outside 0..3, or a size that is not a positive int.

    Example:
        >>> zero_memory(10, 4, 1)      # 10 x (4 + 4) + 3 x 8
        104
    """
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ValueError(f"stage={stage!r}: ZeRO has stages 0 (DDP), 1, 2 and 3")
    for name, value in (("n_params", n_params), ("world_size", world_size), ("param_bytes", param_bytes),
                        ("grad_bytes", grad_bytes), ("optim_bytes", optim_bytes)):
        _positive(name, value)
    shard = shard_size(n_params, world_size)
    p = n_params if stage < 3 else shard
    g = n_params if stage < 2 else shard
    o = n_params if stage < 1 else shard
    return p * param_bytes + g * grad_bytes + o * optim_bytes


def local(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this rank holds: ``t.to_local()`` for a DTensor, ``t`` itself otherwise."""
    return t.to_local() if hasattr(t, "to_local") else t


def held_bytes(model: nn.Module, optimizer=None) -> dict:
    """The bytes this rank's tensors occupy: parameters, gradients, optimizer state.

    Counted from storages (``untyped_storage().nbytes()``), each storage once: a
    view into a flat buffer counts the buffer, a DTensor counts its local shard
    (with the padding FSDP2 keeps). The optimizer's zero-dimensional tensors
    (Adam's ``step`` counters) are left out, as in the ZeRO formula.

    Returns:
        ``{"params": .., "grads": .., "optimizer": .., "total": ..}`` in bytes.

    Example:
        >>> model = nn.Linear(10, 10); opt = torch.optim.Adam(model.parameters())
        >>> model(torch.ones(1, 10)).sum().backward(); opt.step()
        >>> held_bytes(model, opt)["total"]            # 110 parameters x 16 bytes
        1760
    """
    seen: set = set()
    out = {"params": 0, "grads": 0, "optimizer": 0}

    def add(kind: str, t) -> None:
        if not isinstance(t, torch.Tensor):
            return
        storage = local(t).untyped_storage()
        key = (storage.data_ptr(), str(local(t).device))
        if storage.nbytes() and key not in seen:
            seen.add(key)
            out[kind] += storage.nbytes()

    params = list(model.parameters())
    if optimizer is not None:
        params += [p for group in optimizer.param_groups for p in group["params"]]
    for p in params:
        add("params", p)
    for p in params:
        add("grads", p.grad)
    if optimizer is not None:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    add("optimizer", value)
    out["total"] = sum(out.values())
    return out

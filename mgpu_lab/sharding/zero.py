"""ZeRO by hand: what a rank holds, the formula for it, and sharded updates of a flat parameter.

Lesson 08's library: the memory formula of ZeRO stages 0-3 (:func:`zero_memory`),
the bytes a rank really holds, counted from the storages of its tensors
(:func:`held_bytes`), one sharded SGD step on a flat parameter
(:func:`sharded_sgd_step`: reduce-scatter, update the own shard, all-gather),
and :class:`FlatZero`, ZeRO stages 0, 1 and 2 with any optimizer on one flat
parameter. FSDP2 (stage 3) is in :mod:`mgpu_lab.sharding.fsdp`.

Example:
    >>> zero_memory(1_000_000, 4, stage=0) / 2**20     # DDP: 16 bytes a parameter, on every rank
    15.2587890625
    >>> zero_memory(1_000_000, 4, stage=3) / 2**20     # ZeRO-3 / FSDP: a quarter of it
    3.814697265625
"""
from __future__ import annotations


import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import nn

from mgpu_lab.core import compat

compat.install()  # reduce_scatter_single and all_gather_single on torch < 2.13

__all__ = ["zero_memory", "shard_size", "held_bytes", "local", "sharded_sgd_step", "FlatZero"]


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


def sharded_sgd_step(param: torch.Tensor, grad: torch.Tensor, lr: float) -> torch.Tensor:
    """One SGD step of a flat parameter, ZeRO style; call it in every rank.

    Reduce-scatter the gradient (padded to a multiple of the world size), update
    this rank's shard with the averaged gradient, all-gather the shards.

    Args:
        param: the flat full parameter, the same on every rank.
        grad: this rank's local gradient of it.
        lr: the learning rate.

    Returns:
        The new full parameter, ``param - lr * mean over ranks of grad``.

    Example:
        >>> from mgpu_lab import launch
        >>> def step():           # in every rank: rank r's gradient is all r + 1, the mean 1.5
        ...     rank = torch.distributed.get_rank()
        ...     return sharded_sgd_step(torch.zeros(5), torch.full((5,), rank + 1.0), 0.1).tolist()
        >>> launch(step, 2)
        launch: 2 ranks · ...
        [[-0.15..., -0.15..., -0.15..., -0.15..., -0.15...], [-0.15..., -0.15..., -0.15..., -0.15..., -0.15...]]
    """
    world, rank = tdist.get_world_size(), tdist.get_rank()
    n = param.numel()
    shard = shard_size(n, world)
    padded = F.pad(grad.flatten(), (0, shard * world - n))
    grad_shard = torch.empty(shard, dtype=grad.dtype, device=grad.device)
    tdist.reduce_scatter_single(grad_shard, padded)           # sum of the ranks' gradients, my block
    mine = F.pad(param.flatten(), (0, shard * world - n))[rank * shard:(rank + 1) * shard]
    updated = mine - lr * grad_shard / world
    full = torch.empty(shard * world, dtype=param.dtype, device=param.device)
    tdist.all_gather_single(full, updated)
    return full[:n].view_as(param)


class FlatZero:
    """ZeRO stage 0 (DDP's all-reduce), 1 or 2 by hand: the model's parameters live in one flat buffer.

    Every parameter becomes a view into ``flat`` (padded to a multiple of the
    world size for stages 1 and 2), so a shard is a contiguous block of it.

    - stage 0: all-reduce the flat gradient; the optimizer steps the whole buffer;
    - stage 1: reduce-scatter the flat gradient; the optimizer (so its state)
      covers only this rank's block; all-gather the blocks;
    - stage 2: as stage 1, but the full gradients are freed after the
      reduce-scatter: between steps a rank holds only its gradient shard.

    Args:
        model: the model; its parameters are re-pointed into the flat buffer.
        stage: 0, 1 or 2 (stage 3 shards the parameters too: :mod:`mgpu_lab.sharding.fsdp`).
        optimizer_fn: builds the optimizer from a list of parameters, e.g.
            ``lambda ps: torch.optim.Adam(ps, lr=1e-3)``.

    Example:
        >>> from mgpu_lab import launch
        >>> def train():          # in every rank: ZeRO-2, Adam's state for this rank's half only
        ...     torch.manual_seed(0)
        ...     model = nn.Linear(4, 1)
        ...     zero = FlatZero(model, 2, lambda ps: torch.optim.Adam(ps, lr=1e-3))
        ...     model(torch.ones(2, 4)).sum().backward()
        ...     zero.step()
        ...     zero.zero_grad()
        ...     return [round(v, 4) for v in model.bias.tolist()]
        >>> a, b = launch(train, 2)
        launch: 2 ranks · ...
        >>> a == b                # the replicas stay equal
        True
    """

    def __init__(self, model: nn.Module, stage: int, optimizer_fn):
        if isinstance(stage, bool) or stage not in (0, 1, 2):
            raise ValueError(f"stage={stage!r}: FlatZero does stages 0, 1 and 2; stage 3 is FSDP "
                             "(mgpu_lab.sharding.fsdp.shard_model)")
        self.model, self.stage = model, stage
        self.world, self.rank = tdist.get_world_size(), tdist.get_rank()
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.n = sum(p.numel() for p in self.params)
        self.shard = shard_size(self.n, self.world)
        first = self.params[0]
        size = self.n if stage == 0 else self.shard * self.world
        self.flat = torch.zeros(size, dtype=first.dtype, device=first.device)
        self.flat_grad = torch.zeros_like(self.flat) if stage < 2 else None
        offset = 0
        with torch.no_grad():
            for p in self.params:
                k = p.numel()
                self.flat[offset:offset + k].copy_(p.flatten())
                p.data = self.flat[offset:offset + k].view_as(p)
                if self.flat_grad is not None:  # backward adds into these views
                    p.grad = self.flat_grad[offset:offset + k].view_as(p)
                offset += k
        tdist.broadcast(self.flat, 0)  # every rank starts from rank 0's weights, as DDP does
        lo, hi = (0, size) if stage == 0 else (self.rank * self.shard, (self.rank + 1) * self.shard)
        self.master = nn.Parameter(self.flat[lo:hi])  # a view: no copy of the weights
        self.master.grad = self.flat_grad[lo:hi] if stage < 2 else torch.zeros_like(self.master)
        self.optimizer = optimizer_fn([self.master])

    def step(self) -> None:
        """Reduce the gradients, step the optimizer on this rank's part, gather the parameters."""
        if self.stage == 0:
            tdist.all_reduce(self.flat_grad)
            self.flat_grad /= self.world
            self.optimizer.step()
            return
        if self.stage == 1:
            full = self.flat_grad
        else:  # gather the gradients into one padded buffer and free them before the reduce-scatter
            full = torch.zeros_like(self.flat)
            offset = 0
            for p in self.params:
                if p.grad is not None:
                    full[offset:offset + p.numel()].copy_(p.grad.flatten())
                offset += p.numel()
                p.grad = None  # only the shard stays
        reduced = torch.empty(self.shard, dtype=full.dtype, device=full.device)
        tdist.reduce_scatter_single(reduced, full)
        self.master.grad.copy_(reduced / self.world)
        self.optimizer.step()
        tdist.all_gather_single(self.flat, self.master.detach().clone())

    def zero_grad(self) -> None:
        """Zero the gradients in place (the parameters' ``.grad`` are views for stages 0 and 1)."""
        if self.flat_grad is not None:
            self.flat_grad.zero_()
        else:
            self.master.grad.zero_()
            for p in self.params:
                p.grad = None

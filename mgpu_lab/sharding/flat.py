"""ZeRO by hand on a flat parameter: stages 0-2 with any optimizer.

:class:`FlatZero`, ZeRO stages 0, 1 and 2 with any optimizer on one flat parameter,
which :mod:`mgpu_lab.sharding.side_by_side` measures beside DDP and FSDP2.
"""
from __future__ import annotations

import torch
import torch.distributed as tdist
from torch import nn

from mgpu_lab.core import compat
from mgpu_lab.sharding.zero import shard_size

compat.install()  # reduce_scatter_single and all_gather_single on torch < 2.13

__all__ = ["FlatZero"]


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
                             "(mgpu_lab.sharding.wrap.shard_model)")
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

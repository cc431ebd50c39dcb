"""Lesson 11's small transformer block, split over tensor-parallel ranks, and its 2D mesh.

:class:`Block` is a pre-norm transformer block with the submodule names that the
lesson's plans refer to::

    norm1 -> attn (wq, wk, wv: [dim -> dim], wo: [dim -> dim]) -> + x
    norm2 -> mlp (fc1: [dim -> hidden], GELU, fc2: [hidden -> dim]) -> + x

Attention reads its number of heads from the width of ``wq``'s output
(``wq.out_features // head_dim``), so once ``wq``, ``wk`` and ``wv`` are split by
columns over ``tp`` ranks, each rank computes ``heads / tp`` whole heads with no
change to the code; ``wo``, split by rows, then sums the heads' contributions.
:func:`make_mesh_2d` builds the named ``("dp", "tp")`` mesh on the rank's device type.

Example:
    >>> block = Block(dim=16, heads=4, hidden=32)
    >>> [name for name, _ in block.named_children()]
    ['norm1', 'attn', 'norm2', 'mlp']
    >>> block(torch.randn(2, 6, 16)).shape
    torch.Size([2, 6, 16])
"""
from __future__ import annotations

import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import nn

__all__ = ["Attention", "MLP", "Block", "Stack", "make_mesh_2d", "batch"]


class Attention(nn.Module):
    """Multi-head self-attention (no mask) with separate ``wq``, ``wk``, ``wv`` and ``wo`` projections.

    Args:
        dim: model width; ``dim % heads`` must be 0.
        heads: number of heads; each has ``dim // heads`` channels.

    Raises:
        ValueError: when ``heads`` does not divide ``dim``.

    Example:
        >>> Attention(8, 2)(torch.randn(1, 3, 8)).shape
        torch.Size([1, 3, 8])
    """

    def __init__(self, dim: int, heads: int):
        super().__init__()
        if heads < 1 or dim % heads:
            raise ValueError(f"heads={heads} must divide dim={dim}: every head has dim // heads channels")
        self.head_dim = dim // heads
        self.wq, self.wk, self.wv = (nn.Linear(dim, dim) for _ in range(3))
        self.wo = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (w(x) for w in (self.wq, self.wk, self.wv))
        if q.shape[-1] % self.head_dim:  # a column split that cuts through a head
            raise ValueError(f"this rank's wq gives {q.shape[-1]} channels, not a whole number of heads of "
                             f"{self.head_dim}: the number of heads must be divisible by the TP degree")
        q, k, v = (t.view(b, s, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    """``fc2(gelu(fc1(x)))``: ``dim -> hidden -> dim``.

    Example:
        >>> MLP(8, 32)(torch.randn(3, 8)).shape
        torch.Size([3, 8])
    """

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """A pre-norm transformer block: ``x + attn(norm1(x))``, then ``h + mlp(norm2(h))``.

    Args:
        dim: model width (the activations are ``[batch, seq, dim]``).
        heads: attention heads (must divide ``dim``; for TP, also the TP degree).
        hidden: the MLP's inner width (usually ``4 * dim``).
        seed: the initial weights, the same in every process (``None``: torch's global generator).

    Example:
        >>> sum(p.numel() for p in Block(16, 4, 64).parameters())
        3280
    """

    def __init__(self, dim: int = 16, heads: int = 4, hidden: int = 64, seed: int | None = 0):
        super().__init__()
        with torch.random.fork_rng(devices=[], enabled=seed is not None):
            if seed is not None:
                torch.manual_seed(seed)
            self.norm1, self.attn = nn.LayerNorm(dim), Attention(dim, heads)
            self.norm2, self.mlp = nn.LayerNorm(dim), MLP(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Stack(nn.Module):
    """``depth`` :class:`Block` s in ``self.blocks`` (an ``nn.ModuleList``): what the 2D mesh trains.

    Example:
        >>> Stack(depth=2, dim=8, heads=2, hidden=16)(torch.randn(2, 4, 8)).shape
        torch.Size([2, 4, 8])
    """

    def __init__(self, depth: int = 2, dim: int = 16, heads: int = 4, hidden: int = 64, seed: int = 0):
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, heads, hidden, seed + i) for i in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def make_mesh_2d(dp: int, tp: int, device_type: str | None = None):
    """A ``(dp, tp)`` DeviceMesh named ``("dp", "tp")``: ranks ``r`` and ``r + 1`` share a TP group.

    TP talks at every layer, so its groups are the neighbouring ranks (the GPUs of one
    node, on a real cluster); DP/FSDP groups stride across them.

    Args:
        dp, tp: the two sizes; ``dp * tp`` must be the world size.
        device_type: ``"cuda"`` or ``"cpu"``; default: ``"cuda"`` under NCCL, else ``"cpu"``.

    Raises:
        ValueError: when ``dp * tp`` is not the world size.

    Example:
        >>> from mgpu_lab import launch
        >>> def groups():
        ...     mesh = make_mesh_2d(2, 2)
        ...     return {name: mesh[name].mesh.tolist() for name in ("dp", "tp")}
        >>> launch(groups, 4)[2]       # rank 2: its TP group is ranks 2 and 3, its DP group ranks 0 and 2
        launch: 4 ranks · ...
        {'dp': [0, 2], 'tp': [2, 3]}
    """
    from torch.distributed.device_mesh import init_device_mesh

    world = tdist.get_world_size()
    if dp * tp != world:
        raise ValueError(f"dp={dp} x tp={tp} = {dp * tp} ranks, but the world has {world}: choose dp * tp = {world}")
    if device_type is None:
        device_type = "cuda" if tdist.get_backend() == "nccl" else "cpu"
    if device_type == "cuda":
        torch.cuda.set_device(tdist.get_rank() % torch.cuda.device_count())
    return init_device_mesh(device_type, (dp, tp), mesh_dim_names=("dp", "tp"))


def batch(n: int = 4, seq: int = 8, dim: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed batch ``(x, target)``, both ``[n, seq, dim]``, the same in every process.

    Example:
        >>> x, y = batch(2, 4, 8)
        >>> x.shape == y.shape == torch.Size([2, 4, 8])
        True
    """
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, seq, dim, generator=g), torch.randn(n, seq, dim, generator=g)

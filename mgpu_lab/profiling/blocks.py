"""Transformer blocks for counting activation memory, and the formula for what one block saves.

A :class:`Block` is a pre-norm transformer block: ``x + attn(ln1(x))`` then
``x + mlp(ln2(x))``, the attention through ``F.scaled_dot_product_attention``
(causal), the MLP ``Linear(d, m*d) -> GELU -> Linear(m*d, d)``. A
:class:`BlockStack` holds blocks in ``model.blocks`` (an ``nn.Sequential``, so each
block is a named module) and a head. What autograd keeps for backward from one block
of ``b`` sequences of ``s`` tokens, width ``d``, ``h`` heads, MLP ratio ``m``, with
``T = b * s`` tokens and ``e`` bytes per element, on the CPU (torch 2.14), each
storage once:

==========================================  ==========================  =================
saved tensor                                 saved by                    elements
==========================================  ==========================  =================
the block's input ``x``                      ``ln1``                     ``T d``
``ln1``'s output                             ``qkv`` (its input)          ``T d``
``qkv``'s output (q, k, v are views of it)    attention                    ``3 T d``
attention's output (``proj``'s input too)    attention, ``proj``          ``T d``
``x + proj(...)``                            ``ln2``                     ``T d``
``ln2``'s output                             ``fc1``                     ``T d``
``fc1``'s output                             GELU                        ``m T d``
GELU's output                                ``fc2``                     ``m T d``
mean and 1/std of each LayerNorm             ``ln1``, ``ln2``            ``4 T``
the log-sum-exp of each attention row        attention (float32)          ``h T``
==========================================  ==========================  =================

so ``e ((8 + 2m) T d + 4 T) + 4 h T`` bytes (:func:`block_activation_bytes`), with no
``s x s`` attention matrix: the attention kernel recomputes it in backward. The
Linear layers also save their weights (not their biases) and the LayerNorms their
weight and bias: ``e ((4 + 2m) d^2 + 4 d)`` (:func:`block_weight_bytes`), memory that
is there anyway.

Example:
    >>> model = BlockStack(dim=32, heads=4, ratios=(4, 2))
    >>> model(tokens(2, 8, 32)).shape, [type(b).__name__ for b in model.blocks]
    (torch.Size([2, 8, 32]), ['Block', 'Block'])
    >>> block_activation_bytes(batch=2, seq=8, dim=32, heads=4)
    33280
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Block", "BlockStack", "tokens", "block_activation_bytes", "block_weight_bytes", "matmul_policy",
           "MATMULS"]


class Block(nn.Module):
    """A pre-norm transformer block of width ``dim``, ``heads`` attention heads and an MLP of ``mlp_ratio * dim``."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int = 4):
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim={dim} must be a multiple of heads={heads} (each head gets dim // heads)")
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, mlp_ratio * dim), nn.Linear(mlp_ratio * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class BlockStack(nn.Module):
    """``head(blocks(x))``: one :class:`Block` per entry of ``ratios`` (its MLP ratio), then a Linear head.

    Args:
        dim, heads: width and attention heads of every block.
        ratios: the MLP ratio of each block; unequal ratios make blocks of unequal memory.
        seed: the initial weights (the caller's random state is kept).
        dtype: the parameters' dtype.
    """

    def __init__(self, dim: int = 32, heads: int = 4, ratios=(4, 4, 4, 4), seed: int = 0,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.blocks = nn.Sequential(*[Block(dim, heads, r) for r in ratios])
            self.head = nn.Linear(dim, dim)
        self.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def tokens(batch: int, seq: int, dim: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A fixed input of ``batch`` sequences of ``seq`` tokens of width ``dim``."""
    return torch.randn(batch, seq, dim, generator=torch.Generator().manual_seed(seed)).to(dtype)


def block_activation_bytes(batch: int, seq: int, dim: int, heads: int, mlp_ratio: int = 4,
                           dtype: torch.dtype = torch.float32) -> int:
    """Bytes of activations one :class:`Block` saves for backward, on the CPU (the table above).

    ``e ((8 + 2m) T d + 4 T) + 4 h T`` with ``T = batch * seq`` tokens and ``e`` bytes per element: linear
    in the sequence length, since the attention kernel keeps no ``seq x seq`` matrix.

    Example:
        >>> block_activation_bytes(1, 1024, 4096, 32, dtype=torch.bfloat16) / 2**20   # MiB, one sequence
        128.1328125
    """
    e, t = torch.empty((), dtype=dtype).element_size(), batch * seq
    return e * ((8 + 2 * mlp_ratio) * t * dim + 4 * t) + 4 * heads * t


def block_weight_bytes(dim: int, mlp_ratio: int = 4, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of parameters one :class:`Block` saves for backward: the Linear weights and the LayerNorms'.

    Example:
        >>> block_weight_bytes(32) == 4 * (12 * 32 * 32 + 4 * 32)
        True
    """
    e = torch.empty((), dtype=dtype).element_size()
    return e * ((4 + 2 * mlp_ratio) * dim * dim + 4 * dim)


def _matmul_ops() -> frozenset:
    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention")
    return frozenset(getattr(aten, n).default for n in names if hasattr(aten, n))


#: The operators :func:`matmul_policy` saves: matrix products and the attention kernels.
MATMULS = _matmul_ops()


def matmul_policy(ctx, op, *args, **kwargs):
    """A selective-checkpointing policy: save matrix products and attention, recompute everything else.

    For ``create_selective_checkpoint_contexts(matmul_policy)``: the expensive operators'
    outputs are kept, the cheap ones (LayerNorm, GELU, additions, views) are run again in
    backward.

    Example:
        >>> from torch.utils.checkpoint import CheckpointPolicy
        >>> matmul_policy(None, torch.ops.aten.mm.default) is CheckpointPolicy.MUST_SAVE
        True
    """
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in MATMULS else CheckpointPolicy.PREFER_RECOMPUTE

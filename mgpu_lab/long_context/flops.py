"""A rank's attention FLOPs, counted by ``torch.utils.flop_counter`` as the operations run.

:class:`torch.utils.flop_counter.FlopCounterMode` counts matrix products (``mm``, ``bmm``,
``matmul``, ``einsum``) and the CUDA attention kernels; the CPU's attention kernel
(``_scaled_dot_product_flash_attention_for_cpu``, what ``F.scaled_dot_product_attention``
runs here) it does not know, and would count as 0: :func:`counting_flops` adds it, with the
same formula as the CUDA kernels (``4 B H Sq Sk D``, a mask or not). One block of attention,
``n`` queries against ``n`` keys, costs :func:`block_flops`: ``2 B H n n D`` for the scores
and as much again for the weighted sum of the values.

Example:
    >>> q = torch.randn(1, 2, 4, 8)
    >>> with counting_flops() as counter:
    ...     _ = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    >>> counter.get_total_flops() == block_flops(1, 2, 4, 8)
    True
"""
from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

__all__ = ["counting_flops", "block_flops"]


def _cpu_sdpa_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def counting_flops() -> FlopCounterMode:
    """A ``FlopCounterMode`` (not printing) that also counts the CPU's attention kernel.

    Use it as a context manager; ``get_total_flops()`` is what ran inside.
    """
    extra = {}
    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if op is not None:
        extra[op] = _cpu_sdpa_flops
    return FlopCounterMode(display=False, custom_mapping=extra)


def block_flops(batch: int, heads: int, n: int, head_dim: int, keys: int | None = None) -> int:
    """FLOPs of ``n`` queries attending to ``keys`` (default ``n``) keys: scores and weighted values."""
    return 4 * batch * heads * n * (n if keys is None else keys) * head_dim

"""A router's decisions and their costs, on one process: top-k, load per expert, capacity, the auxiliary loss.

Example:
    >>> import torch
    >>> probs, chosen = top_k(torch.tensor([[2.0, 1.0, 0.0], [0.0, 3.0, 1.0]]), 1)
    >>> chosen.flatten().tolist(), tokens_per_expert(chosen, 3).tolist()
    ([0, 1], [1, 1, 0])
    >>> capacity_of(tokens=64, top_k=2, n_experts=8, factor=1.25), dropped([30, 10, 20, 4], 20)
    (20, 10)
"""
from __future__ import annotations

import math

import torch


def top_k(logits: torch.Tensor, k: int) -> tuple:
    """The softmax over all E logits (T, E) and each token's ``k`` most probable experts (T, k).

    Raises:
        ValueError: when ``k`` is not between 1 and E.
    """
    n_experts = logits.shape[-1]
    if not 1 <= k <= n_experts:
        raise ValueError(f"top_k={k} with {n_experts} experts: pick 1 <= top_k <= {n_experts}")
    probs = torch.softmax(logits, dim=-1)
    return probs, probs.topk(k, dim=-1).indices


def tokens_per_expert(chosen: torch.Tensor, n_experts: int) -> torch.Tensor:
    """How many (token, expert) assignments each expert got, before any capacity."""
    return torch.bincount(chosen.flatten(), minlength=n_experts)


def capacity_of(tokens: int, top_k: int, n_experts: int, factor: float) -> int:
    """The usual capacity: ``factor`` times an expert's fair share of the ``tokens * top_k`` assignments.

    Raises:
        ValueError: when ``factor`` is not positive.
    """
    if factor <= 0:
        raise ValueError(f"capacity factor {factor}: it must be > 0 (1.0 is an expert's fair share, 1.25 is usual)")
    return math.ceil(factor * tokens * top_k / n_experts)


def dropped(counts, capacity: int) -> int:
    """Assignments beyond ``capacity`` (dropped: those tokens skip that expert)."""
    return int(sum(max(0, int(c) - capacity) for c in counts))


def load_balancing_loss(probs: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """Switch Transformer's auxiliary loss ``E * sum_i f_i P_i``: ``f_i`` the fraction of assignments that went to
    expert ``i`` (not differentiable), ``P_i`` its mean router probability (differentiable). It is 1 when
    both are uniform and grows as the router favours a few experts; its gradient lowers the probabilities of
    the busiest.

    Example:
        >>> uniform = torch.full((4, 4), 0.25)
        >>> float(load_balancing_loss(uniform, torch.arange(4)[:, None]))
        1.0
    """
    n_experts = probs.shape[-1]
    f = tokens_per_expert(chosen, n_experts).to(probs.dtype) / chosen.numel()
    return n_experts * (f * probs.mean(dim=0)).sum()

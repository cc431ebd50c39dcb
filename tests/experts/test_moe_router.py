"""The router's decisions and costs (mgpu_lab.experts.router), and the skewed router's training
(mgpu_lab.experts.measure.train_router) with and without the load-balancing loss."""
from __future__ import annotations

import pytest
import torch

from mgpu_lab.experts.measure import train_router
from mgpu_lab.experts.router import capacity_of, dropped, load_balancing_loss, tokens_per_expert, top_k


def test_top_k_keeps_the_softmax_over_all_experts_and_picks_the_largest():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    probs, chosen = top_k(logits, 2)
    assert torch.allclose(probs, torch.softmax(logits, -1)) and chosen.tolist() == [[1, 2]]
    assert float(probs[0, chosen[0]].sum()) < 1.0  # not renormalised over the kept two


@pytest.mark.parametrize("k", [0, 5])
def test_top_k_out_of_range_says_the_values_and_the_range(k):
    with pytest.raises(ValueError, match=f"top_k={k} with 4 experts.*1 <= top_k <= 4"):
        top_k(torch.zeros(2, 4), k)


def test_capacity_and_what_it_drops():
    assert capacity_of(tokens=100, top_k=2, n_experts=8, factor=1.0) == 25
    assert capacity_of(tokens=100, top_k=2, n_experts=8, factor=1.25) == 32  # ceil(31.25)
    assert dropped([40, 25, 10, 0], 25) == 15 and dropped([1, 2], 5) == 0
    with pytest.raises(ValueError, match="capacity factor 0.*> 0"):
        capacity_of(10, 1, 2, 0)


def test_the_auxiliary_loss_is_one_when_balanced_and_larger_when_skewed():
    balanced = torch.full((8, 4), 0.25)
    assert float(load_balancing_loss(balanced, torch.arange(8)[:, None] % 4)) == pytest.approx(1.0)
    skewed = torch.tensor([[0.7, 0.1, 0.1, 0.1]]).repeat(8, 1).requires_grad_(True)
    loss = load_balancing_loss(skewed, torch.zeros(8, 1, dtype=torch.long))
    assert float(loss.detach()) == pytest.approx(4 * 0.7)
    loss.backward()
    assert skewed.grad[0, 0] > skewed.grad[0, 1]  # the busiest expert's probability is pushed down hardest
    assert tokens_per_expert(torch.tensor([[0, 1], [0, 3]]), 4).tolist() == [2, 1, 0, 1]


def test_the_auxiliary_loss_spreads_a_skewed_routers_tokens():
    without, with_aux = train_router(0.0, steps=40), train_router(0.05, steps=40)
    assert without[0] == with_aux[0] and max(without[0]) > 3 * 512 / 8  # the same skewed start
    assert max(with_aux[-1]) < 1.5 * 512 / 8 < max(without[-1])  # balanced within 1.5x with it, not without

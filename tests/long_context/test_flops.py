"""Attention FLOPs counted per rank (mgpu_lab.long_context.flops), the CPU's attention kernel included."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from mgpu_lab.long_context.flops import block_flops, counting_flops


def test_matrix_products_and_the_cpu_attention_kernel_count_the_same_for_one_block():
    q, k, v = torch.randn(2, 3, 6, 5), torch.randn(2, 3, 4, 5), torch.randn(2, 3, 4, 5)
    with counting_flops() as by_hand:
        torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v
    with counting_flops() as fused:
        F.scaled_dot_product_attention(q, k, v)
    assert by_hand.get_total_flops() == fused.get_total_flops() == block_flops(2, 3, 6, 5, keys=4) == 4 * 2 * 3 * 6 * 4 * 5


def test_elementwise_work_is_not_counted():
    q = torch.randn(1, 1, 4, 3)
    with counting_flops() as counter:
        (q.unsqueeze(-2) * q.unsqueeze(-3)).sum(-1)
    assert counter.get_total_flops() == 0

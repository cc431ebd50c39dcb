"""What a context-parallel attention costs each rank (mgpu_lab.long_context.measure): the arithmetic of bytes
received and the watch of rows held, without ranks (the module's docstring example runs ranks)."""
from __future__ import annotations

import torch

from mgpu_lab.long_context.measure import _bytes_in, HeldRows, inputs


def test_bytes_in_count_receives_whole_and_a_collective_s_share_from_the_others():
    events = [{"op": "recv", "bytes": 100}, {"op": "send", "bytes": 100}, {"op": "all_gather", "bytes": 400},
              {"op": "all_reduce", "bytes": 400}, {"op": "barrier", "bytes": 0}]
    assert _bytes_in(events, 4) == 100 + 300 + 600


def test_held_rows_sees_head_wide_rows_transposed_or_not_and_ignores_scores():
    with HeldRows(5) as held:
        torch.ones(2, 3, 7, 5).transpose(-2, -1).contiguous()  # (.., 5, 7): 7 rows, transposed
        torch.ones(2, 3, 9, 9)                                  # scores: not head-wide
    assert held.rows == 7


def test_inputs_are_deterministic_and_scale_only_the_queries():
    a, b = inputs(1, 2, 8, 4, seed=3), inputs(1, 2, 8, 4, seed=3, scale=10.0)
    assert torch.equal(a[1], b[1]) and torch.allclose(a[0] * 10, b[0])

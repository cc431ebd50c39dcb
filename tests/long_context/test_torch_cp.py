"""long_context.torch_cp: torch's context_parallel where it can run (2+ CUDA GPUs), and what the CPU says."""
from __future__ import annotations

import pytest
import torch

from mgpu_lab.long_context import layout, torch_cp


def test_the_cpu_path_reports_what_torch_raises_there():
    # real gloo ranks run torch's context_parallel on CPU tensors: torch refuses, and each rank says why
    results = torch_cp.attempt_on_cpu(2)
    assert [r["ran"] for r in results] == [False, False], results
    assert all(torch_cp.CPU_ERROR in r["error"] for r in results), results


def test_without_two_gpus_the_reason_is_said_and_compare_refuses_with_it(monkeypatch):
    assert torch_cp.why_not(4) is None
    assert "no CUDA GPU" in torch_cp.why_not(0) and torch_cp.CPU_ERROR in torch_cp.why_not(0)
    assert "1 CUDA GPU" in torch_cp.why_not(1)
    monkeypatch.setattr(torch_cp, "why_not", lambda gpus=None: "this machine has no CUDA GPU")
    with pytest.raises(RuntimeError, match="did not run: this machine has no CUDA GPU"):
        torch_cp.compare(2)


def test_torch_load_balancer_is_the_zigzag_layout():
    seq, world = 16, 4
    positions = torch_cp.head_tail_positions(seq, world)
    ours = [layout.shard(torch.arange(seq), r, world, "zigzag", dim=0).tolist() for r in range(world)]
    assert positions == ours
    with pytest.raises(ValueError, match="seq=12 is not divisible by 2 \\* world = 8"):
        torch_cp.head_tail_positions(12, 4)


def test_an_unknown_rotate_method_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="rotate='ring'.*allgather.*alltoall"):
        torch_cp.compare_rank(rotate="ring")


@pytest.mark.gpu
@pytest.mark.parametrize("rotate", torch_cp.ROTATE_METHODS)
def test_context_parallel_equals_full_attention_on_two_gpus(rotate):
    if torch_cp.why_not() is not None:
        pytest.skip(f"needs 2 CUDA GPUs: {torch_cp.why_not()}")
    results = torch_cp.compare(2, rotate=rotate)
    assert all(r["ran"] and r["rotate"] == rotate for r in results), results
    assert max(r["max_error"] for r in results) < 1e-3, results  # float32
    assert [r["positions"] for r in results] == [h[:4] for h in torch_cp.head_tail_positions(256, 2)]

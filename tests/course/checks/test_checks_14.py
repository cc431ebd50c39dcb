"""Lesson 14's checkers against a stub, an answer that does nothing, one that calls a reference, and
all-gather CP written by hand (ring_attention); the same for moe_layer, with every rank's tokens gathered by
hand and a rank stuck in a collective; and the judges on small cases worked out by hand
(tests/mutants/test_mutants_14.py has the named mutants and the correct variants)."""
from __future__ import annotations

import functools

import pytest
import torch

from checking import by_value
from mgpu_lab.course.checks import check, exercises
from mgpu_lab.course.checks.l14 import judges

pytestmark = pytest.mark.timeout(400)

ANSWERS = {
    "stub": by_value("def stub(q, k, v, causal, layout):\n    raise NotImplementedError('write this')\n", "stub"),
    # does nothing: no rows right, no message, no FLOPs
    "zeros": by_value("import torch\ndef zeros(q, k, v, causal, layout):\n    return torch.zeros_like(q)\n", "zeros"),
    "library": by_value('''
def library(q, k, v, causal, layout):
    from mgpu_lab.long_context.gather import allgather_attention
    return allgather_attention(q, k, v, causal, layout)
''', "library"),
    # all-gather CP written by hand: right rows, the whole K and V on every rank, every block attended
    "gathered": by_value('''
import torch
import torch.distributed as dist
import torch.nn.functional as F

def gathered(q, k, v, causal, layout):
    world, rank, n = dist.get_world_size(), dist.get_rank(), q.shape[-2]
    ks, vs = [torch.empty_like(k) for _ in range(world)], [torch.empty_like(v) for _ in range(world)]
    dist.all_gather(ks, k.contiguous())
    dist.all_gather(vs, v.contiguous())
    pos = torch.arange(n * world, device=q.device)
    if layout == "contiguous":
        held = pos.view(world, n)
    else:
        c = pos.view(2 * world, n // 2)
        held = torch.stack([torch.cat([c[r], c[2 * world - 1 - r]]) for r in range(world)])
    order = held.flatten().argsort()
    k_all, v_all = torch.cat(ks, -2)[..., order, :], torch.cat(vs, -2)[..., order, :]
    mask = held[rank][:, None] >= pos[None, :] if causal else None
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)
''', "gathered"),
}


def test_lesson_14_registers_its_two_exercises_with_half_the_points_each():
    assert {e.id: e.points for e in exercises("14")} == {"14.ring_attention": 8, "14.moe_layer": 8}


def test_a_stub_is_not_attempted():
    assert check("14.ring_attention", ANSWERS["stub"]).status == "not attempted"


@functools.cache
def verdicts() -> dict:
    """The three answers below judged through shared launches (one per world size and round)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "mutants"))
    from batching import judge_many  # tests/mutants/batching.py: the launches shared, the verdicts check()'s

    names = ("zeros", "library", "gathered")
    return dict(zip(names, judge_many("14.ring_attention", [(ANSWERS[n],) for n in names])))


def test_an_answer_that_does_nothing_passes_no_case():
    """No case passes without its evidence: no rows, no messages, no FLOPs earn nothing."""
    result = verdicts()["zeros"]
    assert result.points == 0, str(result)
    assert "not judged" in str(result), str(result)


def test_an_answer_that_calls_all_gather_cp_of_the_library_passes_no_case():
    result = verdicts()["library"]
    assert result.points == 0 and "reference" in str(result).lower(), str(result)


def test_all_gather_cp_by_hand_gets_the_rows_and_fails_the_ring_the_memory_and_the_flops():
    """Its rows are right, stable and on the right device, and its zig-zag work is even (every rank attends to
    every key); it all-gathers, holds the whole sequence's K and V and works on blocks the mask empties."""
    result = verdicts()["gathered"]
    assert [c.passed for c in result.cases] == [True, True, False, False, False, True, True, True], str(result)
    assert "all_gather" in result.cases[2].hint and "whole sequence" in result.cases[3].hint, str(result)
    assert "mask empties" in result.cases[4].hint, str(result)


# -- the judges, on small cases worked out by hand -------------------------------------------------------------
def test_positions_owners_and_rows_in_either_layout():
    owner, local, swapped = judges.positions_of(8, 2, "zigzag")
    assert owner.tolist() == [0, 0, 1, 1, 1, 1, 0, 0] and local.tolist() == [0, 1, 0, 1, 2, 3, 2, 3]
    assert swapped.tolist() == [6, 7, 4, 5, 2, 3, 0, 1]  # rank 0 read as chunks 3, 0: positions 6, 7 first
    owner, local, _ = judges.positions_of(6, 3, "contiguous")
    assert owner.tolist() == [0, 0, 1, 1, 2, 2] and local.tolist() == [0, 1, 0, 1, 0, 1]


def test_blocks_with_work_and_allowed_pairs_per_rank():
    # scenario 0: contiguous, causal, 4 rows per rank: rank r sees r + 1 blocks; its rows p see p + 1 keys
    assert judges.nonempty_blocks(0, 4) == [1, 2, 3, 4]
    assert judges.allowed_pairs(0, 2) == [1 + 2 + 3 + 4, 5 + 6 + 7 + 8]
    # scenario 2: zig-zag, causal: every rank has work in every block, and the same number of pairs
    assert judges.nonempty_blocks(2, 4) == [4, 4, 4, 4] and len(set(judges.allowed_pairs(2, 4))) == 1


def test_the_variant_masks_differ_from_the_right_one_where_the_bug_shows():
    masks = judges.variant_masks(2, 2)  # zig-zag, causal, 6 rows per rank
    right = masks["right"]
    assert torch.equal(right, torch.ones(12, 12, dtype=torch.bool).tril())
    for name in ("own block left out", "block positions", "chunks swapped"):
        assert not torch.equal(masks[name], right), name
    assert not masks["own block left out"].diagonal().any()


# -- 14.moe_layer ----------------------------------------------------------------------------------------------
MOE_ANSWERS = {
    "stub": by_value("def stub(x, router_weight, experts, top_k, capacity):\n    raise NotImplementedError('write this')\n",
                     "stub"),
    "zeros": by_value("import torch\ndef zeros(x, router_weight, experts, top_k, capacity):\n"
                      "    return torch.zeros_like(x)\n", "zeros"),
    "reference": by_value("""
def reference(x, router_weight, experts, top_k, capacity):
    from mgpu_lab.course.checks.l14.judges import reference_moe_layer
    return reference_moe_layer([x], [router_weight], list(experts), top_k, capacity)[0]
""", "reference"),
    # every rank's tokens gathered to every rank, the experts' outputs summed back: right numbers and gradients,
    # W times the bytes and no all-to-all
    "gathered": by_value("""
import torch
import torch.distributed as dist
from torch.distributed.nn.functional import all_gather, all_reduce

def gathered(x, router_weight, experts, top_k, capacity):
    rank, world, per, n = dist.get_rank(), dist.get_world_size(), len(experts), x.shape[0]
    total = torch.zeros(world * n, x.shape[1], dtype=x.dtype)
    for s, xx in enumerate(all_gather(x)):
        probs = torch.softmax(xx @ router_weight.t(), -1)
        chosen = probs.topk(top_k, -1).indices
        for j, expert in enumerate(experts):
            e = rank * per + j
            rows = (chosen == e).any(-1).nonzero().flatten()[:capacity]
            total = total + torch.zeros_like(total).index_add(0, rows + s * n, probs[rows, e:e + 1] * expert(xx[rows]))
    return all_reduce(total)[rank * n:(rank + 1) * n]
""", "gathered"),
    # rank 0 never joins the all-to-all in time: the other ranks wait in it
    "stuck": by_value("""
import time
import torch
import torch.distributed as dist

def stuck(x, router_weight, experts, top_k, capacity):
    if dist.get_rank() == 0:
        time.sleep(30)
    dist.all_to_all_single(torch.empty(dist.get_world_size()), torch.ones(dist.get_world_size()))
    return x
""", "stuck"),
}


def test_a_moe_stub_is_not_attempted():
    assert check("14.moe_layer", MOE_ANSWERS["stub"]).status == "not attempted"


@functools.cache
def moe_verdicts() -> dict:
    """The answers below judged through shared launches, as verdicts() above."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "mutants"))
    from batching import judge_many

    names = ("zeros", "reference", "gathered")  # not "stuck": a launch that dies makes every answer in it rerun alone
    return dict(zip(names, judge_many("14.moe_layer", [(MOE_ANSWERS[n],) for n in names])))


def test_a_moe_answer_that_does_nothing_passes_no_case():
    result = moe_verdicts()["zeros"]
    assert result.points == 0 and "not judged" in str(result), str(result)


def test_a_moe_answer_that_calls_the_checks_reference_passes_no_case():
    result = moe_verdicts()["reference"]
    assert result.points == 0 and "reference" in str(result).lower(), str(result)


def test_gathering_every_ranks_tokens_gets_the_outputs_and_fails_the_traffic():
    """Its outputs are right; every rank routes every rank's tokens, so its router's gradient is the sum over all
    ranks' tokens instead of its own; it calls all_gather and all_reduce, no all-to-all."""
    result = moe_verdicts()["gathered"]
    assert [c.passed for c in result.cases] == [True, True, True, False, False, False], str(result)
    assert "all_gather" in result.cases[4].hint and "all-to-alls" in result.cases[4].hint, str(result)


def test_a_rank_stuck_in_a_collective_is_reported_within_seconds():
    result = check("14.moe_layer", MOE_ANSWERS["stuck"])
    assert result.points == 0 and "waited for ever" in str(result), str(result)


def test_the_moe_reference_keeps_capacity_per_source_rank_in_token_order():
    chosen = [torch.tensor([[0], [0], [0]]), torch.tensor([[0], [1], [0]])]
    assert [r.tolist() for r in judges._kept(chosen, 0, 2, True)] == [[0, 1], [0, 2]]
    assert [r.tolist() for r in judges._kept(chosen, 0, 2, False)] == [[0, 1], []]
    plan = judges.routed(5, 2)  # the "elsewhere" router: rank 0's experts get nothing, rank 0 sends all away
    assert plan["got"][0] == 0 and plan["remote_out"][0] == plan["sent"][0] > 0

"""Checks of lesson 14 (long sequences and many experts): ring_attention and moe_layer.

One launch of 2 ranks and one of 4 run every scenario of :data:`.ranks.SCENARIOS`
(contiguous and zig-zag layouts, causal or not, float32 and float64, several shapes,
logits that overflow a naive softmax, a call with torch's default device set to meta),
each call recorded: every send and receive, the attention FLOPs torch's FLOP counter
sees, and the most rows of K or V any one tensor held. The judges recompute the whole
attention in float64.

``moe_layer`` is judged the same way: one launch of 2 ranks and one of 4 run every scenario of
:data:`.ranks.MOE_SCENARIOS` (uniform and skewed routers, top-1 and top-2, capacities that drop
tokens and ones that do not, a rank whose tokens all go elsewhere and that receives none), each
call's forward and backward recorded apart; the judges recompute outputs and gradients with
:func:`.judges.reference_moe_layer` and the bytes of the routed tokens.
"""
from __future__ import annotations

from .._core import exercise
from .judges import (judge_balance, judge_flops, judge_held, judge_moe_all_take_part, judge_moe_grads,
                     judge_moe_out, judge_moe_traffic, judge_ring, judge_rows, judge_stable, judged, moe_judged,
                     DEVICE_WHY)
from ..sim.scenarios import launch_scenarios
from .ranks import entries, LARGE, META, moe_entries, moe_probe, MOE_SCENARIOS, ring_probe, SCENARIOS

WORLDS = (2, 4)
PLAIN = range(6)  # the scenarios of ordinary logits on the input's device
ZIGZAG_CAUSAL = (2, 4)
RING_TIMEOUT = 90.0  # seconds for one launch's nine calls (a few seconds); a deadlocked ring is reported within one
_CP = "torch.distributed.tensor.experimental._context_parallel._attention:"
REFERENCES = (_CP + "context_parallel", _CP + "_templated_ring_attention", _CP + "_SDPAMerger",
              _CP + "_scaled_dot_product_ring_flash_attention", _CP + "_scaled_dot_product_ring_efficient_attention",
              _CP + "_context_parallel_shard", "mgpu_lab.long_context.gather:allgather_attention")
ROWS_HINT = ("each rank returns its own rows of attention over the whole sequence (all ranks' keys), in its layout; "
             "with causal, a position sees itself and every position before it in the whole sequence")


@exercise("14.ring_attention", points=8, references=REFERENCES,
          description="ring_attention(q, k, v, causal, layout): this rank's rows of attention over the whole "
          "sequence, K and V passed around the ring (W-1 blocks sent per rank), no FLOPs on blocks the causal "
          "mask empties, zig-zag balanced, stable for large logits; judged on 2 and 4 ranks")
def _ring_attention(t, ring_attention):
    """Two launches (2 and 4 ranks), every scenario in each; each case judges what its name says.

    Catches: partial results merged without rescaling to a common maximum; the causal mask on positions
    within a block; the rank's own (diagonal) block skipped; blocking sends around the ring (a deadlock,
    reported by the recorder within a second); zig-zag chunks taken in the wrong order; a naive softmax
    that overflows; an all-gather of K and V; work on blocks the mask empties; a buffer made without
    device=.
    """
    runs = {}
    for world in WORLDS:
        with t.case(f"{world} ranks: every rank returns its rows of scaled_dot_product_attention over the whole "
                    "sequence (contiguous and zig-zag, causal and not, float32 and float64, four shapes)",
                    hint=ROWS_HINT):
            runs[world] = _launch(t, world, ring_attention)
            judge_rows(t, runs[world], world, PLAIN)
    with t.case("K and V reach the other ranks only as point-to-point messages around the ring: each rank sends "
                "W-1 blocks of K and W-1 of V to one neighbour and receives as many from the other (every send, "
                "receive and collective recorded, 2 and 4 ranks)",
                hint="a block of keys and values that has been around the ring once has been seen by every rank"):
        _on_every_world(t, runs, PLAIN, judged, judge_ring)
    with t.case("no rank ever holds the whole sequence's K or V: no tensor of the call has S rows as wide as a "
                "head (every tensor the call made, watched)",
                hint="at any moment a rank needs only the block of keys and values it is attending to"):
        _on_every_world(t, runs, PLAIN, judged, judge_held)
    with t.case("no attention FLOPs on blocks the causal mask empties: each rank's FLOPs (torch.utils.flop_counter) "
                "are at most its non-empty blocks' worth and at least what its allowed (row, key) pairs need",
                hint="under a causal mask a rank's rows see no key of some ranks' blocks at all; work on those "
                     "is thrown away"):
        _on_every_world(t, runs, PLAIN, judged, judge_flops)
    with t.case("zig-zag, causal: every rank's attention FLOPs are equal within one block's worth (2 and 4 ranks)",
                hint="in the zig-zag layout every rank holds an early and a late chunk; its work must reflect that"):
        _on_every_world(t, runs, ZIGZAG_CAUSAL, judged, judge_balance)
    with t.case("numerically stable: queries scaled so that logits reach the hundreds (a naive softmax overflows "
                "float32 and float64) give finite rows equal to the attention",
                hint="softmax is unchanged when every score of a row is shifted by one constant"):
        _on_every_world(t, runs, LARGE, judge_stable)
    with t.case("every tensor it makes is on the input's device (a call with torch's default device set to meta: "
                "a tensor made without device= is not on it, as a CPU tensor on a GPU rank would not be)",
                hint=DEVICE_WHY):
        _on_every_world(t, runs, [META], judge_rows)


def _launch(t, world: int, answer, moe: bool = False) -> list:
    """Every scenario in one launch of ``world`` ranks; per rank, an entry per scenario it got to."""
    probe, scenarios, read = (moe_probe, MOE_SCENARIOS, moe_entries) if moe else (ring_probe, SCENARIOS, entries)
    evidence = launch_scenarios(t, probe, world, answer, tuple(range(len(scenarios))),
                                timeout=MOE_TIMEOUT if moe else RING_TIMEOUT)
    got = read(evidence.per_rank)
    if evidence.error is not None and not any(e and e[-1]["error"] for e in got):
        raise evidence.error  # nothing saved says why (not attempted, a hang, a crash): the launch's own words
    return got


MOE_TIMEOUT = 60.0  # seconds for one launch's six calls (well under one); a rank stuck in a collective ends it in 6
NO_DROP, DROPS, ELSEWHERE = (0, 1), (2, 3, 4), (5,)
MOE_REFERENCES = ("mgpu_lab.course.checks.l14.judges:reference_moe_layer",)
MOE_HINT = ("a token's output is the sum, over the experts that kept it, of each expert's output weighted by the "
            "token's router probability (softmax over all E logits, not renormalised over the top-k)")


@exercise("14.moe_layer", points=8, references=MOE_REFERENCES,
          description="moe_layer(x, router_weight, experts, top_k, capacity): top-k routing, experts on their "
          "ranks, tokens there and back through all-to-alls (counts first), capacity per source rank, "
          "differentiable; judged on 2 and 4 ranks")
def _moe_layer(t, moe_layer):
    """Two launches (2 and 4 ranks), every MoE scenario in each, forward and backward recorded apart.

    Catches: counts not exchanged before the tokens; capacity counted globally instead of per source rank;
    probabilities renormalised over the top-k; outputs in received order instead of the tokens'; gradients
    that stop at a plain all-to-all; a rank that receives nothing skipping an all-to-all (stuck, reported
    within seconds); an all-gather of the tokens; dropped tokens sent anyway.
    """
    runs = {}
    for world in WORLDS:
        with t.case(f"{world} ranks: every rank's output equals the single-process reference (uniform router, "
                    "top-1 and top-2, no token dropped)", hint=MOE_HINT):
            runs[world] = _launch(t, world, moe_layer, moe=True)
            judge_moe_out(t, runs[world], world, NO_DROP)
    with t.case("capacity: with a skewed router and small capacities, each expert keeps at most `capacity` tokens "
                "from each source rank, the earliest in token order, and the outputs equal the reference's "
                "(2 and 4 ranks)", hint="an expert's capacity is counted per source rank, not across all of them"):
        _on_every_world(t, runs, DROPS, judge_moe_out)
    with t.case("gradients: x, router_weight and every expert's weights get the reference's gradients (every "
                "scenario, 2 and 4 ranks)", points=2,
                hint="the router's gradient flows through the kept experts' probabilities; the experts' and the "
                     "tokens' through the exchanges, both ways"):
        _on_every_world(t, runs, NO_DROP + DROPS, moe_judged, judge_moe_grads)
    with t.case("tokens cross ranks only through all-to-alls, counts before tokens, whose bytes per rank match the "
                "routed tokens after the capacity rule, forward and backward (recorded; no all-gather)", points=2,
                hint="a rank learns how many rows it will receive only from the senders"):
        _on_every_world(t, runs, NO_DROP + DROPS, moe_judged, judge_moe_traffic)
    with t.case("a rank whose tokens all go elsewhere and that receives none: right outputs and gradients, and it "
                "takes part in every all-to-all forward and backward (2 and 4 ranks)",
                hint="every rank joins every collective, with empty splits where it has nothing"):
        _on_every_world(t, runs, ELSEWHERE, judge_moe_all_take_part, judge_moe_out, judge_moe_grads)


def _on_every_world(t, runs: dict, scenarios, *judges) -> None:
    """Judge ``scenarios`` of the run on each of :data:`WORLDS` with ``judges`` in turn (each run must have
    finished)."""
    for world in WORLDS:
        _ready(t, runs, world)
        for judge in judges:
            judge(t, runs[world], world, scenarios)


def _ready(t, runs: dict, world: int) -> None:
    if world not in runs:
        t.fail(f"not judged: the run on {world} ranks did not finish (see the cases above)")

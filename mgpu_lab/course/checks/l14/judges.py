"""What lesson 14's check concludes from the ranks' evidence: rows, messages, FLOPs, held rows.

The judges recompute each scenario's whole attention in float64 (:func:`attend`) and, to
name a wrong answer's bug, the same attention under the masks that the known wrong
designs amount to (:func:`variant_masks`): the causal mask taken on positions within a
block, a rank's own block left out, a zig-zag shard's two chunks taken in the other order.

Example:
    >>> owner, local = positions_of(8, 2, "zigzag")[:2]
    >>> owner.tolist(), local.tolist()
    ([0, 0, 1, 1, 1, 1, 0, 0], [0, 1, 0, 1, 2, 3, 2, 3])
"""
from __future__ import annotations

import functools

import torch

from mgpu_lab.long_context.flops import block_flops
from mgpu_lab.long_context.layout import chunks_of, shard

from .ranks import D, full_inputs, moe_inputs, MOE_SCENARIOS, SCENARIOS

TOL = {"float32": 5e-5, "float64": 1e-9}  # absolute, on values of order 1


def positions_of(seq: int, world: int, layout: str) -> tuple:
    """Per position: the rank holding it, its row in that rank's shard, the position a swapped zig-zag reads."""
    owner, local, swapped = (torch.zeros(seq, dtype=torch.long) for _ in range(3))
    everywhere = torch.arange(seq)
    for r in range(world):
        mine = shard(everywhere, r, world, layout, dim=0)
        owner[mine], local[mine] = r, torch.arange(len(mine))
        halves = mine.chunk(len(chunks_of(r, world, layout)))
        swapped[mine] = torch.cat(halves[::-1])
    return owner, local, swapped


def attend(q, k, v, mask) -> torch.Tensor:
    """Attention in float64 with a boolean ``mask`` (S, S) (True: may attend); rows with no key are NaN."""
    q, k, v = q.double(), k.double(), v.double()
    scores = (q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def variant_masks(k: int, world: int) -> dict:
    """The right mask of scenario ``k`` and those of the known wrong designs, by name."""
    s = SCENARIOS[k]
    seq = s["shape"][2] * world
    owner, local, swapped = positions_of(seq, world, s["layout"])
    pos = torch.arange(seq)
    causal = (pos[:, None] >= pos[None, :]) if s["causal"] else torch.ones(seq, seq, dtype=torch.bool)
    other_block = owner[:, None] != owner[None, :]
    out = {"right": causal, "own block left out": causal & other_block}
    if s["causal"]:
        in_block = local[:, None] >= local[None, :]
        out["block positions"] = in_block
        out["block positions, later blocks skipped"] = in_block & (owner[:, None] >= owner[None, :])
        if s["layout"] == "zigzag":
            out["chunks swapped"] = swapped[:, None] >= swapped[None, :]
    return out


def expected(k: int, world: int, mask_name: str = "right") -> list:
    """Every rank's rows of scenario ``k`` under the named mask, float64."""
    q, kk, v = full_inputs(k, world)
    full = attend(q, kk, v, variant_masks(k, world)[mask_name])
    return [shard(full, r, world, SCENARIOS[k]["layout"]) for r in range(world)]


def wrong_ranks(k: int, per_rank: list, world: int) -> list:
    """The ranks whose rows of scenario ``k`` are not the attention (within float rounding)."""
    want, tol = expected(k, world), TOL[SCENARIOS[k]["dtype"]]
    return [r for r, e in enumerate(per_rank) if not _close(e[k]["out"], want[r], tol)]


def _close(got, want, tol: float) -> bool:
    return (isinstance(got, torch.Tensor) and got.shape == want.shape and bool(torch.isfinite(got).all())
            and bool(((got.double() - want).abs() <= tol * (1 + want.abs())).all()))


def _matches(got, want, tol: float) -> bool:
    """Close on every row the variant defines (rows with no key under it: any value; none defined: True)."""
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return False
    rows = torch.isfinite(want).all(dim=-1)
    return bool(((got.double() - want).abs() <= tol * (1 + want.abs()))[rows].all())


def describe(k: int) -> str:
    s = SCENARIOS[k]
    b, h, n, d = s["shape"]
    return (f"{s['layout']}, {'causal' if s['causal'] else 'not causal'}, {s['dtype']}, shards of (B, H, S/W, D) = "
            f"({b}, {h}, {n}, {d})")


WHY = {
    "block positions": "the causal mask was taken on the rows' and keys' positions within their blocks, not in the "
                       "whole sequence: a key of an earlier rank is masked as if it came later, and one of a later "
                       "rank let through",
    "block positions, later blocks skipped": "the causal mask was taken on the positions within each block, not in "
                                             "the whole sequence: keys of earlier blocks are half masked away",
    "own block left out": "the rows attend to every block but the rank's own: its own keys (the causal diagonal, "
                          "where each position sees itself) never counted",
    "chunks swapped": "the rank's two zig-zag chunks were taken in the other order (chunk 2W-1-r first): a shard "
                      "holds chunk r, then chunk 2W-1-r, for its queries, its keys and its output alike",
}


def diagnose(k: int, per_rank: list, world: int) -> str | None:
    """Why scenario ``k``'s rows are wrong, when a known wrong design explains them; else None."""
    s, tol = SCENARIOS[k], TOL[SCENARIOS[k]["dtype"]]
    outs = [e[k]["out"] for e in per_rank]
    for name in WHY:
        if name in variant_masks(k, world):
            want = expected(k, world, name)
            defined = any(bool(torch.isfinite(w).all(dim=-1).any()) for w in want)
            if defined and all(_matches(o, w, tol) for o, w in zip(outs, want)):
                return WHY[name]
    right = expected(k, world)
    if s["layout"] == "zigzag" and all(isinstance(o, torch.Tensor) and _close(torch.cat(o.chunk(2, -2)[::-1], -2),
                                                                              w, tol) for o, w in zip(outs, right)):
        return WHY["chunks swapped"] + " (here: the output's two chunks came back in the other order)"
    if any(isinstance(o, torch.Tensor) and not bool(torch.isfinite(o).all()) for o in outs):
        return ("some rows are NaN or infinite: a row that sees no key of a block (a mask that empties it) "
                "gives 0/0 or exp(-inf + inf) unless the merge handles it")
    if s["causal"] and s["layout"] == "contiguous":
        good = [r for r in range(world) if _close(outs[r], right[r], tol)]
        if good == [0]:
            return ("rank 0, whose rows see one block of keys only, is right, and every rank whose rows see keys "
                    "of several blocks is wrong: the partial results of different blocks were combined as if "
                    "they were on the same scale (each block's exponentials are relative to its own maximum)")
    return None


def judge_rows(t, per_rank: list, world: int, scenarios) -> None:
    """Fail the case unless every rank returned its rows of the attention in every one of ``scenarios``."""
    for k in scenarios:
        _judge_ran(t, per_rank, world, k)
        bad = wrong_ranks(k, per_rank, world)
        if bad:
            r = bad[0]
            got, want = per_rank[r][k]["out"], expected(k, world)[r]
            if isinstance(got, torch.Tensor) and got.shape != want.shape:
                t.fail(f"rank {r} returned a tensor of shape {tuple(got.shape)}: its rows of the attention have "
                       f"the shape of its queries", f"{tuple(want.shape)} ({describe(k)})", tuple(got.shape))
            why = diagnose(k, per_rank, world) or (f"rank {r}'s rows differ from the attention over the whole "
                                                   "sequence (see where)")
            t.fail(why, f"{describe(k)}: ranks {list(range(world))} right", _where(got, want, bad, r))


def _where(got, want, bad: list, r: int) -> str:
    if not isinstance(got, torch.Tensor):
        return f"rank {r} returned {str(got)[:80]}"
    err = (got.double() - want).abs().nan_to_num(float("inf"))
    row = int(err.amax(dim=-1).flatten().argmax()) % want.shape[-2]
    return f"wrong on ranks {bad}; rank {r}'s largest error {float(err.max()):.3g}, at its row {row}"


def _judge_ran(t, per_rank: list, world: int, k: int) -> None:
    """Fail the case when a rank did not finish scenario ``k``: say how (a deadlock, an error)."""
    failed = [(r, e[k]) for r, e in enumerate(per_rank) if k < len(e) and e[k]["error"]]
    if failed:
        r, entry = failed[0]
        err = entry["error"]
        if any(e["stuck"] for _, e in failed):
            t.fail("the ranks deadlocked in the ring: each rank's send waits for the next rank to receive, while "
                   "that rank is itself waiting in its own send, so no message ever moves (gloo's send "
                   "completes only when its receive is posted)", f"{describe(k)}: every rank returns",
                   f"rank {r}: {err}")
        if "meta" in err:
            t.fail(DEVICE_WHY, f"{describe(k)}: every rank returns", f"rank {r}: {err}")
        if "ReferenceCalled" in err:
            t.fail("your code calls a reference implementation; build the ring yourself", "", f"rank {r}: {err}")
        t.fail(f"your code raised on rank {r} ({describe(k)})", "every rank returns", err)
    if any(k >= len(e) for e in per_rank):
        t.fail(f"not run on {world} ranks: an earlier scenario failed (see the cases above)", got="skipped")


DEVICE_WHY = ("a tensor was made without device= (here it landed on torch's default device, meta, not on the input's "
              "device): on a GPU rank it would be a CPU tensor, which NCCL refuses to send and a CUDA kernel refuses "
              "to mix; make every buffer, mask and index on the input's device")


def shard_bytes(k: int, world: int) -> int:
    b, h, n, d = SCENARIOS[k]["shape"]
    return b * h * n * d * getattr(torch, SCENARIOS[k]["dtype"]).itemsize


def judged(t, per_rank: list, world: int, scenarios) -> None:
    """Fail the case as not judged unless every rank got every one of ``scenarios`` right."""
    for k in scenarios:
        if any(k >= len(e) or e[k]["error"] for e in per_rank) or wrong_ranks(k, per_rank, world):
            t.fail(f"not judged: on {world} ranks the rows of the scenario {describe(k)} are not the attention "
                   "(see the cases above); costs count only for an answer that works")


def judge_ring(t, per_rank: list, world: int, scenarios) -> None:
    """Fail the case unless K and V moved only as sends and receives between ring neighbours, W-1 blocks each."""
    for k in scenarios:
        block = shard_bytes(k, world)
        for r, entries in enumerate(per_rank):
            events = entries[k]["events"]
            others = sorted({e[3] for e in events if e[0] not in ("send", "recv")})
            if others:
                t.fail(f"rank {r} called {', '.join(others)}: K and V must reach the other ranks only as "
                       "point-to-point messages around the ring; a collective makes every rank wait for all and an "
                       "all-gather leaves the whole sequence's K and V on every rank",
                       "sends and receives only", others)
            sent = [e for e in events if e[0] == "send"]
            recv = [e for e in events if e[0] == "recv"]
            peers_out, peers_in = {e[2] for e in sent}, {e[2] for e in recv}
            ring = {(r + 1) % world, (r - 1) % world}
            want = 2 * (world - 1) * block
            total, got_in = sum(e[1] for e in sent), sum(e[1] for e in recv)
            if total != want or got_in != want:
                t.fail(f"rank {r} sent {total} and received {got_in} bytes in the scenario {describe(k)}: each rank "
                       f"passes on W-1 = {world - 1} blocks of K and as many of V ({block} bytes each), no more "
                       "(what a rank already saw need not travel again) and no fewer (every rank needs every block)",
                       f"{want} bytes each way", f"sent {total}, received {got_in}")
            if len(peers_out) != 1 or len(peers_in) != 1 or not (peers_out | peers_in) <= ring or \
                    (world > 2 and peers_out == peers_in):
                t.fail(f"rank {r} sent to ranks {sorted(peers_out)} and received from {sorted(peers_in)}: around a "
                       "ring each rank sends to one neighbour and receives from the other, the same every step",
                       f"send to one of {sorted(ring)}, receive from the other", f"{sorted(peers_out)} / "
                       f"{sorted(peers_in)}")
            if any(e[1] > 2 * block for e in sent):
                t.fail(f"rank {r} sent a message larger than one block of K and one of V ({2 * block} bytes)",
                       f"<= {2 * block} bytes a message", max(e[1] for e in sent))


def judge_held(t, per_rank: list, world: int, scenarios) -> None:
    """Fail the case when a rank held a tensor with the whole sequence's rows of K or V (or saw none at all)."""
    for k in scenarios:
        n = SCENARIOS[k]["shape"][2]
        for r, entries in enumerate(per_rank):
            rows = entries[k]["rows"]
            if rows >= n * world:
                t.fail(f"rank {r} held a tensor of {rows} rows as wide as a head in the scenario {describe(k)}: "
                       f"the whole sequence's keys or values (S = {n * world}) in one place, which is what context "
                       "parallelism exists to avoid: each rank's memory must not grow with the whole sequence",
                       f"fewer than {n * world} rows", rows)
            if rows < n:
                t.fail(f"not judged: no tensor of rank {r}'s call had K or V's rows (the watch saw {rows} rows)")


def nonempty_blocks(k: int, world: int) -> list:
    """Per rank: how many ranks' blocks of keys hold at least one key its rows may attend to."""
    mask, n = variant_masks(k, world)["right"], SCENARIOS[k]["shape"][2]
    owner = positions_of(n * world, world, SCENARIOS[k]["layout"])[0]
    return [sum(bool(mask[owner == r][:, owner == s].any()) for s in range(world)) for r in range(world)]


def allowed_pairs(k: int, world: int) -> list:
    """Per rank: how many (row, key) pairs its rows may attend to."""
    mask, n = variant_masks(k, world)["right"], SCENARIOS[k]["shape"][2]
    owner = positions_of(n * world, world, SCENARIOS[k]["layout"])[0]
    return [int(mask[owner == r].sum()) for r in range(world)]


def judge_flops(t, per_rank: list, world: int, scenarios) -> None:
    """Fail the case when a rank's attention FLOPs exceed its non-empty blocks' worth, or miss its pairs."""
    for k in scenarios:
        b, h, n, d = SCENARIOS[k]["shape"]
        one, blocks, pairs = block_flops(b, h, n, d), nonempty_blocks(k, world), allowed_pairs(k, world)
        flops = [e[k]["flops"] for e in per_rank]
        for r in range(world):
            least = 4 * b * h * d * pairs[r]
            if flops[r] < least:
                t.fail(f"rank {r}: torch's FLOP counter saw {flops[r]} FLOPs, fewer than the {least} that its "
                       f"{pairs[r]} (row, key) pairs need ({describe(k)}): the counter sees matrix products (matmul, "
                       "einsum, scaled_dot_product_attention), not sums of elementwise products",
                       f">= {least}", flops[r])
            if flops[r] > blocks[r] * one:
                t.fail(f"rank {r} spent {flops[r]} FLOPs on attention, {flops[r] / one:g} blocks' worth, but only "
                       f"{blocks[r]} of the {world} blocks of keys hold a key its rows may see ({describe(k)}): "
                       "the rest is work on blocks the causal mask empties: thrown away, and paid for in the step's time",
                       f"<= {blocks[r]} x {one}", f"{flops[r]} (per rank: {flops})")


def judge_balance(t, per_rank: list, world: int, scenarios) -> None:
    """Fail the case when the ranks' attention FLOPs differ by more than one block's worth."""
    for k in scenarios:
        b, h, n, d = SCENARIOS[k]["shape"]
        one, flops = block_flops(b, h, n, d), [e[k]["flops"] for e in per_rank]
        if max(flops) - min(flops) > one:
            t.fail(f"the ranks' attention FLOPs differ by {(max(flops) - min(flops)) / one:g} blocks' worth "
                   f"({describe(k)}): the busiest rank sets the time of the step while the others wait; in the "
                   "zig-zag layout every rank's causal work is the same, within one block",
                   f"max - min <= {one}", f"per rank {flops}")


def judge_stable(t, per_rank: list, world: int, scenarios) -> None:
    """Fail the case unless the rows of the large-logit scenarios are finite and right."""
    for k in scenarios:
        _judge_ran(t, per_rank, world, k)
        outs = [e[k]["out"] for e in per_rank]
        if any(isinstance(o, torch.Tensor) and not bool(torch.isfinite(o).all()) for o in outs):
            big = SCENARIOS[k]["scale"]
            t.fail(f"with logits in the hundreds (queries scaled by {big:g}) some rows are inf or NaN: exp() of a "
                   f"logit past {88 if SCENARIOS[k]['dtype'] == 'float32' else 709} overflows "
                   f"{SCENARIOS[k]['dtype']}; a softmax that exponentiates raw scores cannot hold them, while "
                   "softmax itself is the same whatever constant a row's scores are shifted by",
                   f"{describe(k)}: finite rows", "inf or NaN")
        judge_rows(t, per_rank, world, [k])


# -- 14.moe_layer ----------------------------------------------------------------------------------------------
def _kept(chosen_by_rank: list, expert: int, capacity: int, per_source: bool) -> list:
    """Per source rank: the tokens (in token order) that ``expert`` keeps, of those whose top-k chose it."""
    wanting = [(c == expert).any(dim=-1).nonzero().flatten() for c in chosen_by_rank]
    if per_source:
        return [w[:capacity] for w in wanting]
    out, left = [], capacity  # one capacity for the expert, filled rank after rank
    for w in wanting:
        out.append(w[:max(left, 0)])
        left -= len(out[-1])
    return out


def reference_moe_layer(xs, routers, experts, top_k: int, capacity: int, renormalise=False, per_source=True):
    """Every rank's output of a mixture-of-experts layer, in one process, differentiable.

    ``xs`` and ``routers`` hold one tensor per source rank (the router's weight once per rank, so each rank's
    gradient is its own); ``experts`` holds all E. Each token goes to its ``top_k`` experts by softmax
    probability over the E logits (not renormalised over the kept ones, unless ``renormalise``); an expert
    keeps at most ``capacity`` tokens of each source rank in token order (``per_source=False``: at most
    ``capacity`` in all, filled rank after rank); a token's output is the sum of its kept experts' outputs,
    each weighted by its probability.
    """
    probs = [torch.softmax(x @ w.t(), dim=-1) for x, w in zip(xs, routers)]
    chosen = [p.topk(top_k, dim=-1).indices for p in probs]
    weights = [p / p.gather(-1, c).sum(-1, keepdim=True) if renormalise else p for p, c in zip(probs, chosen)]
    outs = [torch.zeros_like(x) for x in xs]
    for e, expert in enumerate(experts):
        for r, rows in enumerate(_kept(chosen, e, capacity, per_source)):
            if len(rows):
                outs[r] = outs[r].index_add(0, rows, weights[r][rows, e:e + 1] * expert(xs[r][rows]))
    return outs


def moe_expected(k: int, world: int, renormalise: bool = False, per_source: bool = True) -> dict:
    """Scenario ``k``'s outputs and gradients (output's gradient: the scenario's ``grads``) by the reference
    (computed once per process: the judges ask for them again and again)."""
    return _moe_expected(k, world, renormalise, per_source)


@functools.cache
def _moe_expected(k: int, world: int, renormalise: bool, per_source: bool) -> dict:
    variant = {"renormalise": renormalise, "per_source": per_source}
    made, s = moe_inputs(k, world), MOE_SCENARIOS[k]
    xs = [x.clone().requires_grad_(True) for x in made["xs"]]
    routers = [made["router"].clone().requires_grad_(True) for _ in range(world)]
    outs = reference_moe_layer(xs, routers, made["experts"], s["top_k"], s["capacity"], **variant)
    sum((o * g).sum() for o, g in zip(outs, made["grads"])).backward()
    per = s["experts"] // world
    grads = [[p.grad if p.grad is not None else torch.zeros_like(p) for p in e.parameters()] for e in made["experts"]]
    return {"out": [o.detach() for o in outs], "x": [x.grad for x in xs], "router": [w.grad for w in routers],
            "experts": [grads[r * per:(r + 1) * per] for r in range(world)]}


@functools.cache
def routed(k: int, world: int) -> dict:
    """Per rank: the (token, expert) pairs it sends that their experts keep, and the pairs its experts keep."""
    made, s = moe_inputs(k, world), MOE_SCENARIOS[k]
    chosen = [torch.softmax(x @ made["router"].t(), -1).topk(s["top_k"], -1).indices for x in made["xs"]]
    per, sent, got = s["experts"] // world, [0] * world, [0] * world
    remote_out, remote_in = [set() for _ in range(world)], [set() for _ in range(world)]
    for e in range(s["experts"]):
        for r, rows in enumerate(_kept(chosen, e, s["capacity"], True)):
            sent[r] += len(rows)
            got[e // per] += len(rows)
            if e // per != r:
                remote_out[r].update((int(t), e // per) for t in rows)
                remote_in[e // per].update((r, int(t)) for t in rows)
    return {"sent": sent, "got": got, "remote_out": [len(x) for x in remote_out],
            "remote_in": [len(x) for x in remote_in]}


def _moe_close(got, want, dtype: str) -> bool:
    tol = TOL[dtype] * (20 if dtype == "float32" else 1)
    return isinstance(got, torch.Tensor) and got.shape == want.shape and bool(torch.isfinite(got).all()) and \
        bool(((got.double() - want.double()).abs() <= tol * (1 + want.double().abs())).all())


def describe_moe(k: int) -> str:
    s = MOE_SCENARIOS[k]
    return (f"{s['router']} router, {s['tokens']} tokens per rank, E = {s['experts']}, top_k = {s['top_k']}, "
            f"capacity {s['capacity']}, {s['dtype']}")


MOE_WHY = {
    "renormalised": ("the output weights each kept expert by its probability renormalised over the top-k (they sum "
                     "to 1); here a token's weights are the softmax over all E logits, not renormalised: with "
                     "top_k < E they sum to less than 1", {"renormalise": True}),
    "global": ("each expert kept at most `capacity` tokens in all, counted globally across the source ranks, not "
               "`capacity` per source rank (from each rank, its earliest in token order): tokens of later ranks "
               "were dropped that their own rank's share would keep", {"per_source": False}),
}


def _diagnose_moe(k: int, outs: list, world: int) -> str:
    s = MOE_SCENARIOS[k]
    for why, variant in MOE_WHY.values():
        want = moe_expected(k, world, **variant)["out"]
        if any(not torch.equal(a, b) for a, b in zip(want, moe_expected(k, world)["out"])) and \
                all(_moe_close(o, w, s["dtype"]) for o, w in zip(outs, want)):
            return why
    want = moe_expected(k, world)["out"]
    if all(isinstance(o, torch.Tensor) and o.shape == w.shape for o, w in zip(outs, want)) and all(
            torch.allclose(o.double().sum(0), w.double().sum(0), atol=1e-4) for o, w in zip(outs, want)):
        return ("the right rows came back, in the wrong places: each rank's outputs sum to the right total but the "
                "rows are not at their tokens' positions (returned in the order they were received, grouped by "
                "expert, instead of the tokens' order)")
    return ("a token's output is the sum, over the experts that kept it, of the expert's output weighted by the "
            "token's router probability (softmax over all E logits); an expert keeps at most `capacity` tokens of "
            "each source rank, the earliest in token order")


def judge_moe_ran(t, per_rank: list, world: int, k: int) -> None:
    """Fail the case when a rank did not finish MoE scenario ``k``: say how (stuck, an error)."""
    failed = [(r, e[k]) for r, e in enumerate(per_rank) if k < len(e) and e[k]["error"]]
    if failed:
        r, entry = failed[0]
        if any(e.get("stuck") for _, e in failed):
            t.fail("ranks waited for ever in a collective: every rank must take part in every all-to-all, in the "
                   "same order, forward and backward, even a rank that sends or receives no token (it sends and "
                   "receives empty splits); a rank that skips one leaves the others waiting",
                   f"{describe_moe(k)}: every rank returns", f"rank {r}: {entry['error']}")
        if any("SkippedExchange" in e["error"] or "by peer" in e["error"] for _, e in failed):
            t.fail("the ranks did not all take part in the same all-to-alls: every rank must take part in every "
                   "exchange, forward and backward, in the same order, even one that receives no token (with "
                   "empty splits); in backward, a rank makes the exchanges only if its output depends on them "
                   "through autograd", f"{describe_moe(k)}: every rank in every all-to-all",
                   f"rank {r}: {entry['error'][:200]}")
        if any("SplitMismatch" in e["error"] for _, e in failed):
            t.fail("a rank sized what it receives without the senders' counts: how many rows arrive from each rank "
                   "depends on that rank's router, so a receiver must learn the counts from the senders before "
                   "the tokens travel (the check compared every rank's send and receive sizes of each all-to-all)",
                   f"{describe_moe(k)}: receive sizes equal to what the other ranks send", entry["error"][:300])
        if "ReferenceCalled" in entry["error"]:
            t.fail("your code calls a reference implementation; route and exchange the tokens yourself", "",
                   f"rank {r}: {entry['error']}")
        t.fail(f"your code raised on rank {r} ({describe_moe(k)})", "every rank returns", entry["error"])
    if any(k >= len(e) for e in per_rank):
        t.fail(f"not run on {world} ranks: an earlier scenario failed (see the cases above)", got="skipped")


def judge_moe_out(t, per_rank: list, world: int, scenarios) -> None:
    """Fail the case unless every rank's output equals the reference's, naming a known wrong design."""
    for k in scenarios:
        judge_moe_ran(t, per_rank, world, k)
        outs, want = [e[k]["out"] for e in per_rank], moe_expected(k, world)["out"]
        bad = [r for r, (o, w) in enumerate(zip(outs, want)) if not _moe_close(o, w, MOE_SCENARIOS[k]["dtype"])]
        if bad:
            got = outs[bad[0]]
            t.fail(_diagnose_moe(k, outs, world) + f" ({describe_moe(k)}, {world} ranks)",
                   f"rank {bad[0]}'s output as the reference", f"wrong on ranks {bad}" + (
                       f"; rank {bad[0]}'s largest error {float((got.double() - want[bad[0]]).abs().max()):.3g}"
                       if isinstance(got, torch.Tensor) and got.shape == want[bad[0]].shape else f": {str(got)[:80]}"))


def moe_judged(t, per_rank: list, world: int, scenarios) -> None:
    """Fail the case as not judged unless every rank's output of every one of ``scenarios`` is right."""
    for k in scenarios:
        want = moe_expected(k, world)["out"]
        if any(k >= len(e) or e[k]["error"] or not _moe_close(e[k]["out"], want[r], MOE_SCENARIOS[k]["dtype"])
               for r, e in enumerate(per_rank)):
            t.fail(f"not judged: on {world} ranks the outputs of the scenario {describe_moe(k)} are not the "
                   "reference's (see the cases above); gradients and traffic count only for an answer that works")


def _grad_of(grads, name: str, r: int, want):
    got = None if grads is None else grads[name]
    return got if got is not None else torch.zeros_like(want)


def judge_moe_grads(t, per_rank: list, world: int, scenarios) -> None:
    """Fail the case unless the gradients of x, the router's weight and every expert's weights are the reference's."""
    for k in scenarios:
        want, dtype = moe_expected(k, world), MOE_SCENARIOS[k]["dtype"]
        for r, e in enumerate(per_rank):
            grads = e[k]["grads"]
            experts = [[g if g is not None else torch.zeros_like(w) for g, w in zip(gs, ws)]
                       for gs, ws in zip(grads["experts"] if grads else [[None] * len(ws) for ws in
                                                                        want["experts"][r]], want["experts"][r])]
            if any(bool(w.abs().max() > 0) for ws in want["experts"][r] for w in ws) and \
                    all(not bool(g.abs().max() > 0) for gs in experts for g in gs):
                t.fail(f"rank {r}'s experts got no gradient at all ({describe_moe(k)}): the gradient did not flow "
                       "back through the all-to-alls: torch.distributed's collectives are not differentiable (their "
                       "output has no grad_fn), so backward must send the outputs' gradients back to the experts "
                       "and the inputs' gradients back to the tokens' ranks",
                       "the reference's gradients", "zero gradients on every expert")
            checks = [("x", _grad_of(grads, "x", r, want["x"][r]), want["x"][r]),
                      ("router_weight", _grad_of(grads, "router", r, want["router"][r]), want["router"][r])]
            checks += [(f"expert {i}'s weights", g, w) for i, (gs, ws) in enumerate(zip(experts, want["experts"][r]))
                       for g, w in zip(gs, ws)]
            for name, g, w in checks:
                if not _moe_close(g, w, dtype):
                    t.fail(f"rank {r}: the gradient of {name} is not the reference's ({describe_moe(k)}, {world} "
                           "ranks): every path of the forward (the router's probabilities of the kept experts, the "
                           "experts, the exchanges both ways) must carry its gradient back",
                           "the reference's gradient", f"largest error {float((g.double() - w.double()).abs().max()):.3g}"
                           if g.shape == w.shape else f"shape {tuple(g.shape)}")


def _token_bytes(events: list, dtype: str) -> tuple:
    """(the bytes of the all-to-alls of ``dtype`` tensors, whether one of another dtype came before the first)."""
    tokens = [e for e in events if e[0] == "all_to_all" and e[2] == f"torch.{dtype}"]
    first = next((i for i, e in enumerate(events) if e[0] == "all_to_all" and e[2] == f"torch.{dtype}"), None)
    counted_first = first is not None and any(e[0] == "all_to_all" for e in events[:first])
    return sum(e[1] for e in tokens), counted_first


def judge_moe_traffic(t, per_rank: list, world: int, scenarios) -> None:
    """Fail the case unless tokens crossed ranks only through all-to-alls whose bytes match the routed tokens."""
    for k in scenarios:
        s, plan = MOE_SCENARIOS[k], routed(k, world)
        row = D * getattr(torch, s["dtype"]).itemsize
        for r, e in enumerate(per_rank):
            for phase in ("forward", "backward"):
                others = sorted({ev[3] for ev in e[k][phase] if ev[0] != "all_to_all"})
                if others:
                    t.fail(f"rank {r} called {', '.join(others)} in {phase} ({describe_moe(k)}): tokens cross ranks "
                           "only through all-to-alls; an all-gather sends every rank's tokens to every rank, "
                           "W times the bytes, whatever the router chose", "all-to-alls only", others)
                most = (plan["sent"][r] + plan["got"][r]) * row
                least = (plan["remote_out"][r] + plan["remote_in"][r]) * row
                sent, counted = _token_bytes(e[k][phase], s["dtype"])
                if not least <= sent <= most:
                    t.fail(f"rank {r}'s all-to-alls of tokens moved {sent} bytes in {phase} ({describe_moe(k)}): "
                           f"the routed tokens after the capacity rule are {plan['sent'][r]} rows out and "
                           f"{plan['got'][r]} in, {row} bytes each; more means tokens an expert drops (or padding, "
                           "or every token to every rank) travelled, fewer that some routed tokens never did",
                           f"{least} to {most} bytes", sent)
                if phase == "forward" and not counted:
                    t.fail(f"rank {r} sent tokens before any count was exchanged ({describe_moe(k)}): how many rows "
                           "a rank receives from each other rank depends on the other ranks' routers, and a receiver "
                           "must know those sizes before it can allocate its buffer and split what arrives",
                           "an all-to-all of counts before the first of tokens", [ev[3] for ev in e[k][phase]])


def judge_moe_all_take_part(t, per_rank: list, world: int, scenarios) -> None:
    """Fail the case unless every rank made as many all-to-alls as every other, forward and backward."""
    for k in scenarios:
        judge_moe_ran(t, per_rank, world, k)
        for phase in ("forward", "backward"):
            calls = [sum(ev[0] == "all_to_all" for ev in e[k][phase]) for e in per_rank]
            if len(set(calls)) > 1:
                t.fail(f"the ranks made {calls} all-to-alls in {phase} ({describe_moe(k)}): rank 0 sends all its "
                       "tokens elsewhere and receives none, yet it takes part in every exchange, with empty splits",
                       "the same number on every rank", calls)

"""Lesson 14's check against named wrong answers made from the solution, and correct variants.

Every mutant is the solution cell of ``solutions/14_long_context.ipynb`` with one learner bug put in;
its check must fail with a message that names the bug. Every variant is a correct answer written
differently; it must get full marks. All answers are judged through one warm launch per world size
(tests/mutants/batching.py); an answer whose ranks raise (a deadlock, a device mix-up) is judged again in
a launch of its own, as ``check()`` would.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from batching import shared_mutant_tests
from mutation import ExerciseMutants, Mutant, Variant, replace

pytestmark = pytest.mark.timeout(600)
NAMESPACE = {"__name__": "__main__", "math": math, "torch": torch, "dist": dist, "F": F}  # the notebook's imports
NOTEBOOK = "14_long_context.ipynb"

SENDS = """            ops = [dist.P2POp(dist.isend, k_cur, (rank + 1) % world), dist.P2POp(dist.isend, v_cur, (rank + 1) % world),
                   dist.P2POp(dist.irecv, k_next, (rank - 1) % world), dist.P2POp(dist.irecv, v_next, (rank - 1) % world)]
            requests = dist.batch_isend_irecv(ops)
"""
BLOCKING = """            dist.send(k_cur, (rank + 1) % world)
            dist.send(v_cur, (rank + 1) % world)
            dist.recv(k_next, (rank - 1) % world)
            dist.recv(v_next, (rank - 1) % world)
            requests = []
"""

RING = ExerciseMutants("14.ring_attention", NOTEBOOK, ("ring_attention",), mutants=[
    Mutant("partial outputs merged without rescaling to the running maximum",
           (replace("out[..., rows, :] * keep + weights", "out[..., rows, :] + weights"),
            replace("total[..., rows, :] * keep + weights", "total[..., rows, :] + weights")),
           ("combined", "its own maximum")),
    Mutant("the causal mask on positions within the block, not in the sequence",
           replace("torch.arange(c * size, (c + 1) * size, device=q.device)",
                   "torch.arange(i * size, (i + 1) * size, device=q.device)"),
           "positions within their blocks"),
    Mutant("the diagonal block (the rank's own keys) skipped",
           replace("        for rows, q_pos in chunks(rank):", "        for rows, q_pos in (chunks(rank) if step else []):"),
           "its own keys"),
    Mutant("blocking sends around the ring (every rank sends first)", replace(SENDS, BLOCKING), "deadlocked"),
    Mutant("zig-zag chunks taken in the wrong order",
           replace('ids = [r] if layout == "contiguous" else [r, 2 * world - 1 - r]',
                   'ids = [r] if layout == "contiguous" else [2 * world - 1 - r, r]'),
           "other order"),
    Mutant("a naive softmax that overflows (raw exponentials, no maximum)",
           (replace("weights = torch.exp(scores - new_top)", "weights = torch.exp(scores)"),
            replace("keep = torch.exp(top[..., rows, :] - new_top)", "keep = 1.0")),
           "overflows"),
    Mutant("work on blocks the causal mask empties (no block skipped)",
           replace("if allowed is not None and not bool(allowed.any()):", "if False:"),
           "mask empties"),
    Mutant("receive buffers made without device= (CPU tensors on a GPU rank)",
           replace("k_next, v_next = torch.empty_like(k_cur), torch.empty_like(v_cur)",
                   "k_next, v_next = torch.empty(k_cur.shape, dtype=k_cur.dtype), torch.empty(v_cur.shape, "
                   "dtype=v_cur.dtype)"),
           "without device="),
], variants=[
    Variant("whole blocks, the mask from the positions each shard holds", '''
def ring_attention(q, k, v, causal, layout):
    rank, world = dist.get_rank(), dist.get_world_size()
    n = q.shape[-2]

    def positions(r):
        if layout == "contiguous":
            return torch.arange(r * n, (r + 1) * n, device=q.device)
        half = n // 2
        lo, hi = r * half, (2 * world - 1 - r) * half
        return torch.cat([torch.arange(lo, lo + half, device=q.device), torch.arange(hi, hi + half, device=q.device)])

    mine = positions(rank)
    out = torch.zeros_like(q)
    top = torch.full(q.shape[:-1] + (1,), float("-inf"), dtype=q.dtype, device=q.device)
    total = torch.zeros_like(top)
    kb, vb = k.contiguous(), v.contiguous()
    for step in range(world):
        if step < world - 1:
            k2, v2 = torch.empty_like(kb), torch.empty_like(vb)
            reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, kb, (rank + 1) % world),
                                           dist.P2POp(dist.isend, vb, (rank + 1) % world),
                                           dist.P2POp(dist.irecv, k2, (rank - 1) % world),
                                           dist.P2POp(dist.irecv, v2, (rank - 1) % world)])
        mask = mine[:, None] >= positions((rank - step) % world)[None, :] if causal else None
        if mask is None or bool(mask.any()):
            s = (q @ kb.transpose(-2, -1)) / math.sqrt(q.shape[-1])
            if mask is not None:
                s = s.masked_fill(~mask, float("-inf"))
            m = torch.maximum(top, s.amax(-1, keepdim=True))
            p = torch.exp(s - m)
            c = torch.exp(top - m)
            out, total, top = out * c + p @ vb, total * c + p.sum(-1, keepdim=True), m
        if step < world - 1:
            for r in reqs:
                r.wait()
            kb, vb = k2, v2
    return out / total
'''),
    Variant("a running log-sum-exp, K and V packed in one message, isend/irecv, einsum", '''
def ring_attention(q, k, v, causal, layout):
    rank, world = dist.get_rank(), dist.get_world_size()
    n, d = q.shape[-2], q.shape[-1]
    everything = torch.arange(n * world, device=q.device)
    if layout == "contiguous":
        where = everything.view(world, n)
    else:
        parts = everything.view(2 * world, n // 2)
        where = torch.stack([torch.cat([parts[r], parts[2 * world - 1 - r]]) for r in range(world)])
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
    acc = torch.zeros_like(q)
    block = torch.stack([k, v])
    for step in range(world):
        if step + 1 < world:
            incoming = torch.empty_like(block)
            sent = dist.isend(block, (rank - 1) % world)
            got = dist.irecv(incoming, (rank + 1) % world)
        src = (rank + step) % world
        ok = where[rank][:, None] >= where[src][None, :] if causal else torch.ones(n, n, dtype=torch.bool, device=q.device)
        if ok.any():
            s = torch.einsum("bhqd,bhkd->bhqk", q, block[0]) * d ** -0.5
            s = s.masked_fill(~ok, float("-inf"))
            blk = torch.logsumexp(s, dim=-1)
            safe = torch.where(torch.isinf(blk), torch.zeros_like(blk), blk)
            part = torch.einsum("bhqk,bhkd->bhqd", torch.exp(s - safe[..., None]), block[1])
            new = torch.logaddexp(lse, blk)
            acc = acc * torch.exp(lse - new).nan_to_num(0.0)[..., None] + part * torch.exp(blk - new).nan_to_num(0.0)[..., None]
            lse = new
        if step + 1 < world:
            sent.wait()
            got.wait()
            block = incoming
    return acc
'''),
])
PLAIN = """    def plain(rows, send, recv):
        out = rows.new_empty((sum(recv), rows.shape[1]))
        dist.all_to_all_single(out, rows.contiguous(), recv, send)
        return out

    world, n_tokens = dist.get_world_size(), x.shape[0]"""
RECEIVER_CAPACITY = """    mine = torch.arange(local, device=x.device).repeat(world).repeat_interleave(receiving)
    arrived_per = torch.bincount(mine, minlength=local)
    sorted_mine, by = mine.sort(stable=True)
    seat_in = torch.empty_like(mine)
    seat_in[by] = torch.arange(len(mine), device=x.device) - (arrived_per.cumsum(0) - arrived_per)[sorted_mine]
    mine = torch.where(seat_in < capacity, mine, -1)"""

MOE = ExerciseMutants("14.moe_layer", NOTEBOOK, ("moe_layer",), mutants=[
    Mutant("capacity counted globally (by the receiving expert over all source ranks) instead of per source rank",
           (replace("keep = seat < capacity", "keep = seat >= 0"),
            replace("    mine = torch.arange(local, device=x.device).repeat(world).repeat_interleave(receiving)",
                    RECEIVER_CAPACITY)),
           ("globally", "per source rank")),
    Mutant("router probabilities renormalised over the top-k",
           replace("expert, weight = expert.flatten(), weight.flatten()",
                   "expert, weight = expert.flatten(), (weight / weight.sum(-1, keepdim=True)).flatten()"),
           "renormalised"),
    Mutant("outputs returned in received order instead of the tokens' order",
           replace("index_add(0, token, back", "index_add(0, token.sort().values, back"),
           "order"),
    Mutant("gradients not flowing through the all-to-all (plain all_to_all_single, no autograd function)",
           (replace("    world, n_tokens = dist.get_world_size(), x.shape[0]", PLAIN),
            replace("Exchange.apply(", "plain(", count=0)),
           ("no gradient", "all-to-all")),
    Mutant("counts not exchanged before the tokens (a rank assumes it receives what it sends)",
           replace("    dist.all_to_all_single(receiving, sending)  # [s * local + j]: rows from rank s for my expert j\n",
                   "    receiving.copy_(sending)\n"),
           ("without the senders' counts", "before the tokens travel")),
    Mutant("a rank that receives nothing skips the all-to-alls (the others wait in them)",
           (replace("arrived = Exchange.apply(x[token], send, recv)",
                    "arrived = Exchange.apply(x[token], send, recv) if sum(recv) else x.new_zeros(0, x.shape[1])"),
            replace("back = Exchange.apply(done, recv, send)",
                    "back = Exchange.apply(done, recv, send) if sum(recv) else x.new_zeros(len(token), x.shape[1])")),
           ("every exchange", "receives no token")),
    Mutant("a rank that receives nothing makes its expert outputs from zeros (no backward exchange)",
           replace("        done = done.index_add(0, rows, module(arrived[rows]))",
                   "        if len(rows):\n            done = done.index_add(0, rows, module(arrived[rows]))"),
           ("every exchange", "backward")),
], variants=[
    Variant("torch.distributed.nn.functional.all_to_all_single, Python lists per expert, outputs cut per "
            "(source, expert)", '''
def moe_layer(x, router_weight, experts, top_k, capacity):
    from torch.distributed.nn.functional import all_to_all_single as exchange

    rank, world = dist.get_rank(), dist.get_world_size()
    E, per = router_weight.shape[0], len(experts)
    p = (x @ router_weight.T).softmax(-1)
    top = p.topk(top_k, -1).indices.tolist()
    lists = [[] for _ in range(E)]
    for t, picks in enumerate(top):
        for e in picks:
            if len(lists[e]) < capacity:
                lists[e].append(t)
    tokens = [t for e in range(E) for t in lists[e]]
    counts = torch.tensor([len(l) for l in lists])
    incoming = torch.zeros_like(counts)
    dist.all_to_all_single(incoming, counts)
    send = [sum(len(lists[e]) for e in range(d * per, (d + 1) * per)) for d in range(world)]
    recv = incoming.view(world, per).sum(1).tolist()
    rows = exchange(x.new_empty(sum(recv), x.shape[1]), x[tokens], recv, send)
    pieces, at = [], 0
    for s in range(world):
        for j in range(per):
            n = int(incoming[s * per + j])
            pieces.append(experts[j](rows[at:at + n]))
            at += n
    done = torch.cat(pieces) if pieces else rows
    back = exchange(x.new_empty(len(tokens), x.shape[1]), done, send, recv)
    gate = torch.cat([p[lists[e], e] for e in range(E)])
    y = torch.zeros_like(x)
    return y.index_add(0, torch.tensor(tokens, dtype=torch.long, device=x.device), back * gate[:, None])
'''),
    Variant("a custom autograd Function at module level, capacity by a cumulative sum over a token x expert mask, "
            "masked_scatter", '''
class Trip(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, out_sizes, in_sizes):
        ctx.sizes = out_sizes, in_sizes
        got = torch.empty(sum(in_sizes), *t.shape[1:], dtype=t.dtype, device=t.device)
        dist.all_to_all_single(got, t.contiguous(), output_split_sizes=in_sizes, input_split_sizes=out_sizes)
        return got

    @staticmethod
    def backward(ctx, g):
        out_sizes, in_sizes = ctx.sizes
        return Trip.apply(g, in_sizes, out_sizes), None, None


def moe_layer(x, router_weight, experts, top_k, capacity):
    world = dist.get_world_size()
    E, per, T = router_weight.shape[0], len(experts), x.shape[0]
    probs = torch.softmax(x @ router_weight.t(), dim=1)
    chosen = probs.topk(top_k, dim=1).indices
    hit = torch.zeros(T, E, dtype=torch.bool, device=x.device).scatter(1, chosen, True)
    hit &= hit.long().cumsum(0) <= capacity          # earliest `capacity` tokens per expert
    pairs = hit.t().nonzero()                          # (expert, token), expert-major, tokens ascending
    e_of, t_of = pairs[:, 0], pairs[:, 1]
    mine = hit.sum(0)
    theirs = torch.empty_like(mine)
    dist.all_to_all_single(theirs, mine)
    out_sizes = mine.view(world, per).sum(1).tolist()
    in_sizes = theirs.view(world, per).sum(1).tolist()
    arrived = Trip.apply(x[t_of], out_sizes, in_sizes)
    which = torch.arange(per, device=x.device).repeat(world).repeat_interleave(theirs)
    result = torch.zeros_like(arrived)
    for j in range(per):
        sel = which == j
        result = result.masked_scatter(sel[:, None].expand_as(result), experts[j](arrived[sel]))
    returned = Trip.apply(result, in_sizes, out_sizes)
    return torch.zeros_like(x).index_add(0, t_of, returned * probs[t_of, e_of].unsqueeze(1))
'''),
])
SPECS = [RING, MOE]

# Every mutant and variant is judged by the real checker, through one warm launch per round of calls.
test_mutant_fails_naming_its_bug, test_correct_variant_passes, test_every_exercise_has_five_mutants_and_two_variants = \
    shared_mutant_tests(SPECS, "14", NAMESPACE)

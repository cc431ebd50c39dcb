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
SPECS = [RING]

# Every mutant and variant is judged by the real checker, through one warm launch per round of calls.
test_mutant_fails_naming_its_bug, test_correct_variant_passes, test_every_exercise_has_five_mutants_and_two_variants = \
    shared_mutant_tests(SPECS, "14", NAMESPACE)

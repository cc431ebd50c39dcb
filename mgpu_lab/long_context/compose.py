"""Composing parallelisms on a (2, 2) mesh of 4 ranks: CP x DP and EP x DP, one training step each, recorded.

The mesh puts rank ``2 * i + j`` at row ``i`` (the ``"dp"`` coordinate) and column ``j`` (``"cp"`` or
``"ep"``): the groups along ``cp``/``ep`` are ``[0, 1]`` and ``[2, 3]``, those along ``dp`` ``[0, 2]`` and
``[1, 3]``. Every collective of the step is recorded with :func:`mgpu_lab.comm.record.record`, whose events
name the global ranks of the group each one used.

- :func:`cp_dp_step`: each DP row takes its own sequence and its two CP ranks hold half of it each. A
  projection to Q, K and V (the model's one weight, replicated) runs on the local tokens; K and V
  travel to the other ranks of the CP group as point-to-point messages (a ring of sends and
  receives: ``W_cp - 1`` messages per rank, carrying K and V together), each rank attends its
  queries to the whole sequence's K and V, and in the backward pass the gradients of the blocks
  it received go back to their owners the same way. The weight's gradient is then averaged over
  **all four ranks**, DP x CP: each CP rank computed it from a different part of the sequence, so
  it is a partial sum just like a DP rank's. torchtitan does the same: FSDP shards and reduces over
  the ``dp_shard`` and ``cp`` dimensions flattened (``dp_shard_cp`` in its 2025 ``ParallelDims``,
  ``fsdp`` later), with ``dp_replicate`` on top under HSDP. ``reduce_over="dp"`` averages
  over the DP group only, the bug, and its gradient differs from one process's.
- :func:`ep_dp_step`: each rank has its own tokens; a shared layer (replicated on every rank) runs
  on them, then token ``t`` goes to expert ``t % 2``, which lives on column ``t % 2`` of the
  token's row (fixed routing, equal splits: a plain ``all_to_all_single`` each way, forward and
  backward, within the EP group). The shared layer's gradient is averaged over all four ranks;
  an expert's is summed over its DP group (its replicas: the ranks of the same column) and divided
  by the world size, since each replica saw only its row's tokens. ``reduce_over="dp"`` for the
  experts averages over the DP group instead, the bug: twice the right gradient.

:func:`reference_grads` computes the same gradients in one process; :func:`table` prints who
communicated with whom. The attention here gathers the sequence's K and V on every rank (no
blockwise merge) and the routing is fixed (no router, no capacity): the steps show which groups
communicate, nothing more.

Example:
    >>> from mgpu_lab import launch
    >>> runs = launch(cp_dp_step, 4)
    launch: 4 ranks · ...
    >>> sorted({(e["op"], tuple(e["ranks"])) for e in runs[0]["events"]})
    [('all_reduce', (0, 1, 2, 3)), ('recv', (0, 1)), ('send', (0, 1))]
    >>> torch.allclose(runs[0]["grads"]["qkv"], reference_grads("cp")["qkv"], atol=1e-6)
    True
"""
from __future__ import annotations

import torch
import torch.distributed as tdist
import torch.nn.functional as F

__all__ = ["MESH", "cp_dp_step", "ep_dp_step", "reference_grads", "table"]

MESH = (2, 2)  # (dp, cp) or (dp, ep)
SEQ, DIM, TOKENS, EXPERTS = 8, 4, 4, 2


def _mesh(second: str):
    from torch.distributed.device_mesh import init_device_mesh

    world = tdist.get_world_size()
    if world != MESH[0] * MESH[1]:
        raise ValueError(f"world_size={world}, but the (dp, {second}) mesh is {MESH[0]} x {MESH[1]}: "
                         f"launch {MESH[0] * MESH[1]} ranks")
    return init_device_mesh("cpu", MESH, mesh_dim_names=("dp", second))


def _weights(seed: int) -> dict:
    """The model's weights, the same in every rank (and in the one-process reference)."""
    gen = torch.Generator().manual_seed(seed)
    return {"qkv": torch.randn(DIM, 3 * DIM, generator=gen, dtype=torch.float64) / DIM ** 0.5,
            "shared": torch.randn(DIM, DIM, generator=gen, dtype=torch.float64) / DIM ** 0.5,
            "experts": torch.randn(EXPERTS, DIM, DIM, generator=gen, dtype=torch.float64) / DIM ** 0.5,
            "sequences": torch.randn(MESH[0], SEQ, DIM, generator=gen, dtype=torch.float64),
            "tokens": torch.randn(MESH[0] * MESH[1], TOKENS, DIM, generator=gen, dtype=torch.float64)}


def _exchange(tensor: torch.Tensor, to: int, source: int, group) -> torch.Tensor:
    """Send ``tensor`` to global rank ``to`` while receiving one like it from ``source``, within ``group``."""
    incoming = torch.empty_like(tensor)
    works = [tdist.isend(tensor.contiguous(), to, group=group), tdist.irecv(incoming, source, group=group)]
    for work in works:
        work.wait()
    return incoming


class _RingGather(torch.autograd.Function):
    """Every rank's block along dim -2, in the group's rank order, each block passed on around the ring.

    Backward: the gradient of each block that came from another rank goes back to it, point to point.
    """

    @staticmethod
    def forward(ctx, block, group):
        ranks = tdist.get_process_group_ranks(group)
        world, me = len(ranks), ranks.index(tdist.get_rank())
        blocks, current = [None] * world, block.detach()
        blocks[me] = current
        for i in range(1, world):  # after step i this rank holds the block of the rank i places behind
            current = _exchange(current, ranks[(me + 1) % world], ranks[(me - 1) % world], group)
            blocks[(me - i) % world] = current
        ctx.group = group
        return torch.cat(blocks, dim=-2)

    @staticmethod
    def backward(ctx, grad):
        ranks = tdist.get_process_group_ranks(ctx.group)
        world, me = len(ranks), ranks.index(tdist.get_rank())
        pieces = grad.chunk(world, dim=-2)
        mine = pieces[me].clone()
        for i in range(1, world):  # the gradient of the block from i places behind goes back there
            mine += _exchange(pieces[(me - i) % world], ranks[(me - i) % world], ranks[(me + i) % world], ctx.group)
        return mine, None


def _cp_loss(x, qkv, group, first: int):
    """This rank's loss: the mean square of its rows of causal attention over the whole sequence."""
    q, k, v = (x @ qkv).split(DIM, dim=-1)
    kv = _RingGather.apply(torch.cat([k, v], dim=-1), group)  # K and V travel as one message
    k_all, v_all = kv.split(DIM, dim=-1)
    rows = first + torch.arange(q.shape[-2])
    mask = rows[:, None] >= torch.arange(k_all.shape[-2])[None, :]
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask).pow(2).mean()


def _events(log) -> list:
    return [{"op": e["op"], "ranks": e["ranks"], "peer": e["peer"], "bytes": e["bytes"]}
            for e in log if e["op"] != "wait"]


def cp_dp_step(reduce_over: str = "dp_cp", seed: int = 0) -> dict:
    """One training step of CP x DP in this rank of a (2, 2) mesh, its collectives recorded.

    Args:
        reduce_over: ``"dp_cp"`` (all four ranks: right) or ``"dp"`` (the DP group only: the bug).
        seed: the weights' and data's seed.

    Returns:
        ``{"events": [{"op", "ranks", "peer", "bytes"}, ...], "grads": {"qkv": tensor}, "loss": float}``.
    """
    from mgpu_lab.comm.record import record

    if reduce_over not in ("dp_cp", "dp"):
        raise ValueError(f"reduce_over={reduce_over!r}: use 'dp_cp' (every rank) or 'dp' (the DP group only)")
    mesh, w = _mesh("cp"), _weights(seed)
    dp, cp, width = mesh.get_local_rank("dp"), mesh.get_local_rank("cp"), MESH[1]
    qkv = w["qkv"].clone().requires_grad_()
    x = w["sequences"][dp].chunk(width, dim=0)[cp]
    with record() as log:
        loss = _cp_loss(x, qkv, mesh.get_group("cp"), cp * (SEQ // width))
        loss.backward()
        group = None if reduce_over == "dp_cp" else mesh.get_group("dp")
        tdist.all_reduce(qkv.grad, group=group)
        qkv.grad /= tdist.get_world_size(group)
    return {"events": _events(log), "grads": {"qkv": qkv.grad}, "loss": loss.item()}


def _a2a(t: torch.Tensor, group) -> torch.Tensor:
    """A plain ``all_to_all_single`` of equal splits (no autograd: the step runs its backward by hand)."""
    out = torch.empty_like(t)
    tdist.all_to_all_single(out, t.contiguous(), group=group)
    return out


def _ep_forward(x, shared, expert, group):
    """The shared layer, then every token to its expert and back; returns what the backward needs."""
    h = torch.tanh(x @ shared)
    order = torch.argsort(torch.arange(TOKENS) % EXPERTS, stable=True)  # grouped by expert: equal splits
    received = _a2a(h.detach()[order], group).requires_grad_()
    y = received @ expert
    back = torch.empty_like(h)
    back[order] = _a2a(y.detach(), group)
    out = back.requires_grad_()
    return h, order, received, y, out, (h + out).pow(2).mean()


def ep_dp_step(reduce_over: str = "dp_world", seed: int = 0) -> dict:
    """One training step of EP x DP in this rank of a (2, 2) mesh, its collectives recorded.

    Args:
        reduce_over: how the expert's gradient is reduced: ``"dp_world"`` (summed over the DP group,
            divided by the world size: right) or ``"dp"`` (averaged over the DP group: the bug).
        seed: the weights' and data's seed.

    Returns:
        ``{"events": [...], "grads": {"shared": tensor, "expert": tensor (this rank's)}, "expert": int,
        "loss": float}``.
    """
    from mgpu_lab.comm.record import record

    if reduce_over not in ("dp_world", "dp"):
        raise ValueError(f"reduce_over={reduce_over!r}: use 'dp_world' (sum over DP / world size) or 'dp'")
    mesh, w = _mesh("ep"), _weights(seed)
    ep_group, dp_group = mesh.get_group("ep"), mesh.get_group("dp")
    shared = w["shared"].clone().requires_grad_()
    expert = w["experts"][mesh.get_local_rank("ep")].clone().requires_grad_()
    x = w["tokens"][tdist.get_rank()]
    with record() as log:
        h, order, received, y, out, loss = _ep_forward(x, shared, expert, ep_group)
        loss.backward(retain_graph=True)  # the shared layer's direct path; out's gradient
        y.backward(_a2a(out.grad[order], ep_group))  # the combine's backward: to the experts
        h.backward(_a2a(received.grad, ep_group)[torch.argsort(order)])  # the dispatch's: home
        tdist.all_reduce(shared.grad)
        shared.grad /= tdist.get_world_size()
        tdist.all_reduce(expert.grad, group=dp_group)
        expert.grad /= tdist.get_world_size() if reduce_over == "dp_world" else tdist.get_world_size(dp_group)
    return {"events": _events(log), "grads": {"shared": shared.grad, "expert": expert.grad},
            "expert": mesh.get_local_rank("ep"), "loss": loss.item()}


def reference_grads(kind: str, seed: int = 0) -> dict:
    """The same step's gradients in one process: ``"cp"`` -> ``{"qkv"}``, ``"ep"`` -> ``{"shared", "experts"}``.

    The loss is the mean over the four ranks of each rank's loss, which is what averaging the gradients
    over four ranks computes.
    """
    w = _weights(seed)
    if kind == "cp":
        qkv = w["qkv"].clone().requires_grad_()
        q, k, v = (w["sequences"] @ qkv).split(DIM, dim=-1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (dp, S, D)
        halves = out.chunk(MESH[1], dim=1)
        torch.stack([half.pow(2).mean(dim=(1, 2)) for half in halves]).mean().backward()
        return {"qkv": qkv.grad}
    if kind == "ep":
        shared = w["shared"].clone().requires_grad_()
        experts = w["experts"].clone().requires_grad_()
        h = torch.tanh(w["tokens"] @ shared)  # (ranks, T, D)
        picked = experts[torch.arange(TOKENS) % EXPERTS]  # (T, D, D): token t's expert
        out = torch.einsum("rtd,tde->rte", h, picked)
        (h + out).pow(2).mean(dim=(1, 2)).mean().backward()
        return {"shared": shared.grad, "experts": experts.grad}
    raise ValueError(f"kind={kind!r}: use 'cp' or 'ep'")


def _dimension(ranks: tuple, second: str) -> str:
    """The mesh dimension a group of global ranks runs along, on the (2, 2) mesh."""
    if len(ranks) == MESH[0] * MESH[1]:
        return f"dp x {second}"
    return second if ranks[1] - ranks[0] == 1 else "dp"


def table(runs: list, second: str = "cp") -> str:
    """Every rank's recorded calls, one line per kind of call: op, group (its global ranks and mesh dimension),
    peer, calls and bytes. ``second`` names the mesh's second dimension (``"cp"`` or ``"ep"``)."""
    lines = [f"{'rank':>4}  {'op':<10} {'group':<13} {'dimension':<9} {'peer':>4} {'calls':>5} {'bytes':>6}"]
    for rank, run in enumerate(runs):
        seen: dict = {}
        for e in run["events"]:
            key = (e["op"], tuple(e["ranks"] or ()), e["peer"])
            calls, total = seen.get(key, (0, 0))
            seen[key] = (calls + 1, total + e["bytes"])
        for (op, ranks, peer), (calls, total) in seen.items():
            lines.append(f"{rank:>4}  {op:<10} {str(list(ranks)):<13} {_dimension(ranks, second):<9} "
                         f"{'' if peer is None else peer:>4} {calls:>5} {total:>6}")
    return "\n".join(lines)

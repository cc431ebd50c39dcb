"""Train a small causal transformer with context parallelism (ring attention) x data parallelism: lesson 14.

Runs unchanged under torchrun, on GPUs or CPUs:

    torchrun --standalone --nproc-per-node=4 scripts/long_context_train.py --cp 2 --steps 20 --checkpoint-dir ckpt
    torchrun --standalone --nproc-per-node=4 scripts/long_context_train.py --cp 4 --steps 40 \\
        --checkpoint-dir ckpt --resume
    torchrun --nnodes=2 --node-rank=0 --nproc-per-node=8 --rdzv-backend=c10d \\
        --rdzv-endpoint=HOST:29500 scripts/long_context_train.py --cp 8 --seq 8192 --dim 512 --heads 8
    python scripts/long_context_train.py --cp 1     # one process: plain causal attention

``mgpu_lab.dist.setup()`` reads what torchrun sets and initialises the process group: NCCL
when every local rank has a GPU, else gloo. The ranks form a ``(world / cp, cp)`` mesh named
``("dp", "cp")``; the CP groups are neighbouring ranks. Each step a DP group takes its
``--batch-size`` sequences of the global batch, and each CP rank its shard of every sequence's
positions in the zig-zag layout (the sequence in ``2 cp`` chunks, rank ``r`` of a CP group
holding chunks ``r`` and ``2 cp - 1 - r``, so that causal attention gives every rank the same
work). Everything but attention is token-local; attention is exact ring attention over the CP
group (:class:`RingAttention`): K and V blocks travel around the ring by point-to-point
messages while each rank attends its queries blockwise and merges the partial results by
log-sum-exp; its backward sends K and V around the ring again, and the gradients of K and V
travel with them back to the rank that owns them. A rank holds K and V of at most three shards
at once (its own, kept for backward, the one it attends to and the one arriving), never the whole sequence's. The model is
sharded by FSDP2 over all ranks (the flattened ``dp x cp``, as torchtitan does): every CP rank
holds part of every sequence, so the weights' gradients are summed over CP and averaged over
DP, which one reduce-scatter over all ranks does once the loss is scaled. After
``--checkpoint-every`` steps every rank writes its shards of the model and of the optimizer's
state to ``--checkpoint-dir/step-N`` (``torch.distributed.checkpoint``); ``--resume`` loads the
newest one, at any world size and CP degree.

``--check-attention`` first compares ring attention (forward, and the gradients of q, k
and v) with full attention on the whole sequence, in float64, both layouts, causal or not,
on the CP group; ``--compare-reference`` trains the same steps in one process afterwards
(plain causal attention on whole sequences, the global batch) and prints the largest
difference of the losses and of the weights.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import socket
import sys
import time

import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import nn

from mgpu_lab import dist as mdist
from mgpu_lab.long_context.layout import chunks_of, shard
from mgpu_lab.parallel.baseline import max_diff
from mgpu_lab.sharding import distcp, fsdp, wrap


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cp", type=int, default=None, help="CP degree (default: 2 when the world size is even, else 1)")
    p.add_argument("--layout", choices=["zigzag", "contiguous"], default="zigzag",
                   help="which positions a CP rank holds")
    p.add_argument("--vocab", type=int, default=32, help="tokens in the vocabulary")
    p.add_argument("--dim", type=int, default=32, help="model width")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--hidden", type=int, default=64, help="the MLP's inner width")
    p.add_argument("--depth", type=int, default=2, help="number of blocks")
    p.add_argument("--seq", type=int, default=64, help="sequence length (a multiple of 2 x --cp)")
    p.add_argument("--samples", type=int, default=64, help="sequences in the synthetic data set")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per DP group and step")
    p.add_argument("--steps", type=int, default=10, help="train until this step (exclusive)")
    p.add_argument("--lr", type=float, default=3e-3, help="Adam's learning rate")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", choices=["nccl", "gloo"], default=None, help="default: nccl on GPUs, else gloo")
    p.add_argument("--checkpoint-dir", default=None, help="every rank writes its shards to DIR/step-N")
    p.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints (0: at the end only)")
    p.add_argument("--resume", action="store_true", help="continue from the newest DIR/step-N")
    p.add_argument("--check-attention", action="store_true",
                   help="first compare ring attention and its gradients with full attention (float64)")
    p.add_argument("--compare-reference", action="store_true",
                   help="rank 0 also trains all steps in one process on the global batch and prints the largest "
                        "loss and weight differences")
    return p.parse_args(argv)


def say(message: str, every_rank: bool = False) -> None:
    """Print on rank 0 (or on every rank) in one write, so lines of ranks never interleave."""
    if every_rank or mdist.is_main_process():
        sys.stdout.write(message + "\n")
        sys.stdout.flush()


# ---------------------------------------------------------------- ring attention

def _work(me: int, src: int, world: int, layout: str, causal: bool) -> list[tuple[int, int, bool]]:
    """The (query chunk, key chunk, diagonal) pairs of rank ``me``'s queries against ``src``'s keys with work.

    Chunks are equal and aligned, so under the causal mask a pair is whole (the query chunk
    comes later), diagonal (the same chunk: the triangle) or empty (skipped: no FLOPs).
    """
    pairs = []
    for i, a in enumerate(chunks_of(me, world, layout)):
        for j, b in enumerate(chunks_of(src, world, layout)):
            if not causal or a > b:
                pairs.append((i, j, False))
            elif a == b:
                pairs.append((i, j, True))
    return pairs


def _scores(q, k, diagonal: bool, scale: float) -> torch.Tensor:
    s = (q @ k.transpose(-2, -1)) * scale
    if diagonal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def _pass_on(tensors: list, ring: list[int], me: int, group) -> tuple[list, list]:
    """Start sending ``tensors`` to the next rank of the ring and receiving the previous rank's.

    One batch of non-blocking sends and receives: with NCCL, whose point-to-point calls queue on one
    stream, separate blocking-in-order sends of every rank to its neighbour could wait on each other.
    """
    world = len(ring)
    got = [torch.empty_like(t) for t in tensors]
    ops = [tdist.P2POp(tdist.isend, t, ring[(me + 1) % world], group) for t in tensors]
    ops += [tdist.P2POp(tdist.irecv, g, ring[(me - 1) % world], group) for g in got]
    return got, tdist.batch_isend_irecv(ops)


def _arrived(works: list) -> None:
    for work in works:
        work.wait()


class RingAttention(torch.autograd.Function):
    """Exact attention of this rank's shard of the sequence, K and V travelling around the CP group.

    Forward: at step ``t`` a rank holds the K and V of the rank ``t`` places before it, starts
    passing them on, attends its queries to them (the pairs of chunks the mask leaves work
    in) and merges by log-sum-exp; it keeps only its own q, k, v, the output and the
    log-sum-exp per row. Backward: K and V go around the ring once more, each with the
    gradient of K and V accumulated so far, which every rank adds its part to; after the
    last hop the gradients are back at their owners.
    """

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, layout: str, group):
        ring, world = tdist.get_process_group_ranks(group), tdist.get_world_size(group)
        me = tdist.get_rank(group)
        size = q.shape[-2] // len(chunks_of(0, world, layout))
        scale = 1.0 / math.sqrt(q.shape[-1])
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1] + (1,), float("-inf"), dtype=q.dtype, device=q.device)
        kv = [k.contiguous(), v.contiguous()]
        for step in range(world):
            if step < world - 1:
                nxt, works = _pass_on(kv, ring, me, group)
            for i, j, diagonal in _work(me, (me - step) % world, world, layout, causal):
                rows, cols = slice(i * size, (i + 1) * size), slice(j * size, (j + 1) * size)
                s = _scores(q[..., rows, :], kv[0][..., cols, :], diagonal, scale)
                block_lse = torch.logsumexp(s, dim=-1, keepdim=True)
                merged = torch.logaddexp(lse[..., rows, :], block_lse)
                out[..., rows, :] = (out[..., rows, :] * torch.exp(lse[..., rows, :] - merged)
                                     + torch.exp(s - merged) @ kv[1][..., cols, :])
                lse[..., rows, :] = merged
            if step < world - 1:
                _arrived(works)
                kv = nxt
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.setup = (causal, layout, group, ring, me, size, scale)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        causal, layout, group, ring, me, size, scale = ctx.setup
        world = len(ring)
        dout = dout.contiguous()
        delta = (dout * out).sum(dim=-1, keepdim=True)
        dq = torch.zeros_like(q)
        kv = [k.contiguous(), v.contiguous()]
        dkv = [torch.zeros_like(t) for t in kv]  # contiguous, to be sent
        for step in range(world):
            if step < world - 1:
                nxt, works = _pass_on(kv, ring, me, group)
            for i, j, diagonal in _work(me, (me - step) % world, world, layout, causal):
                rows, cols = slice(i * size, (i + 1) * size), slice(j * size, (j + 1) * size)
                qi, do = q[..., rows, :], dout[..., rows, :]
                p = torch.exp(_scores(qi, kv[0][..., cols, :], diagonal, scale) - lse[..., rows, :])
                dkv[1][..., cols, :] += p.transpose(-2, -1) @ do
                ds = p * (do @ kv[1][..., cols, :].transpose(-2, -1) - delta[..., rows, :]) * scale
                dq[..., rows, :] += ds @ kv[0][..., cols, :]
                dkv[0][..., cols, :] += ds.transpose(-2, -1) @ qi
            if world > 1:  # the gradients follow their K and V; the last hop takes them home
                dkv, grad_works = _pass_on(dkv, ring, me, group)
                _arrived(grad_works)
            if step < world - 1:
                _arrived(works)
                kv = nxt
        return dq, dkv[0], dkv[1], None, None, None


def ring_attend(q, k, v, causal: bool = True, layout: str = "zigzag", group=None) -> torch.Tensor:
    """This rank's rows of attention over the whole sequence of the CP ``group`` (default: every rank).

    ``q``, ``k``, ``v`` are this rank's shards ``(B, H, S/W, D)`` in ``layout``; so is the result.
    """
    return RingAttention.apply(q, k, v, causal, layout, group or tdist.group.WORLD)


def full_attend(q, k, v) -> torch.Tensor:
    """Causal attention over whole sequences in one process."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


# ---------------------------------------------------------------- the model and its data

class Block(nn.Module):
    """Pre-norm attention and MLP; ``attend(q, k, v)`` is the only part that looks at other positions."""

    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.qkv, self.proj = nn.LayerNorm(dim), nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, x, attend):
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(attend(q, k, v).transpose(1, 2).reshape(b, n, d))
        return x + self.mlp(self.norm2(x))


class CausalLM(nn.Module):
    """Token and position embeddings, ``depth`` blocks, a head over the vocabulary: logits ``(B * n, vocab)``."""

    def __init__(self, args):
        super().__init__()
        torch.manual_seed(args.seed)
        self.embed, self.pos = nn.Embedding(args.vocab, args.dim), nn.Embedding(args.seq, args.dim)
        self.blocks = nn.ModuleList(Block(args.dim, args.heads, args.hidden) for _ in range(args.depth))
        self.norm, self.head = nn.LayerNorm(args.dim), nn.Linear(args.dim, args.vocab)

    def forward(self, tokens, positions, attend):
        x = self.embed(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x, attend)
        return self.head(self.norm(x).flatten(0, 1))  # (tokens, vocab): a new tensor, not a view of one


def dataset(args) -> torch.Tensor:
    """``samples`` sequences of ``seq + 1`` tokens: each the sum of the two before it and one far back."""
    g = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(args.vocab, (args.samples, args.seq + 1), generator=g)
    lag = max(3, args.seq // 4)
    for t in range(lag, args.seq + 1):
        tokens[:, t] = (tokens[:, t - 1] + tokens[:, t - 2] + tokens[:, t - lag]) % args.vocab
    return tokens


def global_batch(args, data: torch.Tensor, step: int, dp: int) -> torch.Tensor:
    """The sequences of step ``step`` for all ``dp`` groups together, in order (wrapping around the data)."""
    n = args.batch_size * dp
    return data[torch.arange(step * n, (step + 1) * n) % data.shape[0]]


def make_optimizer(args, model):
    return torch.optim.Adam(model.parameters(), lr=args.lr)


# ---------------------------------------------------------------- training

def train_step(model, optimizer, batch, mesh, args, device) -> float:
    """One step on this rank's part (its DP group's sequences, its CP shard of them); the global mean loss."""
    dp, cp = mesh["dp"].size(), mesh["cp"].size()
    d, c = mesh["dp"].get_local_rank(), mesh["cp"].get_local_rank()
    mine = batch.chunk(dp)[d]
    tokens, targets = (shard(t, c, cp, args.layout, dim=1).to(device) for t in (mine[:, :-1], mine[:, 1:]))
    positions = shard(torch.arange(args.seq), c, cp, args.layout, dim=0).to(device)
    group = mesh["cp"].get_group()
    optimizer.zero_grad()
    logits = model(tokens, positions, lambda q, k, v: ring_attend(q, k, v, True, args.layout, group))
    local = F.cross_entropy(logits, targets.flatten(), reduction="sum")
    # FSDP averages the gradients over all dp x cp ranks: the mean over the global batch's tokens is the
    # sum of every rank's part, so each rank's part is scaled by the world size over the tokens.
    count = batch.shape[0] * args.seq
    (local * dp * cp / count).backward()
    optimizer.step()
    total = local.detach().clone()
    tdist.all_reduce(total)
    return total.item() / count


def reference(args, data, dp: int, steps: int, dtype) -> tuple[list, dict]:
    """One process, whole sequences, the global batch, the same steps: the losses and weights CP x DP must give."""
    model = CausalLM(args).to(dtype)
    optimizer = make_optimizer(args, model)
    losses = []
    for step in range(steps):
        batch = global_batch(args, data, step, dp)
        optimizer.zero_grad()
        logits = model(batch[:, :-1], torch.arange(args.seq), full_attend)
        loss = F.cross_entropy(logits, batch[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {name: p.detach() for name, p in model.named_parameters()}


def check_attention(mesh, device) -> str:
    """Ring attention against full attention on the CP group (float64): the largest differences, as a line.

    Also says which messages one call sent and received, forward and backward (``mgpu_lab.comm.record``).
    """
    from mgpu_lab.comm.record import record, summarize
    from mgpu_lab.long_context.measure import inputs

    group, cp, c = mesh["cp"].get_group(), mesh["cp"].size(), mesh["cp"].get_local_rank()
    worst, calls = {"out": 0.0, "grads": 0.0}, []
    for layout in ("contiguous", "zigzag"):
        for causal in (True, False):
            full = [t.to(device).requires_grad_() for t in inputs(2, 2, 8 * cp, 8, dtype=torch.float64, seed=1)]
            want = F.scaled_dot_product_attention(*full, is_causal=causal)
            dout = torch.randn(want.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(device)
            want.backward(dout)
            mine = [shard(t.detach(), c, cp, layout).requires_grad_() for t in full]
            with record() as forward:
                got = ring_attend(*mine, causal=causal, layout=layout, group=group)
            with record() as backward:
                got.backward(shard(dout, c, cp, layout))
            calls.append((summarize(forward), summarize(backward)))
            worst["out"] = max(worst["out"], (got - shard(want, c, cp, layout)).abs().max().item())
            for t, m in zip(full, mine):
                worst["grads"] = max(worst["grads"], (m.grad - shard(t.grad, c, cp, layout)).abs().max().item())
    verdict = torch.tensor([worst["out"], worst["grads"]], dtype=torch.float64)
    tdist.all_reduce(verdict, op=tdist.ReduceOp.MAX)
    return (f"ring attention against full attention (cp={cp}, float64, both layouts, causal and not): "
            f"max |out diff| {verdict[0].item():.3g}, max |grad diff| {verdict[1].item():.3g}; rank "
            f"{tdist.get_rank()}'s communication per call: forward {calls[0][0]}, backward {calls[0][1]}"
            + ("" if all(call == calls[0] for call in calls) else f", not the same in every case: {calls}"))


def newest_checkpoint(directory: str | None) -> tuple[str, int] | None:
    """``(path, step)`` of the newest complete ``step-N`` (one with ``.metadata``), or None."""
    if not directory or not os.path.isdir(directory):
        return None
    found = [(int(m.group(1)), os.path.join(directory, name)) for name in os.listdir(directory)
             if (m := re.fullmatch(r"step-(\d+)", name)) and os.path.isfile(os.path.join(directory, name, ".metadata"))]
    return (max(found)[1], max(found)[0]) if found else None


def setup_process_group(backend: str | None) -> None:
    if "WORLD_SIZE" not in os.environ:  # plain python: a process group of one, as torchrun would make it
        with socket.socket() as probe:  # a free port for the group's store
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    mdist.setup(backend)


def make_mesh(args, world: int, device):
    """The ``("dp", "cp")`` mesh; exits naming the numbers when ``--cp`` does not fit."""
    from torch.distributed.device_mesh import init_device_mesh

    cp = args.cp or (2 if world % 2 == 0 else 1)
    pieces = 2 * cp if args.layout == "zigzag" else cp
    if cp < 1 or world % cp or args.seq % pieces or args.dim % args.heads:
        raise SystemExit(f"--cp {cp} must divide the world size ({world}), {pieces} chunks ({args.layout} layout) "
                         f"must divide --seq ({args.seq}), and --heads ({args.heads}) must divide --dim ({args.dim})")
    return init_device_mesh(device.type, (world // cp, cp), mesh_dim_names=("dp", "cp"))


def main(argv=None) -> int:
    args = parse_args(argv)
    setup_process_group(args.backend)
    me, device = mdist.info(), fsdp.rank_device()
    dtype = getattr(torch, args.dtype)
    mesh = make_mesh(args, me.world_size, device)
    dp, cp = mesh["dp"].size(), mesh["cp"].size()
    d, c = mesh.get_coordinate()
    say(f"rank {me.rank}/{me.world_size} local_rank {me.local_rank} node {me.node_rank}: backend "
        f"{tdist.get_backend()}, device {device}, mesh (dp={d}, cp={c}), CP group "
        f"{tdist.get_process_group_ranks(mesh['cp'].get_group())}, pid {os.getpid()}", every_rank=True)
    if args.check_attention:
        say(check_attention(mesh, device))

    model = CausalLM(args).to(device=device, dtype=dtype)
    n_params = sum(p.numel() for p in model.parameters())
    wrap.shard_model(model, fsdp.make_mesh(device, "dp_cp"))      # FSDP over every rank, then the root
    optimizer = make_optimizer(args, model)                         # after fully_shard: DTensor parameters
    say(f"{n_params:,} parameters in {args.depth} blocks on a (dp={dp}, cp={cp}) mesh, {args.layout} layout, "
        f"{args.dtype}; {args.batch_size} sequences of {args.seq} tokens per DP group, {args.seq // cp} positions "
        f"per CP rank, global batch {args.batch_size * dp}; steps until {args.steps}")

    data = dataset(args)
    start_step = 0
    newest = newest_checkpoint(args.checkpoint_dir) if args.resume else None
    if newest:
        distcp.load_checkpoint(model, optimizer, newest[0])         # resharded to this world size
        start_step = newest[1]
        say(f"resumed from {newest[0]} (after {newest[1]} steps)")

    start, losses = time.perf_counter(), {}
    for step in range(start_step, args.steps):
        losses[step] = train_step(model, optimizer, global_batch(args, data, step, dp), mesh, args, device)
        say(f"step {step}: loss {losses[step]:.6f}")
        done = step + 1
        every = args.checkpoint_every and done % args.checkpoint_every == 0
        if args.checkpoint_dir and (done == args.steps or every):
            path = os.path.join(args.checkpoint_dir, f"step-{done}")
            distcp.save_checkpoint(model, optimizer, path)          # every rank writes its own shards
            say(f"checkpoint {path} ({len(os.listdir(path))} files)")
    say(f"done in {time.perf_counter() - start:.2f} s")
    if args.compare_reference:
        trained = fsdp.full_params(model)                           # a collective: every rank
        if me.rank == 0:
            ref_losses, ref = reference(args, data, dp, args.steps, dtype)
            loss_diff = max((abs(losses[s] - ref_losses[s]) for s in losses), default=0.0)
            say(f"one process with global batch {args.batch_size * dp}: max |loss diff| {loss_diff:.3g}, "
                f"max |weight diff| {max_diff(trained, ref):.3g}")
    mdist.teardown()
    return 0


if __name__ == "__main__":
    mdist.leave(main())  # without the C++ teardown at interpreter exit, which can abort a finished rank

"""Train a stack of transformer blocks on a 2D mesh, TP inside, FSDP across, with DCP checkpoints: lesson 11.

Runs unchanged under torchrun, on GPUs or CPUs:

    torchrun --standalone --nproc-per-node=4 scripts/tp_train.py --tp 2 --steps 20 --checkpoint-dir ckpt
    torchrun --standalone --nproc-per-node=4 scripts/tp_train.py --tp 2 --steps 40 --checkpoint-dir ckpt --resume
    torchrun --nnodes=2 --node-rank=0 --nproc-per-node=8 --rdzv-backend=c10d \\
        --rdzv-endpoint=HOST:29500 scripts/tp_train.py --tp 8 --dim 1024 --heads 16 --hidden 4096
    python scripts/tp_train.py --tp 1      # one process: a mesh of (1, 1)

``mgpu_lab.dist.setup()`` reads what torchrun sets and initialises the process group:
NCCL when every local rank has a GPU, else gloo (DTensor and tensor parallelism run on
the CPU with gloo too). The ranks form a ``(world / tp, tp)`` mesh named ``("dp", "tp")``
whose TP groups are neighbouring ranks (on a cluster, the GPUs of one node: set ``--tp``
to the GPUs per node). Every block is split by TP with sequence parallelism, then sharded
by FSDP over "dp" (``mgpu_lab.tensor_parallel.plans``). Each step a DP group takes its
``--batch-size`` sequences of the global batch and each TP rank its slice of the sequence.
After ``--checkpoint-every`` steps every rank writes its shards of the model and of the optimizer's
state to ``--checkpoint-dir/step-N`` (``torch.distributed.checkpoint``); ``--resume`` loads
the newest one, at any world size and TP degree.
"""
from __future__ import annotations

import argparse
import logging
import os
import re
import socket
import sys
import time

import torch
import torch.distributed as tdist

from mgpu_lab import dist as mdist
from mgpu_lab.parallel.baseline import max_diff
from mgpu_lab.sharding import distcp
from mgpu_lab.tensor_parallel.block import Stack, make_mesh_2d
from mgpu_lab.tensor_parallel.plans import shard_2d


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=None, help="TP degree (default: 2 when the world size is even, else 1)")
    p.add_argument("--dim", type=int, default=32, help="model width")
    p.add_argument("--heads", type=int, default=4, help="attention heads (a multiple of --tp)")
    p.add_argument("--hidden", type=int, default=128, help="the MLP's inner width")
    p.add_argument("--depth", type=int, default=2, help="number of blocks")
    p.add_argument("--seq", type=int, default=16, help="sequence length (a multiple of --tp)")
    p.add_argument("--samples", type=int, default=256, help="sequences in the synthetic data set")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per DP group and step")
    p.add_argument("--steps", type=int, default=10, help="train until this step (exclusive)")
    p.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    p.add_argument("--lr", type=float, default=1e-3, help="the learning rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", choices=["nccl", "gloo"], default=None, help="default: nccl on GPUs, else gloo")
    p.add_argument("--checkpoint-dir", default=None, help="every rank writes its shards to DIR/step-N")
    p.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints (0: at the end only)")
    p.add_argument("--resume", action="store_true", help="continue from the newest DIR/step-N")
    p.add_argument("--compare-reference", action="store_true",
                   help="rank 0 also trains all steps in one process on the global batch and prints the largest "
                        "weight difference")
    return p.parse_args(argv)


def say(message: str, every_rank: bool = False) -> None:
    """Print on rank 0 (or on every rank) in one write, so lines of ranks never interleave."""
    if every_rank or mdist.is_main_process():
        sys.stdout.write(message + "\n")
        sys.stdout.flush()


def dataset(args) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets ``[samples, seq, dim]``: the targets a fixed smooth function of the inputs."""
    g = torch.Generator().manual_seed(args.seed)
    x = torch.randn(args.samples, args.seq, args.dim, generator=g)
    mix = torch.randn(args.dim, args.dim, generator=g) / args.dim ** 0.5
    return x, torch.tanh(x @ mix) + x.roll(1, dims=1)


def global_batch(args, x, y, step: int, dp: int):
    """The sequences of step ``step``, for all ``dp`` groups together, in order (wrapping around the data set)."""
    n = args.batch_size * dp
    idx = torch.arange(step * n, (step + 1) * n) % x.shape[0]
    return x[idx], y[idx]


def newest_checkpoint(directory: str | None) -> tuple[str, int] | None:
    """``(path, step)`` of the newest complete ``step-N`` (one with ``.metadata``), or None."""
    if not directory or not os.path.isdir(directory):
        return None
    found = [(int(m.group(1)), os.path.join(directory, name)) for name in os.listdir(directory)
             if (m := re.fullmatch(r"step-(\d+)", name)) and os.path.isfile(os.path.join(directory, name, ".metadata"))]
    return (max(found)[1], max(found)[0]) if found else None


def train_step(model, optimizer, xb, yb, mesh, device) -> float:
    """One step on this rank's part: its DP group's sequences, its TP slice of the sequence; the global loss."""
    dp, tp = mesh["dp"].size(), mesh["tp"].size()
    d, t = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    xs = xb.chunk(dp)[d].chunk(tp, dim=1)[t].to(device)
    ys = yb.chunk(dp)[d].chunk(tp, dim=1)[t].to(device)
    optimizer.zero_grad()
    out = model(xs)
    out = out.to_local() if hasattr(out, "to_local") else out
    local = (out - ys).square().sum()
    # FSDP averages the gradients over "dp"; TP's collectives add the TP ranks' parts: the mean over the
    # global batch is this rank's sum divided by the elements of one DP group's share.
    (local * dp / yb.numel()).backward()
    optimizer.step()
    total = local.detach().clone()
    tdist.all_reduce(total)
    return total.item() / yb.numel()


def reference(args, x, y, dp: int, steps: int) -> dict:
    """One process, the global batch, the same steps: the weights the 2D training must end with."""
    model = Stack(args.depth, args.dim, args.heads, args.hidden, seed=args.seed)
    optimizer = make_optimizer(args, model)
    for step in range(steps):
        xb, yb = global_batch(args, x, y, step, dp)
        optimizer.zero_grad()
        (model(xb) - yb).square().mean().backward()
        optimizer.step()
    return {name: p.detach() for name, p in model.named_parameters()}


def make_optimizer(args, model):
    cls = torch.optim.Adam if args.optimizer == "adam" else torch.optim.SGD
    return cls(model.parameters(), lr=args.lr)


def full_weights(model) -> dict:
    """Every parameter whole, on the CPU (collectives: every rank calls it)."""
    quiet = logging.getLogger("torch.distributed.tensor._redistribute")
    level, quiet.level = quiet.level, logging.ERROR  # "2 sequential all_gather operations": fine for a comparison
    try:
        return {n: p.full_tensor().cpu() for n, p in model.named_parameters()}
    finally:
        quiet.setLevel(level)


def setup_process_group(backend: str | None) -> None:
    if "WORLD_SIZE" not in os.environ:  # plain python: a process group of one, as torchrun would make it
        with socket.socket() as probe:  # a free port for the group's store
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    mdist.setup(backend)


def main(argv=None) -> int:
    args = parse_args(argv)
    setup_process_group(args.backend)
    me = mdist.info()
    tp = args.tp or (2 if me.world_size % 2 == 0 else 1)
    if me.world_size % tp or args.heads % tp or args.seq % tp:
        raise SystemExit(f"--tp {tp} must divide the world size ({me.world_size}), --heads ({args.heads}) and "
                         f"--seq ({args.seq})")
    mesh = make_mesh_2d(me.world_size // tp, tp)
    device = torch.device("cuda", torch.cuda.current_device()) if tdist.get_backend() == "nccl" else torch.device("cpu")
    d, t = mesh.get_coordinate()
    say(f"rank {me.rank}/{me.world_size} local_rank {me.local_rank} node {me.node_rank}: backend "
        f"{tdist.get_backend()}, device {device}, mesh (dp={d}, tp={t}), pid {os.getpid()}", every_rank=True)

    model = Stack(args.depth, args.dim, args.heads, args.hidden, seed=args.seed).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    shard_2d(model, mesh)                                           # TP over "tp", then FSDP over "dp"
    optimizer = make_optimizer(args, model)                         # after both: DTensor parameters
    dp = mesh["dp"].size()
    say(f"{n_params:,} parameters in {args.depth} blocks on a (dp={dp}, tp={tp}) mesh; {args.batch_size} sequences "
        f"per DP group, global batch {args.batch_size * dp}; steps until {args.steps}")

    x, y = dataset(args)
    start_step = 0
    newest = newest_checkpoint(args.checkpoint_dir) if args.resume else None
    if newest:
        distcp.load_checkpoint(model, optimizer, newest[0])         # resharded to this mesh
        start_step = newest[1]
        say(f"resumed from {newest[0]} (after {newest[1]} steps)")

    start = time.perf_counter()
    for step in range(start_step, args.steps):
        loss = train_step(model, optimizer, *global_batch(args, x, y, step, dp), mesh, device)
        say(f"step {step}: loss {loss:.5f}")
        done = step + 1
        every = args.checkpoint_every and done % args.checkpoint_every == 0
        if args.checkpoint_dir and (done == args.steps or every):
            path = os.path.join(args.checkpoint_dir, f"step-{done}")
            distcp.save_checkpoint(model, optimizer, path)          # every rank writes its own shards
            say(f"checkpoint {path} ({len(os.listdir(path))} files)")
    say(f"done in {time.perf_counter() - start:.2f} s")
    if args.compare_reference:
        trained = full_weights(model)
        if me.rank == 0:
            ref = reference(args, x, y, dp, args.steps)
            diff = max_diff(trained, ref)
            say(f"max |2D weights - one process with global batch {args.batch_size * dp}| = {diff:.3g}")
    mdist.teardown()
    return 0


if __name__ == "__main__":
    mdist.leave(main())  # without the C++ teardown at interpreter exit, which can abort a finished rank

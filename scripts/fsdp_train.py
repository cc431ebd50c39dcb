"""Train a BlockNet sharded with FSDP2, with distributed checkpoints: lesson 08 as a plain script.

Runs unchanged under torchrun, on one machine or several, on GPUs or CPUs:

    torchrun --standalone --nproc-per-node=2 scripts/fsdp_train.py --epochs 2 --checkpoint-dir ckpt
    torchrun --standalone --nproc-per-node=4 scripts/fsdp_train.py --epochs 3 --checkpoint-dir ckpt --resume
    torchrun --nnodes=2 --node-rank=0 --nproc-per-node=8 --rdzv-backend=c10d \\
        --rdzv-endpoint=HOST:29500 scripts/fsdp_train.py --width 1024 --depth 16
    python scripts/fsdp_train.py            # one process: a process group of one

``mgpu_lab.dist.setup()`` reads what torchrun sets and initialises the process
group: NCCL when every local rank has a GPU, else gloo. The mesh follows the
backend (``cuda:LOCAL_RANK`` with NCCL, the CPU with gloo); every block of the
model and then the root are sharded with ``fully_shard``; Adam is built after
that, from the DTensor parameters. ``--batch-size`` is per rank, the sampler a
``DistributedSampler`` with ``set_epoch``. After every epoch each rank writes its
shards of the model and of Adam's state to ``--checkpoint-dir/epoch-N`` with
``torch.distributed.checkpoint``; ``--resume`` loads the newest one, at any world size.
"""
from __future__ import annotations

import argparse
import os
import re
import socket
import sys
import time

import torch
import torch.distributed as tdist
import torch.nn.functional as F

from mgpu_lab.data import datasets
from mgpu_lab.parallel import ddp
from mgpu_lab.sharding import distcp, fsdp, wrap
from mgpu_lab import dist as mdist


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=256, help="training samples (default 256)")
    p.add_argument("--features", type=int, default=8)
    p.add_argument("--classes", type=int, default=3)
    p.add_argument("--width", type=int, default=32, help="width of every block")
    p.add_argument("--depth", type=int, default=4, help="number of blocks (one FSDP group each)")
    p.add_argument("--epochs", type=int, default=2, help="train until this epoch (exclusive)")
    p.add_argument("--batch-size", type=int, default=16, help="per rank; global batch = batch size x world size")
    p.add_argument("--lr", type=float, default=1e-2, help="Adam's learning rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", choices=["nccl", "gloo"], default=None, help="default: nccl on GPUs, else gloo")
    p.add_argument("--checkpoint-dir", default=None, help="every rank writes its shards to DIR/epoch-N")
    p.add_argument("--resume", action="store_true", help="continue from the newest DIR/epoch-N")
    p.add_argument("--compare-reference", action="store_true",
                   help="rank 0 also trains all epochs in one process with the global batch and prints the "
                        "largest weight difference")
    return p.parse_args(argv)


def say(message: str, every_rank: bool = False) -> None:
    """Print on rank 0 (or on every rank) in one write, so lines of ranks never interleave."""
    if every_rank or mdist.is_main_process():
        sys.stdout.write(message + "\n")
        sys.stdout.flush()


def newest_checkpoint(directory: str | None) -> tuple[str, int] | None:
    """``(path, epoch)`` of the newest complete ``epoch-N`` (one with ``.metadata``), or None."""
    if not directory or not os.path.isdir(directory):
        return None
    found = [(int(m.group(1)), os.path.join(directory, name)) for name in os.listdir(directory)
             if (m := re.fullmatch(r"epoch-(\d+)", name))
             and os.path.isfile(os.path.join(directory, name, ".metadata"))]
    return (max(found)[1], max(found)[0]) if found else None


def run_epoch(model, optimizer, loader, device) -> float:
    total, count = 0.0, 0
    for x, y in loader:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x.to(device)), y.to(device))
        loss.backward()
        optimizer.step()
        total, count = total + loss.item(), count + 1
    return ddp.mean_over_ranks(total, count)


def reference(args, train_set, world: int) -> dict:
    """One process, the global batch, the same order of samples: the weights FSDP must end with."""
    model = fsdp.BlockNet(args.features, args.width, args.depth, args.classes, seed=args.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    loader, sampler = ddp.distributed_loader(train_set, args.batch_size * world, seed=args.seed, num_replicas=1, rank=0)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
    return {name: p.detach() for name, p in model.named_parameters()}


def main(argv=None) -> int:
    args = parse_args(argv)
    if "WORLD_SIZE" not in os.environ:  # plain python: a process group of one, as torchrun would make it
        with socket.socket() as probe:  # a free port for the group's store
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    mdist.setup(args.backend)
    me, device = mdist.info(), fsdp.rank_device()
    say(f"rank {me.rank}/{me.world_size} local_rank {me.local_rank} node {me.node_rank}: backend "
        f"{tdist.get_backend()}, device {device}, pid {os.getpid()}", every_rank=True)

    train_set = datasets.synthetic_classification(args.samples, args.features, args.classes, seed=args.seed)
    loader, sampler = ddp.distributed_loader(train_set, args.batch_size, seed=args.seed)
    model = fsdp.BlockNet(args.features, args.width, args.depth, args.classes, seed=args.seed).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    wrap.shard_model(model, fsdp.make_mesh(device))              # every block, then the root
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)  # after fully_shard: DTensor parameters
    say(f"{n_params:,} parameters in {args.depth} blocks sharded over {me.world_size} rank(s); batch "
        f"{args.batch_size} per rank, global {args.batch_size * me.world_size}; {args.epochs} epoch(s)")

    start_epoch = 0
    newest = newest_checkpoint(args.checkpoint_dir) if args.resume else None
    if newest:
        distcp.load_checkpoint(model, optimizer, newest[0])       # resharded to this world size
        start_epoch = newest[1] + 1
        say(f"resumed from {newest[0]} (after epoch {newest[1]})")

    start = time.perf_counter()
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        loss = run_epoch(model, optimizer, loader, device)
        say(f"epoch {epoch}: mean loss {loss:.4f}")
        if args.checkpoint_dir:
            path = os.path.join(args.checkpoint_dir, f"epoch-{epoch}")
            distcp.save_checkpoint(model, optimizer, path)        # every rank writes its own shards
            say(f"epoch {epoch}: checkpoint {path} ({len(os.listdir(path))} files)")
    say(f"done in {time.perf_counter() - start:.2f} s")
    if args.compare_reference:
        trained = fsdp.full_params(model)                        # a collective: every rank
        if me.rank == 0:
            ref = reference(args, train_set, me.world_size)
            diff = ddp.max_diff(trained, ref)
            say(f"max |FSDP weights - one process with global batch {args.batch_size * me.world_size}| = {diff:.3g}")
    mdist.teardown()
    return 0


if __name__ == "__main__":
    mdist.leave(main())  # without the C++ teardown at interpreter exit, which can abort a finished rank

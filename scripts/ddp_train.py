"""Train a small classifier with DistributedDataParallel: lesson 04 as a plain script.

Runs unchanged under torchrun, on one machine or several:

    torchrun --standalone --nproc-per-node=2 scripts/ddp_train.py --epochs 3
    torchrun --nnodes=2 --node-rank=0 --nproc-per-node=4 --rdzv-backend=c10d \\
        --rdzv-endpoint=HOST:29500 scripts/ddp_train.py --checkpoint-dir ckpt
    python scripts/ddp_train.py            # one process, no process group

torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and
MASTER_PORT; ``mgpu_lab.dist.setup()`` reads them and initialises the process
group (env://) with NCCL when every local rank has a GPU, else gloo. The model is
wrapped in DDP (``device_ids=[local_rank]`` on GPUs), the DistributedSampler
gets ``set_epoch`` every epoch, ``--batch-size`` is per rank, evaluation
all-reduces sums and counts, and rank 0 logs and writes checkpoints.
With ``--data-url`` the data set is downloaded once per node from that URL.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch import nn
from torch.utils.data import Subset

from mgpu_lab.data import datasets, download
from mgpu_lab.data import per_node
from mgpu_lab.parallel import ddp
from mgpu_lab import dist as mdist


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=512, help="training samples (default 512)")
    p.add_argument("--val-samples", type=int, default=130, help="validation samples (default 130)")
    p.add_argument("--features", type=int, default=8)
    p.add_argument("--classes", type=int, default=3)
    p.add_argument("--hidden", type=int, default=32, help="hidden units of the MLP")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=16, help="per rank; global batch = batch size x world size")
    p.add_argument("--lr", type=float, default=0.1, help="learning rate, used as given")
    p.add_argument("--scale-lr", action="store_true", help="multiply --lr by the world size (linear scaling rule)")
    p.add_argument("--accumulate", type=int, default=1, help="batches per optimizer step (no_sync in between)")
    p.add_argument("--amp", action="store_true", help="autocast: bfloat16 on CPUs and GPUs of compute capability 8.0+, "
                   "float16 + GradScaler on older GPUs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", choices=["nccl", "gloo"], default=None, help="default: nccl on GPUs, else gloo")
    p.add_argument("--checkpoint-dir", default=None, help="rank 0 writes last.pt here after every epoch")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint-dir/last.pt if it exists")
    p.add_argument("--data-url", default=None, help="download a data archive (datasets.write_archive) once per node")
    p.add_argument("--data-md5", default=None, help="the archive's MD5 (needed with --data-url)")
    p.add_argument("--data-root", default="data", help="where --data-url is downloaded on each node")
    p.add_argument("--compare-reference", action="store_true",
                   help="rank 0 also trains in one process with the global batch and prints the weight difference")
    args = p.parse_args(argv)
    if args.data_url and not args.data_md5:
        p.error("--data-url needs --data-md5 (the archive's checksum)")
    return args


def say(message: str, every_rank: bool = False) -> None:
    """Print on rank 0 (or on every rank) in a single write, so lines from ranks never interleave."""
    if every_rank or mdist.is_main_process():
        sys.stdout.write(message + "\n")
        sys.stdout.flush()


def make_model(features: int, hidden: int, classes: int, seed: int):
    """The same initial weights on every rank (DDP would broadcast rank 0's anyway)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, classes))


def load_data(args):
    if args.data_url:
        get = per_node.run_once(download.fetch_archive)  # local rank 0 of each node downloads
        full = datasets.load_archive_dir(get(args.data_url, args.data_root, args.data_md5))
        say(f"data: {len(full)} samples from {args.data_url} (downloaded once per node)")
    else:
        full = datasets.synthetic_classification(args.samples + args.val_samples, args.features, args.classes,
                                             seed=args.seed)
    n_train = len(full) - args.val_samples
    if n_train < 1:
        raise ValueError(f"--val-samples={args.val_samples} leaves no training data out of {len(full)} samples")
    return Subset(full, range(n_train)), Subset(full, range(n_train, len(full)))


def main(argv=None) -> int:
    args = parse_args(argv)
    distributed = "WORLD_SIZE" in os.environ  # set by torchrun (and mgpu_lab.launch)
    device = mdist.setup(args.backend) if distributed else mdist.device()
    me = mdist.info()
    backend = torch.distributed.get_backend() if distributed else "none (one process)"
    say(f"rank {me.rank}/{me.world_size} local_rank {me.local_rank} node {me.node_rank}: backend {backend}, "
        f"device {device}, pid {os.getpid()}", every_rank=True)
    train_set, val_set = load_data(args)
    lr = args.lr * me.world_size if args.scale_lr else args.lr
    say(f"{len(train_set)} training samples, batch {args.batch_size} per rank x {me.world_size} ranks "
                 f"x {args.accumulate} accumulated = global batch {args.batch_size * me.world_size * args.accumulate}"
                 f", lr {lr:g}, {args.epochs} epoch(s)")

    def model_fn():
        return make_model(len(train_set[0][0]), args.hidden, args.classes, args.seed)

    model = ddp.wrap(model_fn(), device)
    loader, _ = ddp.distributed_loader(train_set, args.batch_size, shuffle=True, seed=args.seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    ckpt = os.path.join(args.checkpoint_dir, "last.pt") if args.checkpoint_dir else None
    start_epoch = 0
    if args.resume and ckpt and os.path.isfile(ckpt):
        state = ddp.load_checkpoint(ckpt, model, optimizer, device)  # map_location=device, weights_only=True
        start_epoch = state["epoch"] + 1
        say(f"resumed from {ckpt} after epoch {state['epoch']}")

    def end_of_epoch(epoch):
        acc = ddp.evaluate(model, val_set)  # exact: sums and counts all-reduced
        say(f"epoch {epoch}: val accuracy {acc['accuracy']:.4f} on {acc['counted']} samples")
        if ckpt:
            ddp.save_checkpoint(ckpt, model, optimizer, epoch)  # rank 0 writes, all wait
            say(f"epoch {epoch}: checkpoint {ckpt}")

    start = time.perf_counter()
    stats = ddp.fit(model, loader, optimizer, args.epochs, accumulate=args.accumulate, amp=args.amp,
                    start_epoch=start_epoch, log_every=0, on_epoch_end=end_of_epoch)
    mean_loss = ddp.mean_over_ranks(sum(stats["losses"]), len(stats["losses"])) if stats["losses"] else float("nan")
    say(f"rank {me.rank}: {stats['steps']} optimizer steps, {stats['allreduces'] or 0} gradient all-reduces, "
        f"mean loss {mean_loss:.4f}", every_rank=True)
    say(f"done in {time.perf_counter() - start:.2f} s")
    if args.compare_reference and me.rank == 0 and start_epoch == 0 and not args.amp:
        global_batch = args.batch_size * me.world_size * args.accumulate
        ref = ddp.reference_train(model_fn, train_set, args.epochs, global_batch, lr, seed=args.seed)
        diff = ddp.max_diff(ddp.cpu_state(model), ref)
        say(f"max |DDP weights - one process with global batch {global_batch}| = {diff:.3g}")
    if distributed:
        mdist.teardown()  # destroy_process_group
    return 0


if __name__ == "__main__":
    mdist.leave(main())  # without the C++ teardown at interpreter exit, which can abort a finished rank

"""Train an MLP with a pipeline schedule of torch.distributed.pipelining: lesson 12 as a plain script.

Runs unchanged under torchrun, on one machine or several; the ranks talk over gloo and
the stages stay on the CPU (a GPU run would put each stage on ``cuda:LOCAL_RANK`` and use NCCL):

    torchrun --standalone --nproc-per-node=2 scripts/pp_train.py --schedule 1f1b
    torchrun --standalone --nproc-per-node=2 scripts/pp_train.py --schedule zbv --n-micro 8
    torchrun --standalone --nproc-per-node=2 scripts/pp_train.py --schedule gpipe 1f1b interleaved zbv
    torchrun --standalone --nproc-per-node=4 scripts/pp_train.py --schedule interleaved --dp 2

``--schedule`` picks ``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``
(two stages per rank, in a loop) or ``ScheduleZBVZeroBubble`` (two stages per rank,
in a V). With ``--dp 2`` the ranks form a (dp, pp) mesh: two pipelines, each on
half of every batch, their gradients averaged before each SGD step (PP x DP).
``--compare-reference`` makes rank 0 train the same model in one process and print
the largest weight difference.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
from torch import nn

from mgpu_lab import dist as mdist
from mgpu_lab.parallel.baseline import max_diff
from mgpu_lab.pipelining import train


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--schedule", choices=train.SCHEDULES, nargs="+", default=["1f1b"],
                   help="one or more schedules, trained in turn from the same initial weights")
    p.add_argument("--n-micro", type=int, default=4, help="micro-batches per step (they must divide the batch)")
    p.add_argument("--layers-per-stage", type=int, default=1)
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--batch", type=int, default=16, help="global batch per step")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas of the pipeline")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare-reference", action="store_true",
                   help="rank 0 also trains in one process and prints the largest weight difference")
    return p.parse_args(argv)


def say(message: str) -> None:
    if mdist.is_main_process():
        sys.stdout.write(message + "\n")
        sys.stdout.flush()


def model_fn(args, n_layers: int) -> nn.Sequential:
    torch.manual_seed(args.seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(args.width, args.width), nn.Tanh()) for _ in range(n_layers)])


def main(argv=None) -> int:
    args = parse_args(argv)
    mdist.setup("gloo")
    me = mdist.info()
    pp = me.world_size // args.dp
    if pp * args.dp != me.world_size:
        raise SystemExit(f"--dp {args.dp} does not divide the {me.world_size} ranks")
    g = torch.Generator().manual_seed(args.seed + 1)
    batches = [(torch.randn(args.batch, args.width, generator=g), torch.randn(args.batch, args.width, generator=g))
               for _ in range(args.steps)]
    for schedule in args.schedule:
        n_layers = pp * {"interleaved": 2, "zbv": 2}.get(schedule, 1) * args.layers_per_stage
        say(f"{schedule}: {pp} pipeline rank(s) x {args.dp} replica(s), {n_layers} layers, {args.n_micro} "
            f"micro-batches of {args.batch // args.dp // args.n_micro}, {args.steps} steps")
        start = time.perf_counter()
        state = train.train(lambda: model_fn(args, n_layers), pp, schedule, args.n_micro, batches, args.lr,
                               dp=args.dp)
        say(f"{schedule}: done in {time.perf_counter() - start:.2f} s")
        if args.compare_reference and me.rank == 0:
            ref = train.one_process(lambda: model_fn(args, n_layers), batches, args.lr)
            diff = max_diff(state, ref)
            say(f"{schedule}: max |pipeline weights - one process| = {diff:.3g}")
    mdist.teardown()
    return 0


if __name__ == "__main__":
    mdist.leave(main())  # without the C++ teardown at interpreter exit, which can abort a finished rank

"""A DDP training that fails on one rank: lesson 10's crash under torchrun, as a plain script.

It trains a small MLP with DDP (lesson 04's loop) and raises an exception in rank ``--fail-rank`` as that
rank starts optimizer step ``--crash-at-step``; ``@record`` on ``main`` writes the exception and its
traceback to the error file torchrun gives every worker, so torchrun's failure summary names it:

    torchrun --standalone --nproc-per-node=2 --log-dir=logs scripts/crashing_train.py --crash-at-step 5

``--crash-at-step 0`` trains to the end. It snapshots nothing and resumes nothing: a crash ends the job.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record

from mgpu_lab import dist as mdist
from mgpu_lab.data import datasets
from mgpu_lab.parallel import ddp


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=48)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=4, help="per rank")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--crash-at-step", type=int, default=5, help="raise in --fail-rank as it starts this step (0: never)")
    p.add_argument("--fail-rank", type=int, default=1)
    args = p.parse_args(argv)
    if args.crash_at_step < 0 or args.fail_rank < 0:
        p.error(f"--crash-at-step {args.crash_at_step} and --fail-rank {args.fail_rank} must be >= 0")
    return args


def crashing_model_fn(crash_at_step: int, fail_rank: int):
    """A model_fn whose model raises in rank ``fail_rank`` as its forward of step ``crash_at_step`` starts."""
    me, steps = mdist.rank(), [0]

    def hook(module, inputs):
        steps[0] += 1
        if me == fail_rank and steps[0] == crash_at_step:
            raise RuntimeError(f"injected failure on rank {me} at step {steps[0]}")

    def model_fn():
        torch.manual_seed(0)  # the same initial weights on every rank
        model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
        model.register_forward_pre_hook(hook)
        return model

    return model_fn


@record
def main(argv=None) -> None:
    args = parse_args(argv)
    mdist.setup()
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    mdist.print0(f"attempt {attempt}: world size {mdist.world_size()}, rank {args.fail_rank} fails at step "
                 f"{args.crash_at_step or 'never'}")
    data = datasets.synthetic_classification(args.samples, features=6, classes=3, seed=3)
    state = ddp.train(crashing_model_fn(args.crash_at_step, args.fail_rank), data, args.epochs, args.batch_size,
                      args.lr)
    mdist.print0(f"attempt {attempt}: finished; weight sum {sum(v.sum().item() for v in state.values()):.6f}")
    mdist.teardown()


if __name__ == "__main__":
    main()
    sys.stdout.flush()

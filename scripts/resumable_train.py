"""DDP training that survives crashes: lesson 10 as a plain torchrun script.

Snapshots every ``--snapshot-every`` steps (atomically; model, optimizer, step,
every rank's RNG state) and, when torchrun restarts it, resumes from the last
snapshot exactly:

    torchrun --standalone --nproc-per-node=2 --max-restarts=3 scripts/resumable_train.py \\
        --snapshot ckpt/snap.pt --snapshot-every 4
    torchrun --nnodes=1:2 --nproc-per-node=4 --max-restarts=3 --rdzv-backend=c10d \\
        --rdzv-endpoint=HOST:29400 --rdzv-id=job1 scripts/resumable_train.py --snapshot /shared/snap.pt

Failures can be injected to watch torchrun handle them: ``--kill-at-step S``
SIGKILLs rank ``--fail-rank`` as it starts step S of the first attempt (a
crash that runs no Python code: no traceback, no error file); ``--crash-at-step S``
raises an exception there instead (``@record`` writes it to torchrun's error
file). ``--out`` writes the final weights (rank 0, atomically).
"""
from __future__ import annotations

import argparse
import os
import signal
import sys

import torch
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record

from mgpu_lab.data import datasets
from mgpu_lab import dist as mdist
from mgpu_lab.failures import resume


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=48)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=4, help="per rank")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--snapshot", default="snapshot.pt", help="the snapshot file (shared by every node)")
    p.add_argument("--snapshot-every", type=int, default=4, help="optimizer steps between snapshots")
    p.add_argument("--kill-at-step", type=int, default=0, help="SIGKILL --fail-rank at this step (1st attempt)")
    p.add_argument("--crash-at-step", type=int, default=0, help="raise in --fail-rank at this step (1st attempt)")
    p.add_argument("--fail-rank", type=int, default=1)
    p.add_argument("--kill-node-at-step", type=int, default=0,
                   help="this node 'loses power' at this step of the 1st attempt: SIGKILL to its torchrun and workers")
    p.add_argument("--out", default=None, help="rank 0 writes the final state_dict here")
    return p.parse_args(argv)


def make_model(seed: int = 0) -> nn.Module:
    """A small MLP with dropout (so the RNG state matters); the same initial weights on every rank."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 3))


def make_data(samples: int):
    return datasets.synthetic_classification(samples, features=6, classes=3, seed=3)


def fault_injector(args):
    """A model_fn whose model kills or crashes rank ``--fail-rank`` as it starts step S of attempt 0."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    me, steps = mdist.rank(), [0]

    def hook(module, inputs):
        steps[0] += 1
        if attempt == 0 and me == args.fail_rank:
            if steps[0] == args.kill_at_step:
                print(f"rank {me}: SIGKILL at step {steps[0]} (attempt {attempt})", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            if steps[0] == args.crash_at_step:
                raise RuntimeError(f"injected failure on rank {me} at step {steps[0]}")
        if attempt == 0 and steps[0] == args.kill_node_at_step:
            print(f"rank {me}: SIGKILL to this node's torchrun and workers at step {steps[0]}", flush=True)
            os.killpg(os.getpgid(0), signal.SIGKILL)  # torchrun runs in a session of its own on each node

    def model_fn():
        model = make_model()
        model.register_forward_pre_hook(hook)
        return model

    return model_fn


@record
def main(argv=None) -> None:
    args = parse_args(argv)
    mdist.setup()
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    found = os.path.exists(args.snapshot)
    mdist.print0(f"attempt {attempt}: world size {mdist.world_size()}, "
                 + (f"resuming from {args.snapshot} (step {torch.load(args.snapshot, weights_only=True)['step']})"
                    if found else "no snapshot: starting fresh"))
    state = resume.train(fault_injector(args), make_data(args.samples), args.epochs, args.batch_size, args.lr,
                         args.snapshot, args.snapshot_every)
    if args.out and mdist.is_main_process():
        resume.save_atomically(state, args.out)
    mdist.print0(f"attempt {attempt}: finished; weight sum {sum(v.sum().item() for v in state.values()):.6f}")
    mdist.teardown()


if __name__ == "__main__":
    main()
    sys.stdout.flush()

"""Multi-node smoke test: every rank says where it sits, then all_reduce + barrier.

Runs unchanged under torchrun on a real cluster (it needs only torch). Start it
on every node with the same --nnodes/--nproc-per-node and this node's rank:

    torchrun --nnodes=2 --nproc-per-node=4 --node-rank=0 \\
        --master-addr=node0 --master-port=29500 allreduce_check.py

Each rank prints one line with RANK, LOCAL_RANK, WORLD_SIZE and GROUP_RANK (the
node rank) as torchrun set them, then all ranks sum ``rank + 1`` with all_reduce;
every rank must get ``world_size * (world_size + 1) / 2``. NCCL is used when
this node has a GPU for every local rank, gloo otherwise. A rank that cannot
reach the others fails after ``--timeout`` seconds (default 60) with the error
NCCL or gloo raises, instead of waiting for the 10-minute default.

``--json`` (or ALLREDUCE_CHECK_JSON=1) adds one machine-readable line per rank
(``ALLREDUCE_CHECK {...}``), which mgpu_lab's checks read. ``--abort-after-destroy RANK`` makes that rank
abort right after destroy_process_group, to show what torchrun does then.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist

ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["nccl", "gloo"], default=None,
                        help="default: nccl with one GPU per local rank, else gloo")
    parser.add_argument("--timeout", type=float,
                        default=float(os.environ.get("ALLREDUCE_CHECK_TIMEOUT", "60")),
                        help="seconds a rank waits for the others (default 60, or $ALLREDUCE_CHECK_TIMEOUT)")
    parser.add_argument("--json", action="store_true", default=os.environ.get("ALLREDUCE_CHECK_JSON") == "1",
                        help="also print one ALLREDUCE_CHECK {json} line per rank (or $ALLREDUCE_CHECK_JSON=1)")
    parser.add_argument("--abort-after-destroy", type=int, default=None, metavar="RANK",
                        help="this rank calls os.abort() after destroy_process_group (a demo)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    env = {name: os.environ.get(name) for name in ENV}
    if env["RANK"] is None:
        sys.exit("RANK is not set: start this script with torchrun, e.g. "
                 "torchrun --standalone --nproc-per-node=2 allreduce_check.py")
    rank, local_rank, world = int(env["RANK"]), int(env["LOCAL_RANK"]), int(env["WORLD_SIZE"])
    local_world = int(env["LOCAL_WORLD_SIZE"] or 1)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = args.backend or ("nccl" if gpus >= local_world and dist.is_nccl_available() else "gloo")
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    host = socket.gethostname()
    print(f"rank {rank}/{world}: local_rank {local_rank}, node (GROUP_RANK) {env['GROUP_RANK']}, "
          f"host {host}, {backend} on {device}, MASTER_ADDR={env['MASTER_ADDR']}:{env['MASTER_PORT']}", flush=True)
    if backend == "nccl":
        torch.cuda.set_device(device)
    start = time.perf_counter()
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout))
    value = torch.full((4,), float(rank + 1), device=device)
    dist.all_reduce(value)
    dist.barrier()
    expected = world * (world + 1) / 2
    got = value.cpu().tolist()
    ok = all(v == expected for v in got)
    print(f"rank {rank}/{world}: all_reduce sum {got[0]:g} (expected {expected:g}) "
          f"{'OK' if ok else 'WRONG'} in {time.perf_counter() - start:.2f} s", flush=True)
    if args.json:
        report = {**env, "hostname": host, "backend": backend, "sum": got[0], "expected": expected, "ok": ok}
        # One write: under PYTHONUNBUFFERED print() writes the text and the newline
        # separately, and the ranks of a node share one pipe, so two reports could
        # end up on one line.
        sys.stdout.write("ALLREDUCE_CHECK " + json.dumps(report) + "\n")
        sys.stdout.flush()
    dist.destroy_process_group()
    if args.abort_after_destroy == rank:
        print(f"rank {rank}/{world}: aborting after destroy_process_group (--abort-after-destroy)", flush=True)
        os.abort()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

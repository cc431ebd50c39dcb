"""Benchmark: all_reduce bandwidth over message sizes, and our ring against dist.all_reduce, side by side.

For each world size and message size (4 KiB to --max-mib MiB, float32), in one run:

    all_reduce   dist.all_reduce: time per call (median of --reps after a barrier), algorithm
                 bandwidth algbw = size / time and bus bandwidth busbw = algbw * 2(W-1)/W,
                 as nccl-tests reports them
    ring         mgpu_lab.comm.ring.all_reduce (lesson 09: isend/irecv around a ring)
                 on the same tensors: time, busbw, and its time over all_reduce's

then the alpha-beta fit (t = alpha + n / bandwidth) of both. With one GPU per rank the
ranks use NCCL on the GPUs, otherwise gloo on the CPU; each launch prints which.

Run: ``.venv/bin/python bench/collectives.py [--world 2 4] [--max-mib 64] [--reps 5]``.
"""
from __future__ import annotations

import argparse
import os
import sys

from mgpu_lab import launch
from mgpu_lab.comm import cost_model, ring


def sizes_up_to(max_mib: int) -> list[int]:
    """4 KiB, 16 KiB, ... (x4) up to ``max_mib`` MiB."""
    sizes, size = [], 4 << 10
    while size <= max_mib << 20:
        sizes.append(size)
        size *= 4
    return sizes


def table(sizes: list[int], result: dict) -> str:
    factor = cost_model.bus_factor("all_reduce", result["world_size"])
    lines = [f"{'size':>9} | {'all_reduce us':>13} {'algbw GB/s':>10} {'busbw GB/s':>10} | "
             f"{'ring us':>10} {'busbw GB/s':>10} {'ring/all_reduce':>15}"]
    for size, t_ar, t_ring in zip(sizes, result["all_reduce"], result["ring"]):
        algbw = size / t_ar / 1e9
        lines.append(f"{cost_model.human_size(size):>9} | {t_ar * 1e6:>13.1f} {algbw:>10.3f} {algbw * factor:>10.3f} | "
                     f"{t_ring * 1e6:>10.1f} {size / t_ring / 1e9 * factor:>10.3f} {t_ring / t_ar:>15.2f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4], help="world sizes (default: 2 4)")
    parser.add_argument("--max-mib", type=int, default=64, help="largest message in MiB (default: 64)")
    parser.add_argument("--reps", type=int, default=5, help="timed calls per size; the median counts (default: 5)")
    args = parser.parse_args(argv)
    if min(args.world) < 2 or args.max_mib < 1 or args.reps < 1:
        parser.error(f"--world needs sizes >= 2 (got {args.world}), --max-mib >= 1 (got {args.max_mib}), "
                     f"--reps >= 1 (got {args.reps})")
    sizes = sizes_up_to(args.max_mib)
    print(f"machine: {os.cpu_count()} CPU cores, python {sys.version.split()[0]}; float32 messages "
          f"{cost_model.human_size(sizes[0])} to {cost_model.human_size(sizes[-1])}, median of {args.reps} calls",
          flush=True)
    for world in args.world:
        result = launch(cost_model.time_ops, world, sizes, args.reps, ("all_reduce", "ring"), ring.all_reduce)[0]
        print(f"\n{world} ranks, {result['backend']} on {result['device']}")
        print(table(sizes, result))
        for op in ("all_reduce", "ring"):
            alpha, bandwidth = cost_model.fit_alpha_beta(sizes, result[op])
            print(f"  fit {op:<10}: alpha = {alpha * 1e6:8.1f} us, bandwidth = {bandwidth / 1e9:6.3f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark: ring attention against all-gather CP, bytes and peak memory per rank, side by side in one run.

For CP degrees 2 and 4 and growing sequence lengths, one launch per degree runs both
context-parallel attentions (causal, zig-zag layout, float32, one sequence of ``--heads``
heads of width ``--head-dim``) on the same shards, and each rank measures them with
``mgpu_lab.long_context.measure.measure_rank``:

    KiB in       bytes that reached the rank (every receive, its share of every collective)
    KiB peak     the most bytes it had allocated at once during the call (the CPU profiler's
                 allocations, added up in order)
    rows         the most positions one tensor of K, V, Q or the output held

all-gather CP (``mgpu_lab.long_context.gather``) against ring attention (``RingAttention`` of
``scripts/long_context_train.py``: K and V blocks around the ring, merged by log-sum-exp),
with ring / all-gather ratios; each number is the largest over the ranks. Both move the
same bytes (every rank receives the other ranks' K and V once). All-gather holds the whole
sequence's K and V (``S`` rows); the ring one rank's shard at a time (``S/W`` rows) and the
one arriving. The peak also counts what grows as the square of the length in both: the
ring's scores per pair of chunks, ``(S/2W)^2`` per head, and all-gather's ``S/W x S`` mask with
the float copy attention makes of it (the CPU's attention kernel itself works in tiles), so the
peak's ratio is not the rows' ratio. Ranks are
CPU processes with gloo on any machine (the profiler's memory counts CPU allocations).

Run: ``.venv/bin/python bench/long_context.py [--world 2 4] [--seqs 512 1024 2048 4096]``.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

import cloudpickle

from mgpu_lab import launch
from mgpu_lab.long_context.measure import measure_rank

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "long_context_train.py"
METHODS = ("all-gather", "ring")


def ring_function():
    """``ring_attend`` of the training script, shipped to the ranks by value (scripts/ is no package)."""
    spec = importlib.util.spec_from_file_location("long_context_train", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    cloudpickle.register_pickle_by_value(module)
    return module.ring_attend


def both(ring, seqs: tuple, heads: int, head_dim: int) -> dict:
    """In each rank: all-gather CP, then the ring, measured on the same lengths."""
    return {"all-gather": measure_rank(None, seqs, "zigzag", True, 1, heads, head_dim),
            "ring": measure_rank(ring, seqs, "zigzag", True, 1, heads, head_dim)}


def table(world: int, per_rank: list[dict]) -> str:
    """One line per length: each measure of both methods (the largest over ranks) and ring / all-gather."""
    head = f"{'W':>2} {'S':>6} |"
    for unit in ("KiB in", "KiB peak", "rows"):
        head += f" {unit + ' all-gather':>19} {'ring':>9} {'ratio':>6} |"
    lines = [head.rstrip(" |")]
    for i, row in enumerate(per_rank[0]["ring"]):
        line = f"{world:>2} {row['seq']:>6} |"
        for key, div in (("bytes_in", 1024), ("peak_bytes", 1024), ("kv_rows", 1)):
            ag, ring = (max(rank[m][i][key] for rank in per_rank) / div for m in METHODS)
            line += f" {ag:>19.1f} {ring:>9.1f} {ring / ag if ag else float('nan'):>6.2f} |"
        lines.append(line.rstrip(" |"))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4], help="CP degrees (default: 2 4)")
    parser.add_argument("--seqs", type=int, nargs="+", default=[512, 1024, 2048, 4096],
                        help="sequence lengths, multiples of 2 x every CP degree (default: 512 1024 2048 4096)")
    parser.add_argument("--heads", type=int, default=2, help="attention heads (default: 2)")
    parser.add_argument("--head-dim", type=int, default=16, help="width of a head (default: 16)")
    args = parser.parse_args(argv)
    bad = [s for s in args.seqs for w in args.world if s % (2 * w)]
    if min(args.world) < 2 or bad:
        parser.error(f"--world needs CP degrees >= 2 (got {args.world}) and every length a multiple of 2 x each "
                     f"degree (zig-zag chunks); these are not: {sorted(set(bad))}")
    ring = ring_function()
    print(f"machine: {os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f}; causal attention, zig-zag "
          f"layout, float32, 1 sequence x {args.heads} heads x head dim {args.head_dim}", flush=True)
    for world in args.world:
        per_rank = launch(both, world, ring, tuple(args.seqs), args.heads, args.head_dim, backend="gloo")
        print(f"\nCP degree {world} (largest over the ranks; ratio = ring / all-gather)")
        print(table(world, per_rank), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

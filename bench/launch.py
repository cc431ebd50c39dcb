"""Benchmark: the same 4-rank task through four launchers, side by side in one run.

The task is what every lesson's launch does at least once: initialise a gloo
(or NCCL) process group across 4 ranks, run one all_reduce, tear down.

    mgpu_lab.launch, cold   fresh interpreter; time from `from mgpu_lab import launch`
                            returning to the first launch's results (and from process start)
    mgpu_lab.launch, warm   later launches in the same process
    torch.multiprocessing.spawn, and torchrun --standalone --nproc-per-node=4

Run: ``.venv/bin/python bench/launch.py [--repeats N]`` (``make bench``).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

NPROCS = 4
HERE = Path(__file__).resolve().parent
TARGETS = {"warm_s": 0.25, "warm_vs_spawn": 20.0, "cold_s": 2.0}

COLD_SNIPPET = """
import time, sys
t0 = time.perf_counter()
from mgpu_lab import launch
import torch, torch.distributed as dist
t1 = time.perf_counter()
def task():
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()
assert launch(task, {n}) == [{n}.0] * {n}
t2 = time.perf_counter()
print("COLD", t2 - t1, t2 - t0, file=sys.stderr)
"""

TORCHRUN_SCRIPT = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
assert t.item() == dist.get_world_size()
dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _task():
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def _spawn_rank(rank: int, world: int, port: int) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()


def bench_cold(repeats: int) -> tuple[list[float], list[float]]:
    first, total = [], []
    for _ in range(repeats):
        proc = subprocess.run([sys.executable, "-c", COLD_SNIPPET.format(n=NPROCS)],
                              capture_output=True, text=True, check=True)
        line = [ln for ln in proc.stderr.splitlines() if ln.startswith("COLD")][-1]
        _, a, b = line.split()
        first.append(float(a))
        total.append(float(b))
    return first, total


def bench_warm(repeats: int) -> list[float]:
    import contextlib
    import io

    from mgpu_lab import launch

    with contextlib.redirect_stdout(io.StringIO()):
        launch(_task, NPROCS)  # warm-up: the forkserver is running from here on
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            launch(_task, NPROCS)
            times.append(time.perf_counter() - t0)
    return times


def bench_spawn(repeats: int) -> list[float]:
    import torch.multiprocessing as mp

    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mp.spawn(_spawn_rank, args=(NPROCS, _free_port()), nprocs=NPROCS, join=True)
        times.append(time.perf_counter() - t0)
    return times


def bench_torchrun(repeats: int, tmp: Path) -> list[float]:
    script = tmp / "torchrun_task.py"
    script.write_text(TORCHRUN_SCRIPT)
    torchrun = Path(sys.executable).with_name("torchrun")
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run([str(torchrun), "--standalone", f"--nproc-per-node={NPROCS}", str(script)],
                       check=True, capture_output=True)
        times.append(time.perf_counter() - t0)
    return times


def main(argv=None) -> int:
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs per launcher (warm: 4x this)")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    print(f"machine: {os.cpu_count()} CPU cores, python {sys.version.split()[0]}; task: "
          f"{NPROCS} ranks, init_process_group + one all_reduce", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        res = {
            "cold first launch": bench_cold(args.repeats),
            "warm": bench_warm(args.repeats * 4),
            "mp.spawn": bench_spawn(args.repeats),
            "torchrun": bench_torchrun(args.repeats, Path(tmp)),
        }
    cold_first, cold_total = (statistics.median(x) for x in res["cold first launch"])
    warm = statistics.median(res["warm"])
    spawn = statistics.median(res["mp.spawn"])
    trun = statistics.median(res["torchrun"])
    rows = [
        ("mgpu_lab.launch, warm", warm, 1.0),
        ("mgpu_lab.launch, cold (after import)", cold_first, cold_first / warm),
        ("mgpu_lab.launch, cold (from python start)", cold_total, cold_total / warm),
        ("torch.multiprocessing.spawn", spawn, spawn / warm),
        ("torchrun --standalone", trun, trun / warm),
    ]
    print(f"\n{'launcher':44} {'median s':>9} {'x warm':>8}")
    for name, sec, ratio in rows:
        print(f"{name:44} {sec:9.3f} {ratio:8.1f}")
    checks = [
        (f"warm <= {TARGETS['warm_s']} s", warm <= TARGETS["warm_s"]),
        (f"warm >= {TARGETS['warm_vs_spawn']:.0f}x faster than mp.spawn ({spawn / warm:.1f}x)",
         spawn / warm >= TARGETS["warm_vs_spawn"]),
        (f"cold (after import) <= {TARGETS['cold_s']} s", cold_first <= TARGETS["cold_s"]),
    ]
    print()
    for text, ok in checks:
        print(f"{'MET ' if ok else 'MISSED'}  {text}")
    if args.json:
        Path(args.json).write_text(json.dumps({k: v for k, v in res.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark: each pipeline schedule's measured bubble beside the model fitted to it, in one run.

For 2 and 4 ranks, every schedule of ``torch.distributed.pipelining`` (GPipe, 1F1B,
interleaved 1F1B with two stages per rank, ZBV) runs on fixed-work layers
(``mgpu_lab.pipelining.work.Work``: each forward, input-gradient and weight-gradient sleeps ``--work``
seconds, so the shape of the schedule, not the sharing of the cores, sets the times).
The ranks record every action's timestamps (``mgpu_lab.pipelining.record``); the bench prints

    measured   the idle fraction between the first action's start and the last one's end
    model      the schedule's own order replayed with the measured mean time of each action
               per stage, the mean host time after it (idle, as in the measurement) and the
               mean transfer time of a message (``measure.fitted_bubble``)
    formula    the closed form for equal times ((p-1)/(m+p-1), interleaved (p-1)/(v*m+p-1))
    in flight  the most micro-batches alive at once on rank 0

with the machine's load average, since a loaded machine wakes sleeping ranks late.

Run: ``.venv/bin/python bench/pipeline_schedules.py [--work 0.02] [--repeats 3]``.
"""
from __future__ import annotations

import argparse
import os
import statistics

from mgpu_lab.pipelining import measure

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zbv")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=float, default=0.02, help="seconds of each forward / input / weight gradient")
    p.add_argument("--repeats", type=int, default=3, help="runs per configuration; the median is printed")
    args = p.parse_args(argv)
    print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"{'ranks':>5} {'m':>3} {'schedule':>12} {'measured':>9} {'model':>7} {'meas/model':>11} {'formula':>8} "
          f"{'in flight r0':>13}")
    worst = 0.0
    for ranks, n_micro in ((2, 4), (4, 8)):
        runs = [measure.measure(SCHEDULES, n_ranks=ranks, n_micro=n_micro, t_f=args.work, t_b=args.work,
                                   t_w=args.work) for _ in range(args.repeats)]
        for s in SCHEDULES:
            measured = statistics.median(r[s]["bubble"] for r in runs)
            model = statistics.median(r[s]["model"] for r in runs)
            v = 2 if s == "interleaved" else 1
            formula = (ranks - 1) / (v * n_micro + ranks - 1)
            worst = max(worst, abs(measured - model) / measured if measured else 0.0)
            print(f"{ranks:>5} {n_micro:>3} {s:>12} {measured:>9.1%} {model:>7.1%} {measured / model:>11.2f} "
                  f"{'-' if s == 'zbv' else f'{formula:.1%}':>8} {runs[0][s]['in_flight']['rank 0']:>13}")
    print(f"largest |measured - model| / measured: {worst:.0%}; load average after: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""How often to snapshot: the cost of writing snapshots against the work a failure throws away.

A job of ``steps`` steps of ``step_s`` seconds writes a snapshot of
``save_s`` seconds every ``k`` steps; failures come at random (a Poisson
process, mean time between failures ``mtbf_s``), and each one costs a
restart of ``restart_s`` plus the work since the last snapshot. Small ``k``
pays for many snapshots, large ``k`` loses much work per failure.

:func:`expected_time` is the exact expectation for this model: a segment of
``k`` steps and its snapshot (``w = k * step_s + save_s`` seconds) is retried
until it runs ``w`` seconds without a failure, which takes
``(exp(w / mtbf) - 1) * (mtbf + restart)`` on average. :func:`simulate` runs
the same model with random failures, and :func:`young_k` is Young's
approximation of the best ``k``: ``sqrt(2 * save_s * mtbf_s) / step_s``.

Example:
    >>> round(young_k(step_s=0.1, save_s=2.0, mtbf_s=3600.0))
    1200
    >>> expected_time(1000, 0.1, 100, 2.0, 3600.0, 30.0) > 1000 * 0.1
    True
"""
from __future__ import annotations

import math
import random

__all__ = ["expected_time", "simulate", "young_k", "best_k", "overhead"]


def _check(steps, step_s, k, save_s, mtbf_s, restart_s) -> None:
    if steps < 1 or k < 1:
        raise ValueError(f"steps={steps} and k={k} must be >= 1")
    if step_s <= 0 or mtbf_s <= 0 or save_s < 0 or restart_s < 0:
        raise ValueError(f"step_s={step_s} and mtbf_s={mtbf_s} must be > 0, save_s={save_s} and "
                         f"restart_s={restart_s} >= 0 (seconds)")


def _segments(steps: int, k: int) -> list[int]:
    full, rest = divmod(steps, k)
    return [k] * full + ([rest] if rest else [])


def expected_time(steps: int, step_s: float, k: int, save_s: float, mtbf_s: float, restart_s: float) -> float:
    """Expected wall time (s) of the whole job, failures and restarts included (exact for the model above).

    Every segment ends with a snapshot, the last one included.
    """
    _check(steps, step_s, k, save_s, mtbf_s, restart_s)
    return sum(math.expm1((n * step_s + save_s) / mtbf_s) * (mtbf_s + restart_s) for n in _segments(steps, k))


def overhead(steps: int, step_s: float, k: int, save_s: float, mtbf_s: float, restart_s: float) -> float:
    """Expected time lost to snapshots and failures, as a fraction of the failure-free, snapshot-free time."""
    return expected_time(steps, step_s, k, save_s, mtbf_s, restart_s) / (steps * step_s) - 1.0


def simulate(steps: int, step_s: float, k: int, save_s: float, mtbf_s: float, restart_s: float,
             runs: int = 200, seed: int = 0) -> float:
    """Mean wall time (s) of ``runs`` simulated jobs with exponentially distributed times between failures."""
    _check(steps, step_s, k, save_s, mtbf_s, restart_s)
    rng = random.Random(seed)
    total = 0.0
    for _ in range(runs):
        clock = 0.0
        for n in _segments(steps, k):
            need = n * step_s + save_s
            while True:
                fail_in = rng.expovariate(1.0 / mtbf_s)
                if fail_in >= need:
                    clock += need
                    break
                clock += fail_in + restart_s  # the segment's work is lost; restart from the last snapshot
        total += clock
    return total / runs


def young_k(step_s: float, save_s: float, mtbf_s: float) -> float:
    """Young's approximation of the best snapshot interval, in steps: ``sqrt(2 * save_s * mtbf_s) / step_s``."""
    return math.sqrt(2.0 * save_s * mtbf_s) / step_s


def best_k(steps: int, step_s: float, save_s: float, mtbf_s: float, restart_s: float) -> int:
    """The ``k`` in ``1..steps`` with the smallest :func:`expected_time` (searched exactly)."""
    return min(range(1, steps + 1), key=lambda k: expected_time(steps, step_s, k, save_s, mtbf_s, restart_s))

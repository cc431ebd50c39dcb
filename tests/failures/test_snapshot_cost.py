"""mgpu_lab.failures.snapshot_cost: the exact expectation agrees with the simulation; Young's k is near the best."""
from __future__ import annotations

import pytest

from mgpu_lab.failures import snapshot_cost as sc

ARGS = dict(steps=400, step_s=0.05, save_s=0.2, mtbf_s=2.0, restart_s=0.5)


@pytest.mark.parametrize("k", [2, 10, 40, 150])
def test_the_simulation_agrees_with_the_exact_expectation(k):
    exact = sc.expected_time(k=k, **ARGS)
    simulated = sc.simulate(k=k, runs=400, seed=1, **ARGS)
    assert abs(simulated - exact) / exact < 0.08, (k, simulated, exact)


def test_without_failures_the_cost_is_the_steps_and_the_snapshots():
    t = sc.expected_time(100, 0.1, 10, 0.5, 1e12, 3.0)
    assert t == pytest.approx(100 * 0.1 + 10 * 0.5, rel=1e-6)


def test_best_k_is_near_youngs_approximation_and_beats_both_extremes():
    best = sc.best_k(**ARGS)
    young = sc.young_k(ARGS["step_s"], ARGS["save_s"], ARGS["mtbf_s"])
    assert 0.5 * young < best < 2 * young
    cost = {k: sc.overhead(k=k, **ARGS) for k in (1, best, ARGS["steps"])}
    assert cost[best] < cost[1] and cost[best] < cost[ARGS["steps"]]


def test_bad_arguments_are_refused_with_the_values():
    with pytest.raises(ValueError, match="k=0"):
        sc.expected_time(10, 0.1, 0, 0.1, 10.0, 1.0)
    with pytest.raises(ValueError, match="mtbf_s=0"):
        sc.simulate(10, 0.1, 2, 0.1, 0.0, 1.0)

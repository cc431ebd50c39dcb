"""mgpu_lab.comm.cost_model: the alpha-beta fit, nccl-tests' bus bandwidth, and timing in real ranks."""
from __future__ import annotations

import math

import matplotlib
import pytest

from mgpu_lab import launch
from mgpu_lab.comm import cost_model, ring

matplotlib.use("Agg")
pytestmark = pytest.mark.timeout(120)


def test_the_fit_recovers_latency_and_bandwidth_of_an_exact_model():
    sizes = [2 ** k for k in range(10, 25, 2)]
    times = [50e-6 + n / 2e9 for n in sizes]
    alpha, bandwidth = cost_model.fit_alpha_beta(sizes, times)
    assert math.isclose(alpha, 50e-6, rel_tol=1e-6) and math.isclose(bandwidth, 2e9, rel_tol=1e-6)


def test_the_fit_refuses_too_few_points():
    with pytest.raises(ValueError, match="two or more"):
        cost_model.fit_alpha_beta([1024], [1e-3])
    with pytest.raises(ValueError, match="2 sizes and 1 times"):
        cost_model.fit_alpha_beta([1, 2], [1e-3])


def test_bus_factor_is_nccl_tests_definition():
    assert cost_model.bus_factor("all_reduce", 8) == 2 * 7 / 8
    assert cost_model.bus_factor("all_gather", 4) == 3 / 4 == cost_model.bus_factor("reduce_scatter", 4)
    assert cost_model.bus_factor("broadcast", 8) == 1.0
    with pytest.raises(ValueError, match="no factor for op='all_to_all'"):
        cost_model.bus_factor("all_to_all", 4)


def test_time_ops_refuses_an_unknown_op_before_touching_the_process_group():
    with pytest.raises(ValueError, match="unknown ops \\['tree'\\]"):
        cost_model.time_ops([1024], 1, ("tree",))
    with pytest.raises(ValueError, match="op 'ring' needs the ring function"):
        cost_model.time_ops([1024], 1, ("ring",))


def test_timing_in_two_ranks_gives_a_table_and_a_plot():
    sizes = [4096, 1 << 20]
    result = launch(cost_model.time_ops, 2, sizes, 2, ("all_reduce", "ring"), ring.all_reduce)[0]
    assert result["world_size"] == 2 and result["backend"] == "gloo" and result["device"] == "cpu"
    assert all(t > 0 for t in result["all_reduce"] + result["ring"]) and len(result["ring"]) == 2
    table = cost_model.table(sizes, result).splitlines()
    assert table[0].split() == ["size", "time", "(us)", "algbw", "(GB/s)", "busbw", "(GB/s)"]
    assert table[1].split()[:2] == ["4", "KiB"] and table[2].split()[:2] == ["1", "MiB"]
    algbw, busbw = map(float, table[2].split()[-2:])
    assert busbw == algbw  # 2 ranks: 2(W-1)/W = 1
    ax = cost_model.plot(sizes, result, ("all_reduce", "ring"))
    assert len(ax.lines) == 3 and "fit:" in ax.get_legend().get_texts()[-1].get_text()


def _bench():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "collectives.py"
    spec = importlib.util.spec_from_file_location("bench_collectives", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_benchmark_prints_both_algorithms_side_by_side_and_checks_its_arguments():
    bench = _bench()
    assert bench.sizes_up_to(1) == [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20]
    result = {"world_size": 4, "all_reduce": [1e-3, 2e-3], "ring": [2e-3, 3e-3]}
    header, small, large = bench.table([4096, 1 << 20], result).splitlines()
    assert "all_reduce us" in header and "ring/all_reduce" in header
    assert small.split()[-1] == "2.00" and large.split()[-1] == "1.50"
    assert float(large.split()[5]) == pytest.approx((1 << 20) / 2e-3 / 1e9 * 1.5, abs=1e-3)  # busbw, 4 ranks
    with pytest.raises(SystemExit):
        bench.main(["--world", "1"])


def test_overlapped_step_hides_every_bucket_but_the_last_and_exposes_one_big_bucket():
    grads, secs = [1 << 20] * 6, [0.002] * 6          # 6 layers of 1 MiB, 2 ms of backward each
    alpha, bandwidth = 1e-4, 1e9
    per_layer = alpha + (1 << 20) / bandwidth
    small = cost_model.overlapped_step(grads, secs, 1 << 20, alpha, bandwidth)
    big = cost_model.overlapped_step(grads, secs, 64 << 20, alpha, bandwidth)
    assert small == pytest.approx(6 * 0.002 + per_layer)  # only the last bucket's all-reduce shows
    assert big == pytest.approx(6 * 0.002 + alpha + 6 * (1 << 20) / bandwidth)  # all of it after backward
    slow_network = cost_model.overlapped_step(grads, secs, 1 << 20, alpha, bandwidth / 100)
    assert slow_network == pytest.approx(0.002 + 6 * (alpha + (1 << 20) / (bandwidth / 100)))  # queued

"""mgpu_lab.data.throughput and .rates: throughput sweeps, epoch start-up, wait-vs-compute timing, worker RNG draws."""
from __future__ import annotations

import time

import matplotlib
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from mgpu_lab.data.rates import measure, sweep_workers
from mgpu_lab.data.throughput import (LoopTiming, RandomDraws, batch_size_of, copy_timing, draws_by_worker,
                                      epoch_starts, knee, plot_sweep, timed_loop)

matplotlib.use("Agg")
pytestmark = pytest.mark.timeout(120)


class Slow(Dataset):
    def __init__(self, n=64, cost=0.0):
        self.n, self.cost = n, cost

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        time.sleep(self.cost)
        return torch.full((2,), float(i)), i


def test_batch_size_of():
    assert batch_size_of((torch.zeros(5, 2), torch.zeros(5))) == 5
    assert batch_size_of({"x": torch.zeros(3)}) == 3
    assert batch_size_of([]) == 0
    assert batch_size_of(torch.tensor(1.0)) == 1


def test_measure_counts_samples_after_warmup():
    row = measure(DataLoader(Slow(), batch_size=8), n_batches=3, warmup=2)
    assert row["samples"] == 24 and row["seconds"] > 0 and row["startup_s"] >= 0
    assert row["samples_per_s"] == pytest.approx(24 / row["seconds"])
    with pytest.raises(ValueError, match="has 8 batches but warmup=1 \\+ n_batches=8"):
        measure(DataLoader(Slow(), batch_size=8), n_batches=8)
    with pytest.raises(ValueError, match="at least one batch"):
        measure(DataLoader(Slow(), batch_size=8), n_batches=0)


def test_knee_is_the_fewest_workers_near_the_best():
    rows = [{"num_workers": k, "samples_per_s": v} for k, v in ((0, 100), (1, 150), (2, 300), (3, 290), (4, 310))]
    assert knee(rows) == 2
    assert knee(rows, fraction=1.0) == 4


def test_sweep_with_workers_and_knee_and_plot():
    rows = sweep_workers(Slow(cost=0.005), [0, 2], batch_size=4, n_batches=4, progress=False)
    assert [r["num_workers"] for r in rows] == [0, 2]
    assert all(r["samples"] == 16 and r["samples_per_s"] > 0 for r in rows)  # numbers: see the notebook
    assert knee(rows) in (0, 2)
    ax = plot_sweep(rows, cores=2)
    assert ax.get_xlabel() == "num_workers"
    with pytest.raises(ValueError, match="rows of a sweep"):
        knee([])


def test_persistent_workers_start_once():
    loader = DataLoader(Slow(n=16), batch_size=4, num_workers=1, persistent_workers=True)
    rows = epoch_starts(loader, epochs=2)
    assert [r["epoch"] for r in rows] == [0, 1] and all(r["epoch_s"] >= r["first_batch_s"] for r in rows)
    assert len(epoch_starts(DataLoader(Slow(n=16), batch_size=4), epochs=1, batches=2)) == 1


def test_timed_loop_tells_data_bound_from_compute_bound():
    data_bound = timed_loop(DataLoader(Slow(n=24, cost=0.01), batch_size=4), lambda b: None, progress=False)
    assert data_bound.batches == 6 and data_bound.samples == 20  # the first batch is kept apart
    assert data_bound.verdict == "data-bound" and "data-bound" in str(data_bound)
    # 0.1 s of compute per batch against data that costs nothing: compute-bound even when a loaded
    # machine makes each batch's fetch take tens of milliseconds
    compute_bound = timed_loop(DataLoader(Slow(n=24), batch_size=4), lambda b: time.sleep(0.1),
                               max_batches=3, progress=False)
    assert compute_bound.batches == 3 and compute_bound.verdict == "compute-bound"
    assert 0 <= compute_bound.wait_fraction < 0.5


def test_loop_timing_numbers():
    t = LoopTiming(batches=3, samples=30, startup_s=1.0, wait_s=1.0, compute_s=3.0)
    assert t.wait_fraction == 0.25 and t.samples_per_s == 7.5 and t.verdict == "compute-bound"


def test_copy_timing_needs_cuda():
    assert copy_timing(device="cpu") is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_copy_timing_on_gpu():
    out = copy_timing((8, 3, 64, 64), device="cuda", repeats=3)
    assert out["pinned_s"] > 0 and out["pageable_s"] > 0 and out["bytes"] == 8 * 3 * 64 * 64 * 4


def test_own_generator_repeats_across_forked_workers_global_ones_do_not():
    by_worker = draws_by_worker(RandomDraws(n=4), num_workers=2)
    assert sorted(by_worker) == [0, 1]
    w0, w1 = by_worker[0][0], by_worker[1][0]
    assert w0["own_rng"] == w1["own_rng"]  # a Generator made in __init__ is copied into every worker
    for key in ("random", "numpy", "torch"):  # reseeded per worker by the DataLoader
        assert w0[key] != w1[key]
    main = draws_by_worker(RandomDraws(n=2), num_workers=0)
    assert list(main) == [-1]


def test_worker_draws_are_reproducible_with_a_generator():
    def run():
        return draws_by_worker(RandomDraws(n=4), 2, generator=torch.Generator().manual_seed(3))

    assert run() == run()

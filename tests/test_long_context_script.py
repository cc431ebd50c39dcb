"""scripts/long_context_train.py for real: under torchrun --standalone --nproc-per-node=4 on a (dp=2, cp=2) mesh
(ring attention checked against full attention first, forward and gradients), then resumed in one process from its
DCP checkpoint, each compared with one process trained on whole sequences and the global batch."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mgpu_lab.core import procenv

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "long_context_train.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"]
SMALL = ["--samples", "16", "--seq", "32", "--dim", "16", "--heads", "2", "--hidden", "32", "--dtype", "float64"]


def _run(argv):
    with procenv.private_tmpdir("torchrun-") as tmp:  # torchrun leaves torchelastic_* there
        proc = subprocess.run(argv, cwd=ROOT, env=procenv.child_env({"OMP_NUM_THREADS": "1", "TMPDIR": tmp}),
                              capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    return out


def _losses(out: str) -> dict:
    return {int(m.group(1)): float(m.group(2)) for m in re.finditer(r"step (\d+): loss (\S+)", out)}


def _diffs(out: str) -> tuple[float, float]:
    m = re.search(r"one process with global batch 8: max \|loss diff\| (\S+), max \|weight diff\| (\S+)", out)
    assert m, out
    return float(m.group(1)), float(m.group(2))


def test_ring_cp_x_dp_under_torchrun_trains_like_one_process_and_one_process_resumes_its_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    out = _run([*TORCHRUN, str(SCRIPT), *SMALL, "--cp", "2", "--steps", "3", "--checkpoint-dir", str(ckpt),
                "--check-attention", "--compare-reference"])
    for rank, (d, c, group) in enumerate([(0, 0, [0, 1]), (0, 1, [0, 1]), (1, 0, [2, 3]), (1, 1, [2, 3])]):
        assert (f"rank {rank}/4 local_rank {rank} node 0: backend gloo, device cpu, mesh (dp={d}, cp={c}), "
                f"CP group {group}") in out, out
    # Ring attention on a CP group of 2, float64, both layouts, causal and not: the output and the gradients of
    # q, k and v equal full attention's; K and V go once around (1 hop each, forward), and in backward K and V
    # once more plus dK and dV all the way home (2 hops): point-to-point messages only.
    m = re.search(r"max \|out diff\| (\S+), max \|grad diff\| (\S+); rank 0's communication per call: "
                  r"forward (\{.*?\}), backward (\{.*?\})$", out, re.MULTILINE)
    assert m, out
    assert float(m.group(1)) < 1e-12 and float(m.group(2)) < 1e-12, out
    assert (m.group(3), m.group(4)) == ("{'send': 2, 'recv': 2}", "{'send': 6, 'recv': 6}"), out
    assert "on a (dp=2, cp=2) mesh, zigzag layout, float64; 4 sequences of 32 tokens per DP group, 16 positions " \
           "per CP rank, global batch 8" in out, out
    assert sorted(_losses(out)) == [0, 1, 2] and out.count("step 0: loss") == 1, out  # rank 0 logs, once
    loss_diff, weight_diff = _diffs(out)
    assert loss_diff < 1e-10 and weight_diff < 1e-6, out
    assert sorted(os.listdir(ckpt / "step-3")) == [".metadata"] + [f"__{r}_0.distcp" for r in range(4)]

    # The 4-rank checkpoint, resharded into one process (a (1, 1) mesh, whole sequences); the global batch of 8.
    resumed = _run([sys.executable, str(SCRIPT), *SMALL, "--cp", "1", "--batch-size", "8", "--steps", "5",
                    "--resume", "--checkpoint-dir", str(ckpt), "--compare-reference"])
    assert f"resumed from {ckpt / 'step-3'} (after 3 steps)" in resumed, resumed
    assert sorted(_losses(resumed)) == [3, 4], resumed
    loss_diff, weight_diff = _diffs(resumed)
    assert loss_diff < 1e-10 and weight_diff < 1e-6, resumed


def _bench():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_long_context", ROOT / "bench" / "long_context.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_benchmark_prints_ring_beside_all_gather_with_ratios_and_checks_its_arguments():
    bench = _bench()
    row = lambda seq, kib_in, kib_peak, rows: {"seq": seq, "bytes_in": kib_in * 1024, "peak_bytes": kib_peak * 1024,
                                               "kv_rows": rows, "flops": 0}
    per_rank = [{"all-gather": [row(64, 8, 100, 64)], "ring": [row(64, 8, 40, 32)]},
                {"all-gather": [row(64, 8, 120, 64)], "ring": [row(64, 8, 30, 32)]}]
    header, line = bench.table(2, per_rank).splitlines()
    assert "KiB in all-gather" in header and "KiB peak all-gather" in header and "ratio" in header
    # the largest over the ranks: peak 120 against 40, a ratio of 0.33; bytes equal; half the rows
    assert line.split() == ["2", "64", "|", "8.0", "8.0", "1.00", "|", "120.0", "40.0", "0.33", "|",
                            "64.0", "32.0", "0.50"], line
    for argv in (["--world", "1"], ["--world", "4", "--seqs", "12"]):
        with pytest.raises(SystemExit):
            bench.main(argv)
    assert bench.ring_function().__name__ == "ring_attend"

"""scripts/tp_train.py for real: under torchrun --standalone --nproc-per-node=4 on a (2, 2) mesh, then resumed in one
process from its DCP checkpoint, each compared with one process trained on the global batch."""
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
SCRIPT = ROOT / "scripts" / "tp_train.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"]
SMALL = ["--samples", "32", "--dim", "16", "--hidden", "32", "--seq", "8", "--optimizer", "sgd", "--lr", "0.05"]


def _run(argv):
    with procenv.private_tmpdir("torchrun-") as tmp:  # torchrun leaves torchelastic_* there
        proc = subprocess.run(argv, cwd=ROOT, env=procenv.child_env({"OMP_NUM_THREADS": "1", "TMPDIR": tmp}),
                              capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    return out


def _losses(out: str) -> dict:
    return {int(m.group(1)): float(m.group(2)) for m in re.finditer(r"step (\d+): loss (\S+)", out)}


def _diff(out: str) -> float:
    return float(re.search(r"one process with global batch 16\| = (\S+)", out).group(1))


def test_torchrun_on_a_2d_mesh_trains_like_one_process_and_one_process_resumes_its_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    out = _run([*TORCHRUN, str(SCRIPT), *SMALL, "--tp", "2", "--steps", "3", "--checkpoint-dir", str(ckpt),
                "--compare-reference"])
    for rank, (d, t) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
        assert f"rank {rank}/4 local_rank {rank} node 0: backend gloo, device cpu, mesh (dp={d}, tp={t})" in out, out
    assert "on a (dp=2, tp=2) mesh; 8 sequences per DP group, global batch 16" in out, out
    assert sorted(_losses(out)) == [0, 1, 2] and out.count("step 0: loss") == 1, out  # rank 0 logs, once
    assert _diff(out) < 1e-5, out
    assert sorted(os.listdir(ckpt / "step-3")) == [".metadata"] + [f"__{r}_0.distcp" for r in range(4)]

    # The 4-rank checkpoint, resharded into one process (a (1, 1) mesh); the global batch of 16 as before.
    resumed = _run([sys.executable, str(SCRIPT), *SMALL, "--tp", "1", "--batch-size", "16", "--steps", "5",
                    "--resume", "--checkpoint-dir", str(ckpt), "--compare-reference"])
    assert f"resumed from {ckpt / 'step-3'} (after 3 steps)" in resumed, resumed
    assert sorted(_losses(resumed)) == [3, 4], resumed
    assert _diff(resumed) < 1e-5, resumed

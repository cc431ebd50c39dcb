"""scripts/fsdp_train.py for real: under torchrun --standalone --nproc-per-node=2, then resumed in one process."""
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
SCRIPT = ROOT / "scripts" / "fsdp_train.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
SMALL = ["--samples", "64", "--width", "8", "--depth", "2"]


def _run(argv):
    with procenv.private_tmpdir("torchrun-") as tmp:  # torchrun leaves torchelastic_* there
        proc = subprocess.run(argv, cwd=ROOT, env=procenv.child_env({"OMP_NUM_THREADS": "1", "TMPDIR": tmp}),
                              capture_output=True, text=True,
                              timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    return out


def test_torchrun_trains_sharded_writes_dcp_checkpoints_and_one_process_resumes_them(tmp_path):
    ckpt = tmp_path / "ckpt"
    out = _run([*TORCHRUN, str(SCRIPT), *SMALL, "--epochs", "1", "--checkpoint-dir", str(ckpt)])
    for r in (0, 1):
        assert f"rank {r}/2 local_rank {r} node 0: backend gloo, device cpu" in out, out
    assert "sharded over 2 rank(s); batch 16 per rank, global 32; 1 epoch(s)" in out, out
    assert out.count("epoch 0: mean loss") == 1, out  # rank 0 logs, once
    assert sorted(os.listdir(ckpt / "epoch-0")) == [".metadata", "__0_0.distcp", "__1_0.distcp"]

    # The 2-rank checkpoint, resharded into 1 process (a process group of one); global batch 32 as before.
    out = _run([sys.executable, str(SCRIPT), *SMALL, "--epochs", "2", "--batch-size", "32", "--resume",
                "--checkpoint-dir", str(ckpt), "--compare-reference"])
    assert "rank 0/1 local_rank 0 node 0: backend gloo" in out, out
    assert f"resumed from {ckpt / 'epoch-0'} (after epoch 0)" in out, out
    assert "epoch 0:" not in out and "epoch 1: mean loss" in out, out
    diff = float(re.search(r"one process with global batch 32\| = (\S+)", out).group(1))
    assert diff < 1e-5, out
    assert sorted(os.listdir(ckpt)) == ["epoch-0", "epoch-1"]

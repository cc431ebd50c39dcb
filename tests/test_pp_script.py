"""scripts/pp_train.py for real: every schedule under torchrun --standalone --nproc-per-node=2, then PP x DP on 4."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from mgpu_lab.core import procenv

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "pp_train.py"
SCHEDULES = ["gpipe", "1f1b", "interleaved", "zbv"]


def _torchrun(nprocs: int, *argv) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nprocs}",
           str(SCRIPT), "--width", "8", "--steps", "3", "--compare-reference", *argv]
    with procenv.private_tmpdir("torchrun-") as tmp:  # torchrun leaves torchelastic_* there
        proc = subprocess.run(cmd, cwd=ROOT, env=procenv.child_env({"OMP_NUM_THREADS": "1", "TMPDIR": tmp}),
                              capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    return out


def _diffs(out: str) -> dict:
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"(\S+): max \|pipeline weights - one process\| = "
                                                                  r"(\S+)", out)}


def test_every_schedule_under_torchrun_trains_like_one_process():
    out = _torchrun(2, "--schedule", *SCHEDULES)
    assert "interleaved: 2 pipeline rank(s) x 1 replica(s), 4 layers" in out, out
    diffs = _diffs(out)
    assert sorted(diffs) == sorted(SCHEDULES), out
    assert all(d < 1e-5 for d in diffs.values()), diffs


def test_two_pipelines_of_two_ranks_on_a_mesh_train_like_one_process():
    out = _torchrun(4, "--schedule", "1f1b", "--dp", "2")
    assert "1f1b: 2 pipeline rank(s) x 2 replica(s), 2 layers, 4 micro-batches of 2" in out, out
    assert _diffs(out)["1f1b"] < 1e-5, out

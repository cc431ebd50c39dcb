"""scripts/ddp_train.py for real: under torchrun --standalone --nproc-per-node=2, and as plain python."""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mgpu_lab.data import datasets, download
from mgpu_lab.parallel import ddp
from mgpu_lab.core import procenv

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "ddp_train.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
SMALL = ["--samples", "96", "--val-samples", "24", "--batch-size", "8", "--hidden", "8"]


def _run(argv, **kwargs):
    with procenv.private_tmpdir("torchrun-") as tmp:  # torchrun leaves torchelastic_* there
        proc = subprocess.run(argv, cwd=ROOT, env=procenv.child_env({"OMP_NUM_THREADS": "1", "TMPDIR": tmp}),
                              capture_output=True, text=True,
                              timeout=240, **kwargs)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    return out


def _script_module():
    spec = importlib.util.spec_from_file_location("ddp_train_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _reference(epochs):
    script = _script_module()
    args = script.parse_args(SMALL)
    train_set, _ = script.load_data(args)
    return ddp.reference_train(lambda: script.make_model(8, 8, 3, 0), train_set, epochs, 16, 0.1)


def test_torchrun_downloads_once_trains_like_one_process_then_resumes(tmp_path):
    # The served archive holds exactly the data the script would make itself.
    full = datasets.synthetic_classification(96 + 24, 8, 3, seed=0)
    md5 = datasets.write_archive(full, tmp_path / "served" / "blobs.tar.gz")
    ckpt = tmp_path / "ckpt"
    with download.serve(tmp_path / "served") as server:
        out = _run([*TORCHRUN, str(SCRIPT), *SMALL, "--epochs", "1", "--checkpoint-dir", str(ckpt),
                    "--compare-reference", "--data-url", server.url + "blobs.tar.gz", "--data-md5", md5,
                    "--data-root", str(tmp_path / "data")])
    assert server.downloads["blobs.tar.gz"] == 1, out
    for r in (0, 1):
        assert f"rank {r}/2 local_rank {r} node 0: backend gloo" in out, out
        assert f"rank {r}: 6 optimizer steps, 6 gradient all-reduces" in out, out
    assert out.count("epoch 0: val accuracy") == 1, out  # rank 0 logs, once
    diff = float(re.search(r"one process with global batch 16\| = (\S+)", out).group(1))
    assert diff < 1e-6, out
    assert torch.load(ckpt / "last.pt", weights_only=True)["epoch"] == 0

    out = _run([*TORCHRUN, str(SCRIPT), *SMALL, "--epochs", "2", "--checkpoint-dir", str(ckpt), "--resume"])
    assert "resumed from" in out and "after epoch 0" in out, out
    assert "epoch 0:" not in out and "epoch 1: val accuracy" in out, out
    state = torch.load(ckpt / "last.pt", weights_only=True)
    assert state["epoch"] == 1
    assert ddp.max_diff(state["model"], _reference(2)) < 1e-6


def test_plain_python_runs_one_process_without_a_process_group(tmp_path):
    out = _run([sys.executable, str(SCRIPT), *SMALL, "--epochs", "1", "--compare-reference", "--accumulate", "2"])
    assert "rank 0/1 local_rank 0 node 0: backend none (one process)" in out, out
    assert "rank 0: 6 optimizer steps, 0 gradient all-reduces" in out, out
    assert float(re.search(r"one process with global batch 16\| = (\S+)", out).group(1)) < 1e-6, out


def test_bad_arguments_are_refused_with_the_fix():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--data-url", "http://x/a.tar.gz"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--data-url needs --data-md5" in proc.stderr

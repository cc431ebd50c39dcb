"""scripts/crashing_train.py under real torchrun: the failing rank is the root cause, with its traceback."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from mgpu_lab.launcher import elastic

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "crashing_train.py"


@pytest.mark.timeout(300)
def test_the_failing_rank_is_torchrun_s_root_cause_with_its_error_file(tmp_path):
    argv = elastic.torchrun_argv(SCRIPT, "--crash-at-step", 3, "--fail-rank", 1, nproc=2, log_dir=tmp_path)
    run = elastic.run(argv, env=elastic.STORE_PER_ATTEMPT, timeout=240, echo=False)
    assert run.returncode != 0, run.output[-3000:]
    summary = elastic.failure_summary(run.output)
    root = next(i for i, line in enumerate(summary) if "Root Cause" in line)
    rank_line = next(line for line in summary[root:] if line.strip().startswith("rank"))
    assert rank_line.split(":")[1].split()[0] == "1", summary  # rank 1, whose exception it was
    messages = [json.loads(p.read_text())["message"]["message"] for p in tmp_path.rglob("error.json")]
    assert any("injected failure on rank 1 at step 3" in m for m in messages), messages


@pytest.mark.timeout(300)
def test_without_a_crash_it_trains_to_the_end(tmp_path):
    argv = elastic.torchrun_argv(SCRIPT, "--crash-at-step", 0, "--epochs", 1, nproc=2, log_dir=tmp_path)
    run = elastic.run(argv, env=elastic.STORE_PER_ATTEMPT, timeout=240, echo=False)
    assert run.returncode == 0, run.output[-3000:]
    assert "attempt 0: finished; weight sum" in run.output

"""mgpu_lab.launcher.elastic: torchrun commands, running them with a time limit, reading the failure summary."""
from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

import pytest

from mgpu_lab.launcher import elastic

pytestmark = pytest.mark.timeout(120)

SUMMARY = """I1123 02:31:28.766000 1 torch/x.py:1] something before
Traceback (most recent call last):
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
train.py FAILED
Root Cause (first observed failure):
[0]:
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 23492)
============================================================"""


def test_torchrun_argv_puts_the_options_before_the_script():
    argv = elastic.torchrun_argv("train.py", "--epochs", 2, nproc=4, max_restarts=3, log_dir="logs")
    assert argv[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert {"--standalone", "--nproc-per-node=4", "--max-restarts=3", "--log-dir=logs"} <= set(argv)
    assert argv[-3:] == ["train.py", "--epochs", "2"]
    forked = elastic.torchrun_argv("train.py", fork=True)
    assert "--run-path" in forked and "--start-method=fork" in forked and forked[-1].endswith("/train.py")


def test_failure_summary_is_the_block_from_child_failed_error():
    lines = elastic.failure_summary(SUMMARY)
    assert lines[0].endswith("ChildFailedError:") and "  rank      : 1 (local_rank: 1)" in lines
    assert elastic.failure_summary("all good") == []


def test_run_keeps_the_output_and_stops_a_command_at_its_time_limit():
    done = elastic.run([sys.executable, "-c", "print('hello'); import sys; sys.exit(3)"], echo=False)
    assert done.returncode == 3 and done.lines("hello") == ["hello"]
    slow = elastic.run([sys.executable, "-c", "import time; time.sleep(30)"], echo=False, timeout=1)
    assert slow.returncode is None and slow.seconds < 20


def test_torchrun_leaves_nothing_in_the_temp_dir(tmp_path):
    """torchrun makes a log folder (torchelastic_*) in the temp dir of every run and never removes it.

    Read from torchrun's own log (at LOGLEVEL=INFO its launch configuration names the folder, ``log_dir``),
    not from what /tmp holds: other tests may start torchruns at the same time."""
    script = tmp_path / "where.py"
    script.write_text("import tempfile\nprint('TMP', tempfile.gettempdir())\n")
    done = elastic.run(elastic.torchrun_argv(script, nproc=1), env={"LOGLEVEL": "INFO"}, echo=False, timeout=90)
    assert done.returncode == 0, done.output
    used = Path(done.lines("^TMP ")[0].split()[1])
    assert used != Path(tempfile.gettempdir()) and not used.exists()  # the run's own, removed after it
    logs = [Path(re.search(r"log_dir\s+:\s+(\S+)", line).group(1)) for line in done.lines(r"\blog_dir\s+: ")]
    assert logs and all(p.parent == used and p.name.startswith("torchelastic_") for p in logs), done.output

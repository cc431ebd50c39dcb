"""bench/suite_processes.py: the process inventory of a command (what the suite's CPU is spent on)."""
from __future__ import annotations

import doctest
import importlib.util
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[1] / "bench" / "suite_processes.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_suite_processes", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(pid, ppid, forked, start, cpu=1.0, end=None, comm="python"):
    return dict(comm=comm, cpu=cpu, pid=pid, ppid=ppid, forked=forked, start=start,
                end=start + 10 if end is None else end)


def test_its_examples_hold(bench):
    failed, tried = doctest.testmod(bench, verbose=False)
    assert tried >= 6 and failed == 0


def test_a_rank_counts_under_the_fresh_process_it_was_forked_from_even_after_its_pid_is_reused(bench):
    seen = {10: [(100.1, "python -c from multiprocessing.forkserver import main; main(3, 5)")],
            20: [(100.1, "python -m ipykernel_launcher -f k.json")],
            # pid 10 reused later by a torchrun agent, pid 30 exec'd from the sandbox's start-up into a judge
            30: [(200.2, "python -P -s -m mgpu_lab.course.sandbox_init {} -- python -m mgpu_lab.course.runner serve"
                         " a 3")]}
    seen[10].append((300.4, "python -m torch.distributed.run --nproc-per-node 2 train.py"))
    seen[40] = [(400.1, "/bin/sh /opt/conda/bin/start-kernel.sh k2.json"),  # then it exec'd the kernel
                (400.6, "python -m ipykernel_launcher -f k2.json")]
    rows = [_row(10, 20, False, 100.0, cpu=7.0, end=150.0), _row(11, 10, True, 110.0, cpu=2.0),
            _row(12, 11, True, 111.0, cpu=0.5), _row(20, 1, False, 100.0, cpu=4.0, end=160.0),
            _row(30, 1, False, 200.0, cpu=3.0), _row(10, 1, False, 300.0, cpu=5.0, end=320.0),
            _row(13, 10, True, 305.0, cpu=0.25, comm="pt_elastic"), _row(99, 98, True, 50.0, cpu=0.1),
            _row(40, 1, False, 400.0, cpu=3.5)]
    found = bench.inventory(rows, seen)
    assert found["fork server (fresh)"] == {"fresh": 1, "fresh_cpu": 7.0, "forked": 2, "forked_cpu": 2.5}
    assert found["Jupyter kernel"] == {"fresh": 2, "fresh_cpu": 7.5, "forked": 0, "forked_cpu": 0.0}
    assert found["grader's judge"]["fresh"] == 1
    assert found["torchrun"] == {"fresh": 1, "fresh_cpu": 5.0, "forked": 1, "forked_cpu": 0.25}
    assert found["unknown"]["forked"] == 1  # its parent ended before accounting began
    text = bench.table(found, busy=20.0, wall=5.0)
    assert text.splitlines()[1].startswith("fork server (fresh)") and "of 20 busy" in text


def test_without_accounting_it_says_what_to_install_and_runs_nothing(bench, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(bench.shutil, "which", lambda name: None)
    marker = tmp_path / "ran"
    assert bench.main(["touch", str(marker)]) == 2
    assert "apt-get install acct" in capsys.readouterr().err and not marker.exists()

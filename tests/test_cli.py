"""Tests for the `mgpu-lab` command (mgpu_lab.cli and `python -m mgpu_lab`)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mgpu_lab import cli, doctor

ROOT = Path(__file__).resolve().parents[1]


def run_module(*args, timeout=180):
    """Run ``python -m mgpu_lab ARGS`` with this repository first on the path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "mgpu_lab", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_no_command_prints_help_and_exits_2(capsys):
    assert cli.main([]) == 2
    assert "doctor" in capsys.readouterr().out


def test_doctor_options_reach_run_doctor(monkeypatch):
    seen = {}

    def fake_run_doctor(**kwargs):
        seen.update(kwargs)
        return 0

    monkeypatch.setattr(doctor, "run_doctor", fake_run_doctor)
    assert cli.main(["doctor", "--backend", "gloo", "--nprocs", "3", "--timeout", "9.5"]) == 0
    assert seen == {"backends": ["gloo"], "nprocs": 3, "timeout": 9.5}
    assert cli.main(["doctor"]) == 0
    assert seen == {"backends": None, "nprocs": 2, "timeout": 30.0}


def test_doctor_exit_code_is_run_doctors(monkeypatch):
    monkeypatch.setattr(doctor, "run_doctor", lambda **kwargs: 1)
    assert cli.main(["doctor"]) == 1


def test_unknown_backend_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["doctor", "--backend", "mpi"])
    assert exc.value.code == 2
    assert "invalid choice: 'mpi'" in capsys.readouterr().err


def test_bad_value_is_a_usage_error_that_says_why(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["doctor", "--nprocs", "0"])
    assert exc.value.code == 2
    assert "mgpu-lab doctor: error: nprocs=0 must be an int >= 1" in capsys.readouterr().err


def test_doctor_help_lists_its_options(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["doctor", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert "--backend" in text and "--nodes N" in text  # --nodes: lesson 07's simulated nodes


def test_python_dash_m_help():
    result = run_module("--help", timeout=60)
    assert result.returncode == 0, result.stderr
    assert "usage: mgpu-lab" in result.stdout and "doctor" in result.stdout


@pytest.mark.slow
def test_python_dash_m_doctor_end_to_end():
    result = run_module("doctor", "--timeout", "120")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "gloo   OK in " in result.stdout
    assert "launch: 2 ranks" in result.stdout  # it went through the real launcher
    assert "result: all" in result.stdout


@pytest.mark.slow
def test_doctor_failure_exits_nonzero_and_says_what_to_try():
    # nccl asked for explicitly on a machine without one GPU per rank.
    result = run_module("doctor", "--backend", "nccl", "--nprocs", "64", "--timeout", "60")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "nccl   FAILED: cannot run here: nccl needs one GPU per rank" in result.stdout
    assert "use backend gloo" in result.stdout


def test_console_script():
    script = shutil.which("mgpu-lab", path=os.path.dirname(sys.executable))
    if script is None:
        pytest.skip("the mgpu-lab command is not installed here; run `pip install -e .`")
    result = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "doctor" in result.stdout

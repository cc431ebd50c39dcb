"""scripts/gpu_check.py: the prepared GPU check; here, its quick mode (no GPU) and its report."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: `make gpu-check` runs for real there")
def test_without_a_gpu_the_quick_mode_reports_every_check_and_exits_0(tmp_path):
    gc = _module()
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert [c["name"] for c in report["checks"]] == [name for name, _, _ in gc.CHECKS]
    skipped = [c["name"] for c in report["checks"] if c["status"] == "skipped"]
    gpu_only = [name for name, needs_gpu, _ in gc.CHECKS if needs_gpu]
    assert set(gpu_only) <= set(skipped), report["checks"]
    assert f"no GPU: {len(skipped)} checks skipped" in proc.stdout
    text = (tmp_path / "report.txt").read_text()
    assert all(f"== {name}:" in text for name, _, _ in gc.CHECKS)
    # the one real launch of the quick mode: 2 gloo ranks from a Jupyter kernel, each banner as it should read
    launch = next(c for c in report["checks"] if c["name"] == "kernel-launch")
    assert launch["status"] == "passed" and "launch: 2 ranks · gloo · cpu" in launch["detail"]


def test_a_failing_or_raising_step_is_reported_and_the_budget_leaves_the_rest_not_run(tmp_path, monkeypatch):
    gc = _module()
    clock = iter(range(0, 10_000, 100))
    monkeypatch.setattr(gc.time, "monotonic", lambda: float(next(clock)))
    ran = []

    def ok(gpus, limit, **kwargs):
        ran.append(limit)
        return {"status": "passed", "seconds": 1.0, "detail": "fine"}

    def boom(gpus, limit, **kwargs):
        raise OSError("the disk is full")
    steps = {name: ok for name, _, _ in gc.CHECKS} | {"wheels": boom}
    monkeypatch.setattr(gc, "STEPS", steps)
    report = gc.run_checks(tmp_path, gpus=1, budget=350)
    status = {c["name"]: (c["status"], c["detail"]) for c in report["checks"]}
    assert status["environment"][0] == "passed"
    assert status["wheels"] == ("failed", "OSError: the disk is full")
    assert [s for s, _ in status.values()].count("not run") >= 1  # 100 s a step on this clock: 350 s runs out
    assert json.loads((tmp_path / "report.json").read_text())["summary"] == report["summary"]
    assert all(limit <= 350 for limit in ran)


def test_the_wheel_list_names_what_a_folder_lacks(tmp_path):
    gc = _module()
    assert gc.missing_wheels(tmp_path / "absent") == sorted(gc.CARRIED)
    for name in gc.CARRIED:  # wheel files spell '-' as '_'
        (tmp_path / f"{name.replace('-', '_')}-1.0-py3-none-any.whl").write_bytes(b"")
    (tmp_path / "nbval-1.0-py3-none-any.whl").unlink()
    assert gc.missing_wheels(tmp_path) == ["nbval"]


def test_every_gpu_marked_test_is_found_by_reading_the_source():
    gc = _module()
    marked = gc.gpu_marked_tests()
    assert "tests/profiling/test_traces.py::test_memory_snapshot_on_a_gpu" in marked
    assert "tests/long_context/test_torch_cp.py::test_context_parallel_equals_full_attention_on_two_gpus" in marked
    assert not any("test_gpu_check.py" in t for t in marked)
    assert len(marked) >= 15


def test_every_lesson_with_a_gpu_path_is_run_under_nbval_on_the_gpu():
    gc = _module()
    assert "14_long_context" in gc.NOTEBOOKS  # section 4 runs torch's context_parallel where 2 GPUs exist
    assert all((ROOT / "solutions" / f"{name}.ipynb").exists() for name in gc.NOTEBOOKS)

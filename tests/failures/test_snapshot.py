"""mgpu_lab.failures.snapshot and .resume: atomic writes, RNG state, a rank SIGKILLed under torchrun resuming."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from mgpu_lab import launch
from mgpu_lab.failures import resume, snapshot
from mgpu_lab.launcher import elastic

pytestmark = pytest.mark.timeout(300)
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "resumable_train.py"


def _script():
    spec = importlib.util.spec_from_file_location("resumable_train_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_save_atomically_replaces_the_file_and_leaves_no_temporary_file(tmp_path):
    path = tmp_path / "s.pt"
    resume.save_atomically({"v": torch.ones(3)}, path)
    resume.save_atomically({"v": torch.zeros(3)}, str(path))
    assert torch.equal(torch.load(path, weights_only=True)["v"], torch.zeros(3))
    assert os.listdir(tmp_path) == ["s.pt"]


def test_a_failed_save_atomically_raises_keeps_the_old_file_and_cleans_up(tmp_path):
    path = tmp_path / "s.pt"
    resume.save_atomically({"v": 1}, path)
    with pytest.raises(Exception):
        resume.save_atomically({"v": 2, "f": lambda: 0}, path)  # a lambda cannot be pickled
    assert torch.load(path, weights_only=True) == {"v": 1}
    assert os.listdir(tmp_path) == ["s.pt"]


def test_rng_state_round_trip_on_the_cpu():
    state = snapshot.rng_state("cpu")
    a = torch.rand(3)
    snapshot.set_rng_state(state, "cpu")
    assert torch.equal(torch.rand(3), a)
    assert set(state) == {"cpu"}


def test_load_snapshot_is_none_without_a_file_and_snapshot_every_must_be_positive(tmp_path):
    assert snapshot.load_snapshot(tmp_path / "none.pt") is None
    with pytest.raises(ValueError, match="snapshot_every=0"):
        launch_free = resume.train
        launch_free(None, None, 1, 1, 0.1, str(tmp_path / "s.pt"), 0)


def test_a_rank_killed_under_torchrun_resumes_to_the_uninterrupted_weights(tmp_path):
    script = _script()
    out = tmp_path / "final.pt"
    argv = elastic.torchrun_argv(SCRIPT, "--snapshot", tmp_path / "snap.pt", "--kill-at-step", 10, "--fail-rank", 1,
                                 "--out", out, nproc=2, max_restarts=1, fork=True)
    result = elastic.run(argv, env=elastic.STORE_PER_ATTEMPT, echo=False, timeout=240)
    assert result.returncode == 0, result.output[-3000:]
    assert result.lines(r"rank 1: SIGKILL at step 10 \(attempt 0\)"), result.output[-3000:]
    assert result.lines(r"attempt 1: world size 2, resuming from .* \(step 8\)"), result.output[-3000:]
    resumed = torch.load(out, weights_only=True)
    straight = launch(resume.train, 2, script.make_model, script.make_data(48), 3, 4, 0.1,
                      str(tmp_path / "straight.pt"), 4)[0]
    assert set(resumed) == set(straight)
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)


def test_another_world_size_resumes_the_snapshot_epoch_from_its_start(tmp_path):
    script = _script()
    path = str(tmp_path / "snap.pt")
    launch(resume.train, 2, script.make_model, script.make_data(48), 1, 4, 0.1, path, 4)
    assert torch.load(path, weights_only=True)["step"] == 4
    state = launch(resume.train, 1, script.make_model, script.make_data(48), 2, 4, 0.1, path, 4)[0]
    after = torch.load(path, weights_only=True)
    assert after["step"] == 24 and len(after["rng"]) == 1  # epoch 0 redone with 12 steps per epoch, then epoch 1
    assert all(torch.isfinite(v).all() for v in state.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_rng_state_keeps_the_gpu_generator_that_dropout_draws_from():
    device = torch.device("cuda", 0)
    state = snapshot.rng_state(device)
    assert set(state) == {"cpu", "cuda"}
    a = torch.rand(3, device=device)
    moved = {k: v.to(device) for k, v in state.items()}  # as if loaded with map_location=device
    snapshot.set_rng_state(moved, device)
    assert torch.equal(torch.rand(3, device=device), a)

"""mgpu_lab.devices.subset_train: the child's training, in this process and as a real child process.

On a machine without a GPU the child trains on the CPU and reports 0 GPUs.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from mgpu_lab import devices
from mgpu_lab.devices import visible
from mgpu_lab.devices.subset_train import LEARNING_RATES, RESULT, _orders, cuda_sees, train

pytestmark = pytest.mark.timeout(300)
HAS_GPU = devices.gpu_count() > 0


def _expected_device(ids) -> str:
    """What a child given ``ids`` trains on here: cuda:0 if CUDA exposes any of them."""
    return "cuda:0" if cuda_sees(ids, devices.gpu_count()) else "cpu"


# -- cuda_sees: CUDA's rule for CUDA_VISIBLE_DEVICES -------------------------------------
@pytest.mark.parametrize("ids, gpus, seen", [
    ([0, 1], 4, [0, 1]), ([2, 3], 4, [2, 3]), ([3, 1], 4, [3, 1]),
    ([2, 3], 2, []), ([0, 1], 1, [0]), ([1, 5, 0], 2, [1]), ([0], 0, []),
])
def test_cuda_sees_stops_at_the_first_missing_gpu(ids, gpus, seen):
    assert cuda_sees(ids, gpus) == seen


# -- train, in this process ---------------------------------------------------------------
def test_train_is_deterministic_and_learns():
    threads = torch.get_num_threads()
    first, again = train("B", steps=20), train("B", steps=20)
    assert torch.get_num_threads() == threads  # train() leaves this process's threads alone
    assert first["first_loss"] == again["first_loss"] and first["last_loss"] == again["last_loss"]
    assert first["last_loss"] < first["first_loss"]
    assert first["device"] == ("cuda:0" if HAS_GPU else "cpu")
    assert first["lr"] == LEARNING_RATES["B"] and first["steps"] == 20 and first["train_s"] > 0


def test_the_two_jobs_differ_only_in_learning_rate():
    a, b = train("A", steps=3), train("B", steps=3)
    assert a["first_loss"] == b["first_loss"]  # same data, same initial weights
    assert a["last_loss"] != b["last_loss"]


@pytest.mark.parametrize("kwargs, words", [
    ({"name": "C"}, "'C' is not one of ['A', 'B']"),
    ({"name": "A", "steps": 0}, "steps=0"),
    ({"name": "A", "batch_size": 0}, "batch_size=0"),
])
def test_train_rejects_bad_arguments(kwargs, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        train(**kwargs)


def test_orders_reads_train_lines_until_quit_or_eof():
    assert list(_orders(["train 5\n", "train 7\n", "quit\n", "train 9\n"])) == [5, 7]
    assert list(_orders(["train 3\n"])) == [3]
    with pytest.raises(ValueError, match="expected 'train STEPS' or 'quit'"):
        list(_orders(["go\n"]))


# -- the script, as a real child process ------------------------------------------------------
def test_script_reports_what_the_child_sees_and_its_result():
    env = visible.child_env([2, 3])
    proc = subprocess.run([sys.executable, "-m", "mgpu_lab.devices.subset_train", "--model", "A", "--steps", "5"],
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "CUDA_VISIBLE_DEVICES='2,3'" in lines[0]
    assert lines[1].startswith("model A (lr 0.05) on ")
    result = json.loads(lines[-1][len(RESULT):])
    assert result["visible"] == "2,3" and result["steps"] == 5
    assert result["device"] == _expected_device([2, 3])


def test_script_rejects_an_unknown_model():
    proc = subprocess.run([sys.executable, "-m", "mgpu_lab.devices.subset_train", "--model", "Z"],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 2 and "invalid choice: 'Z'" in proc.stderr

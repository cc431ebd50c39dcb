"""Tests for mgpu_lab.devices.visible: the environment that makes a child process see a subset of GPUs.

The GPU count is simulated on CPU machines; the test marked ``gpu`` checks
that a real child sees exactly the chosen GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from mgpu_lab import devices
from mgpu_lab.devices import visible

HAS_GPU = torch.cuda.is_available() and torch.cuda.device_count() > 0
needs_gpu = pytest.mark.skipif(
    not HAS_GPU, reason=f"needs a CUDA GPU: {devices.describe()}"
)


def simulate_gpu_count(monkeypatch, count):
    """Make torch.cuda report ``count`` GPUs (all that ``check_exists`` asks about)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: bool(count))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


@pytest.fixture
def no_visible_env(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)


# --- subset_vars: validation ----------------------------------------


@pytest.mark.parametrize(
    ("ids", "match"),
    [
        ([], r"ids=\[\] selects no GPU"),
        ((), r"ids=\[\] selects no GPU"),
        ([0, 1, 0], r"lists GPU 0 more than once.*\[0, 1\]"),
        ([2, 2, 3, 3], r"lists GPU 2, 3 more than once"),
        ([0, -1], r"ids\[1\]=-1 is negative"),
        ([True], r"ids\[0\]=True \(bool\) is not a GPU index"),
        ([0, False], r"ids\[1\]=False \(bool\) is not a GPU index"),
        (["0"], r"ids\[0\]='0' \(str\) is not a GPU index"),
        ([1.0], r"ids\[0\]=1.0 \(float\) is not a GPU index"),
        ([None], r"ids\[0\]=None \(NoneType\)"),
        ("0,1", r"ids='0,1' \(str\) is not a list; pass a list"),
        (0, r"ids=0 \(int\) is not a list"),
        ({0, 1}, r"\(set\) is not a list"),
        (None, r"ids=None \(NoneType\) is not a list"),
    ],
)
def test_subset_vars_rejects_bad_ids(ids, match, no_visible_env):
    with pytest.raises(ValueError, match=match):
        visible.subset_vars(ids)


def test_subset_vars_basic(no_visible_env):
    assert visible.subset_vars([2, 3]) == {
        "CUDA_VISIBLE_DEVICES": "2,3",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
    }
    # The child's cuda:0 is the first id given, so order is kept as given.
    assert visible.subset_vars((3, 0))["CUDA_VISIBLE_DEVICES"] == "3,0"
    assert visible.subset_vars(range(2))["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_subset_vars_accepts_integral_types(no_visible_env):
    numpy = pytest.importorskip("numpy")
    env = visible.subset_vars([numpy.int64(1)])
    assert env["CUDA_VISIBLE_DEVICES"] == "1"


def test_check_exists_with_simulated_gpus(monkeypatch, no_visible_env):
    simulate_gpu_count(monkeypatch, 2)
    assert visible.subset_vars([1, 0], check_exists=True) == {
        "CUDA_VISIBLE_DEVICES": "1,0",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
    }
    with pytest.raises(ValueError, match=r"asks for GPU 2 but this process sees 2 GPU.*ids below 2"):
        visible.subset_vars([0, 2], check_exists=True)
    # Without check_exists the id is passed through: the child may see more.
    assert visible.subset_vars([5])["CUDA_VISIBLE_DEVICES"] == "5"


def test_check_exists_without_any_gpu(monkeypatch, no_visible_env):
    simulate_gpu_count(monkeypatch, 0)
    with pytest.raises(ValueError, match=r"no CUDA GPU is visible here.*check_exists=False"):
        visible.subset_vars([0], check_exists=True)


# --- subset_vars: mapping through the parent's CUDA_VISIBLE_DEVICES --


def test_maps_through_parent_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    assert visible.subset_vars([1]) == {
        "CUDA_VISIBLE_DEVICES": "5",
        # The parent's indices mean GPUs in CUDA's default order; keep it.
        "CUDA_DEVICE_ORDER": "FASTEST_FIRST",
    }
    assert visible.subset_vars([2, 0])["CUDA_VISIBLE_DEVICES"] == "6,4"


def test_mapping_keeps_parent_device_order(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4, 5")
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    assert visible.subset_vars([1]) == {
        "CUDA_VISIBLE_DEVICES": "5",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
    }


def test_mapping_with_uuids():
    environ = {"CUDA_VISIBLE_DEVICES": "GPU-aaaa,MIG-bbbb"}
    env = visible.subset_vars([1, 0], environ=environ)
    assert env["CUDA_VISIBLE_DEVICES"] == "MIG-bbbb,GPU-aaaa"


def test_mapping_past_the_end_of_parent_list():
    match = r"position 3 of this process's CUDA_VISIBLE_DEVICES='4,5,6'.*holds 3 usable.*ids below 3"
    with pytest.raises(ValueError, match=match):
        visible.subset_vars([0, 3], environ={"CUDA_VISIBLE_DEVICES": "4,5,6"})


def test_mapping_stops_at_first_invalid_entry_like_cuda():
    # CUDA ignores everything from the first invalid entry on: only 0 and 1 exist.
    environ = {"CUDA_VISIBLE_DEVICES": "0,1,-1,2"}
    assert visible.subset_vars([1], environ=environ)["CUDA_VISIBLE_DEVICES"] == "1"
    with pytest.raises(ValueError, match="holds 2 usable"):
        visible.subset_vars([2], environ=environ)


def test_mapping_when_parent_hides_every_gpu():
    with pytest.raises(ValueError, match=r"CUDA_VISIBLE_DEVICES='', which holds 0 usable"):
        visible.subset_vars([0], environ={"CUDA_VISIBLE_DEVICES": ""})


# --- child_env ---------------------------------------------------------------


def test_child_env_copies_base_without_modifying_it(no_visible_env):
    base = {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "9"}
    env = visible.child_env([0, 1], base=base)
    assert env == {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0,1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert base == {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "9"}


def test_child_env_defaults_to_os_environ(monkeypatch, no_visible_env):
    monkeypatch.setenv("MGPU_LAB_TEST_MARKER", "yes")
    env = visible.child_env([1])
    assert env["MGPU_LAB_TEST_MARKER"] == "yes"
    assert env["CUDA_VISIBLE_DEVICES"] == "1"
    assert "CUDA_VISIBLE_DEVICES" not in os.environ


def test_child_env_rejects_bad_ids():
    with pytest.raises(ValueError, match="selects no GPU"):
        visible.child_env([])


def test_child_process_sees_the_subset(no_visible_env):
    code = (
        "import os; print(os.environ['CUDA_VISIBLE_DEVICES'], "
        "os.environ['CUDA_DEVICE_ORDER'])"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        env=visible.child_env([1, 0]),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert result.stdout.split() == ["1,0", "PCI_BUS_ID"]


# --- real GPUs -----------------------------------------------------------------


@pytest.mark.gpu
@needs_gpu
def test_child_sees_exactly_the_chosen_gpu(no_visible_env):
    def names_in_child(env):
        code = (
            "import torch\n"
            "for i in range(torch.cuda.device_count()): print(torch.cuda.get_device_name(i))"
        )
        result = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True,
            timeout=120, check=True,
        )
        return result.stdout.strip().splitlines()

    # Without CUDA_VISIBLE_DEVICES, ids are physical indices in PCI bus order.
    pci_names = names_in_child({**os.environ, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    assert len(pci_names) == devices.gpu_count()
    last = len(pci_names) - 1
    assert names_in_child(visible.child_env([last])) == [pci_names[last]]

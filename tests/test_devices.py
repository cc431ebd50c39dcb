"""Tests for mgpu_lab.devices: discovery, the CPU fallback text, visible-GPU subsets.

GPU code paths are exercised on CPU machines by simulating torch.cuda; the
tests marked ``gpu`` check the same code against real hardware.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from mgpu_lab import devices

HAS_GPU = torch.cuda.is_available() and torch.cuda.device_count() > 0
needs_gpu = pytest.mark.skipif(
    not HAS_GPU, reason=f"needs a CUDA GPU: {devices.describe()}"
)

H100 = SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=80 * 1024**3, major=9, minor=0)
A10 = SimpleNamespace(name="NVIDIA A10", total_memory=int(22.5 * 1024**3), major=8, minor=6)


def simulate_gpus(monkeypatch, props):
    """Make torch.cuda report these device properties, one per simulated GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: bool(props))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(props))

    def get_device_properties(index):
        if not 0 <= index < len(props):
            raise AssertionError(f"asked for device {index} of {len(props)}")
        return props[index]

    monkeypatch.setattr(torch.cuda, "get_device_properties", get_device_properties)


@pytest.fixture
def no_visible_env(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)


# --- discovery -------------------------------------------------------------


def test_gpu_count_is_zero_when_cuda_is_unavailable(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    assert devices.gpu_count() == 0
    assert devices.list_gpus() == []


def test_gpu_count_and_list_gpus_with_simulated_gpus(monkeypatch):
    simulate_gpus(monkeypatch, [H100, A10])
    assert devices.gpu_count() == 2
    gpus = devices.list_gpus()
    assert gpus == [
        devices.GPUInfo(0, "NVIDIA H100 80GB HBM3", 80 * 1024**3, (9, 0)),
        devices.GPUInfo(1, "NVIDIA A10", int(22.5 * 1024**3), (8, 6)),
    ]
    assert gpus[1].device == "cuda:1"
    assert gpus[0].total_memory_gib == pytest.approx(80.0)
    assert str(gpus[1]) == "cuda:1 NVIDIA A10 (22.5 GiB, compute 8.6)"


def test_gpuinfo_is_frozen():
    gpu = devices.GPUInfo(0, "x", 1, (8, 0))
    with pytest.raises(dataclasses.FrozenInstanceError):
        gpu.index = 1


def test_describe_lists_simulated_gpus(monkeypatch, no_visible_env):
    simulate_gpus(monkeypatch, [H100, H100])
    assert devices.describe() == (
        "2 CUDA GPUs: cuda:0 NVIDIA H100 80GB HBM3 (80.0 GiB, compute 9.0), "
        "cuda:1 NVIDIA H100 80GB HBM3 (80.0 GiB, compute 9.0)"
    )


def test_describe_one_gpu_says_which_visible_devices(monkeypatch):
    simulate_gpus(monkeypatch, [A10])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert devices.describe() == (
        "1 CUDA GPU (CUDA_VISIBLE_DEVICES='3'): cuda:0 NVIDIA A10 (22.5 GiB, compute 8.6)"
    )


def test_describe_cpu_only_torch_build(monkeypatch, no_visible_env):
    simulate_gpus(monkeypatch, [])
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    text = devices.describe()
    assert text.startswith("no CUDA GPU visible (")
    assert f"torch {torch.__version__} was built without CUDA" in text
    assert text.endswith("running on the CPU")


@pytest.mark.parametrize("value", ["", " ", "-1"])
def test_describe_visible_devices_hides_every_gpu(monkeypatch, value):
    simulate_gpus(monkeypatch, [])
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
    assert devices.describe() == (
        f"no CUDA GPU visible (CUDA_VISIBLE_DEVICES={value!r} hides every GPU): "
        "running on the CPU"
    )


def test_describe_no_driver(monkeypatch, no_visible_env):
    simulate_gpus(monkeypatch, [])
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(devices, "_nvidia_driver_loaded", lambda: False)
    assert devices.describe() == (
        "no CUDA GPU visible (no NVIDIA driver or GPU found): running on the CPU"
    )


def test_describe_driver_loaded_but_no_gpu(monkeypatch):
    simulate_gpus(monkeypatch, [])
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(devices, "_nvidia_driver_loaded", lambda: True)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    text = devices.describe()
    assert "driver is loaded" in text
    assert "too old for CUDA 13.0" in text
    assert "CUDA_VISIBLE_DEVICES='7'" in text


def test_describe_on_this_machine_is_consistent():
    text = devices.describe()
    if devices.gpu_count():
        assert text.startswith(f"{devices.gpu_count()} CUDA GPU")
    else:
        assert text.startswith("no CUDA GPU visible (") and "running on the CPU" in text


# --- visible_devices_env: validation ----------------------------------------


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
def test_visible_devices_env_rejects_bad_ids(ids, match, no_visible_env):
    with pytest.raises(ValueError, match=match):
        devices.visible_devices_env(ids)


def test_visible_devices_env_basic(no_visible_env):
    assert devices.visible_devices_env([2, 3]) == {
        "CUDA_VISIBLE_DEVICES": "2,3",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
    }
    # The child's cuda:0 is the first id given, so order is kept as given.
    assert devices.visible_devices_env((3, 0))["CUDA_VISIBLE_DEVICES"] == "3,0"
    assert devices.visible_devices_env(range(2))["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_visible_devices_env_accepts_integral_types(no_visible_env):
    numpy = pytest.importorskip("numpy")
    env = devices.visible_devices_env([numpy.int64(1)])
    assert env["CUDA_VISIBLE_DEVICES"] == "1"


def test_check_exists_with_simulated_gpus(monkeypatch, no_visible_env):
    simulate_gpus(monkeypatch, [H100, H100])
    assert devices.visible_devices_env([1, 0], check_exists=True) == {
        "CUDA_VISIBLE_DEVICES": "1,0",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
    }
    with pytest.raises(ValueError, match=r"asks for GPU 2 but this process sees 2 GPU.*ids below 2"):
        devices.visible_devices_env([0, 2], check_exists=True)
    # Without check_exists the id is passed through: the child may see more.
    assert devices.visible_devices_env([5])["CUDA_VISIBLE_DEVICES"] == "5"


def test_check_exists_without_any_gpu(monkeypatch, no_visible_env):
    simulate_gpus(monkeypatch, [])
    with pytest.raises(ValueError, match=r"no CUDA GPU is visible here.*check_exists=False"):
        devices.visible_devices_env([0], check_exists=True)


# --- visible_devices_env: mapping through the parent's CUDA_VISIBLE_DEVICES --


def test_maps_through_parent_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    assert devices.visible_devices_env([1]) == {
        "CUDA_VISIBLE_DEVICES": "5",
        # The parent's indices mean GPUs in CUDA's default order; keep it.
        "CUDA_DEVICE_ORDER": "FASTEST_FIRST",
    }
    assert devices.visible_devices_env([2, 0])["CUDA_VISIBLE_DEVICES"] == "6,4"


def test_mapping_keeps_parent_device_order(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4, 5")
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    assert devices.visible_devices_env([1]) == {
        "CUDA_VISIBLE_DEVICES": "5",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
    }


def test_mapping_with_uuids():
    environ = {"CUDA_VISIBLE_DEVICES": "GPU-aaaa,MIG-bbbb"}
    env = devices.visible_devices_env([1, 0], environ=environ)
    assert env["CUDA_VISIBLE_DEVICES"] == "MIG-bbbb,GPU-aaaa"


def test_mapping_past_the_end_of_parent_list():
    match = r"position 3 of this process's CUDA_VISIBLE_DEVICES='4,5,6'.*holds 3 usable.*ids below 3"
    with pytest.raises(ValueError, match=match):
        devices.visible_devices_env([0, 3], environ={"CUDA_VISIBLE_DEVICES": "4,5,6"})


def test_mapping_stops_at_first_invalid_entry_like_cuda():
    # CUDA ignores everything from the first invalid entry on: only 0 and 1 exist.
    environ = {"CUDA_VISIBLE_DEVICES": "0,1,-1,2"}
    assert devices.visible_devices_env([1], environ=environ)["CUDA_VISIBLE_DEVICES"] == "1"
    with pytest.raises(ValueError, match="holds 2 usable"):
        devices.visible_devices_env([2], environ=environ)


def test_mapping_when_parent_hides_every_gpu():
    with pytest.raises(ValueError, match=r"CUDA_VISIBLE_DEVICES='', which holds 0 usable"):
        devices.visible_devices_env([0], environ={"CUDA_VISIBLE_DEVICES": ""})


# --- child_env ---------------------------------------------------------------


def test_child_env_copies_base_without_modifying_it(no_visible_env):
    base = {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "9"}
    env = devices.child_env([0, 1], base=base)
    assert env == {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0,1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert base == {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "9"}


def test_child_env_defaults_to_os_environ(monkeypatch, no_visible_env):
    monkeypatch.setenv("MGPU_LAB_TEST_MARKER", "yes")
    env = devices.child_env([1])
    assert env["MGPU_LAB_TEST_MARKER"] == "yes"
    assert env["CUDA_VISIBLE_DEVICES"] == "1"
    assert "CUDA_VISIBLE_DEVICES" not in os.environ


def test_child_env_rejects_bad_ids():
    with pytest.raises(ValueError, match="selects no GPU"):
        devices.child_env([])


def test_child_process_sees_the_subset(no_visible_env):
    code = (
        "import os; print(os.environ['CUDA_VISIBLE_DEVICES'], "
        "os.environ['CUDA_DEVICE_ORDER'])"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        env=devices.child_env([1, 0]),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert result.stdout.split() == ["1,0", "PCI_BUS_ID"]


# --- cpu_count ---------------------------------------------------------------


def test_cpu_count_respects_affinity():
    count = devices.cpu_count()
    assert count >= 1
    if hasattr(os, "sched_getaffinity"):
        assert count == len(os.sched_getaffinity(0))


def test_cpu_count_falls_back_to_os_cpu_count(monkeypatch):
    monkeypatch.delattr(os, "process_cpu_count", raising=False)
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert devices.cpu_count() == 1
    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    assert devices.cpu_count() == 6


# --- real GPUs -----------------------------------------------------------------


@pytest.mark.gpu
@needs_gpu
def test_list_gpus_matches_torch_on_real_hardware():
    gpus = devices.list_gpus()
    assert len(gpus) == torch.cuda.device_count() == devices.gpu_count()
    for gpu in gpus:
        props = torch.cuda.get_device_properties(gpu.index)
        assert gpu.name == props.name
        assert gpu.total_memory_bytes == props.total_memory > 0
        assert gpu.capability == torch.cuda.get_device_capability(gpu.index)
    assert devices.describe().startswith(f"{len(gpus)} CUDA GPU")


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
    assert names_in_child(devices.child_env([last])) == [pci_names[last]]

"""Tests for mgpu_lab.devices: discovery and the CPU fallback text.

GPU code paths are exercised on CPU machines by simulating torch.cuda; the
tests marked ``gpu`` check the same code against real hardware.
"""

from __future__ import annotations

import dataclasses
import os
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

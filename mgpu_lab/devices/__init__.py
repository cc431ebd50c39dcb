"""Devices, lesson 01: discovery and the CPU fallback (here), and the GPUs a child process sees.

What can this process run on? Everything here answers that question without ever
pretending a CPU is a GPU: with no CUDA GPU visible, the functions say so and why,
and the lessons run their ranks on the CPU. :mod:`mgpu_lab.devices.subset_jobs` starts one
child process per GPU subset and :mod:`mgpu_lab.devices.subset_train` is what such a child runs.

Example:
    >>> from mgpu_lab import devices
    >>> line = devices.describe()  # here: 'no CUDA GPU visible (no NVIDIA driver or GPU found): running on the CPU'
    >>> line.endswith("running on the CPU") == (devices.gpu_count() == 0)
    True
    >>> devices.cpu_count() >= 1
    True
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["GPUInfo", "cpu_count", "describe", "gpu_count", "list_gpus"]

_GIB = 1024**3


@dataclass(frozen=True)
class GPUInfo:
    """One CUDA GPU as this process sees it.

    Attributes:
        index: The torch device index, so the device is ``cuda:{index}``.
        name: The name the driver reports, e.g. ``"NVIDIA H100 80GB HBM3"``.
        total_memory_bytes: Total device memory in bytes.
        capability: Compute capability as ``(major, minor)``, e.g. ``(9, 0)``.

    Example:
        >>> gpu = GPUInfo(0, "NVIDIA H100", 80 * 1024**3, (9, 0))
        >>> str(gpu)
        'cuda:0 NVIDIA H100 (80.0 GiB, compute 9.0)'
    """

    index: int
    name: str
    total_memory_bytes: int
    capability: tuple[int, int]

    @property
    def device(self) -> str:
        """The torch device string, e.g. ``"cuda:0"``."""
        return f"cuda:{self.index}"

    @property
    def total_memory_gib(self) -> float:
        """Total device memory in GiB (1024**3 bytes)."""
        return self.total_memory_bytes / _GIB

    def __str__(self) -> str:
        major, minor = self.capability
        return (
            f"{self.device} {self.name} "
            f"({self.total_memory_gib:.1f} GiB, compute {major}.{minor})"
        )


def gpu_count() -> int:
    """Number of CUDA GPUs this process can use.

    Returns:
        ``torch.cuda.device_count()``, or 0 when CUDA is unavailable (CPU-only
        torch, no driver, or every GPU hidden by ``CUDA_VISIBLE_DEVICES``).

    Example:
        >>> gpu_count() == len(list_gpus())   # 0 on a machine without a GPU
        True
    """
    if not torch.cuda.is_available():
        return 0
    return int(torch.cuda.device_count())


def list_gpus() -> list[GPUInfo]:
    """Describe every CUDA GPU this process can use, in torch index order.

    Returns:
        One :class:`GPUInfo` per visible GPU; an empty list on a CPU-only machine.

    Example:
        >>> [str(gpu) for gpu in list_gpus()]  # on one H100: ['cuda:0 NVIDIA H100 80GB HBM3 (79.2 GiB, compute 9.0)']
        [...]
    """
    gpus = []
    for index in range(gpu_count()):
        props = torch.cuda.get_device_properties(index)
        gpus.append(
            GPUInfo(
                index=index,
                name=str(props.name),
                total_memory_bytes=int(props.total_memory),
                capability=(int(props.major), int(props.minor)),
            )
        )
    return gpus


def describe() -> str:
    """One line saying what this process runs on, and why when it is the CPU.

    Returns:
        For example ``"2 CUDA GPUs: cuda:0 NVIDIA H100 (79.2 GiB, compute 9.0),
        cuda:1 ..."``, or ``"no CUDA GPU visible (torch 2.4.0+cpu was built
        without CUDA): running on the CPU"``.

    Example:
        >>> line = describe()   # here: 'no CUDA GPU visible (no NVIDIA driver or GPU found): running on the CPU'
        >>> line.startswith("no CUDA GPU visible") == (gpu_count() == 0)
        True
    """
    gpus = list_gpus()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if gpus:
        noun = "GPU" if len(gpus) == 1 else "GPUs"
        restricted = "" if visible is None else f" (CUDA_VISIBLE_DEVICES={visible!r})"
        return f"{len(gpus)} CUDA {noun}{restricted}: " + ", ".join(map(str, gpus))
    return f"no CUDA GPU visible ({_why_no_gpu(visible)}): running on the CPU"


def _why_no_gpu(visible: str | None) -> str:
    """The most likely reason torch sees no GPU, most certain reason first."""
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return f"torch {torch.__version__} was built without CUDA"
    if visible is not None and not _parse_visible(visible):
        return f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU"
    if _nvidia_driver_loaded():
        hint = "" if visible is None else f", or CUDA_VISIBLE_DEVICES={visible!r} names none"
        return (
            f"an NVIDIA driver is loaded but torch {torch.__version__} sees no GPU: "
            f"the driver may be too old for CUDA {torch.version.cuda}{hint}"
        )
    return "no NVIDIA driver or GPU found"


def _nvidia_driver_loaded() -> bool:
    """Whether the NVIDIA kernel driver is loaded (Linux only; False elsewhere)."""
    return Path("/proc/driver/nvidia/version").exists()


def _parse_visible(value: str) -> list[str]:
    """The entries CUDA honours in a CUDA_VISIBLE_DEVICES value.

    CUDA reads the comma-separated list up to the first invalid entry, so
    ``"0,1,-1,2"`` exposes only GPUs 0 and 1, and ``""`` or ``"-1"`` none.
    Entries may be indices or ``GPU-``/``MIG-`` UUIDs.
    """
    entries = []
    for raw in value.split(","):
        entry = raw.strip()
        if not (entry.isdigit() or entry.startswith(("GPU-", "MIG-"))):
            break
        entries.append(entry)
    return entries


def cpu_count() -> int:
    """CPU cores this process may run on, respecting affinity masks.

    Containers, ``taskset`` and batch schedulers often allow fewer cores than
    the machine has; this counts the allowed ones.

    Returns:
        ``len(os.sched_getaffinity(0))`` where available, else
        ``os.cpu_count()``, and at least 1.

    Example:
        >>> cpu_count() >= 1
        True
    """
    process_cpu_count = getattr(os, "process_cpu_count", None)  # Python 3.13+
    if process_cpu_count is not None:
        return max(1, process_cpu_count() or 1)
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)

"""Device discovery, the CPU fallback, and visible-GPU subsets for child processes.

Everything here answers "what can this process run on?" without ever
pretending a CPU is a GPU: with no CUDA GPU visible, the functions say so and
why, and the lessons run their ranks on the CPU.

Example:
    >>> from mgpu_lab import devices
    >>> devices.describe()  # doctest: +SKIP
    'no CUDA GPU visible (no NVIDIA driver or GPU found): running on the CPU'
    >>> devices.visible_devices_env([2, 3])  # doctest: +SKIP
    {'CUDA_VISIBLE_DEVICES': '2,3', 'CUDA_DEVICE_ORDER': 'PCI_BUS_ID'}
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["GPUInfo", "child_env", "cpu_count", "describe", "gpu_count", "list_gpus",
           "visible_devices_env"]

_GIB = 1024**3
# CUDA's own default order when CUDA_DEVICE_ORDER is unset.
_CUDA_DEFAULT_ORDER = "FASTEST_FIRST"


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
        >>> gpu_count()  # doctest: +SKIP
        0
    """
    if not torch.cuda.is_available():
        return 0
    return int(torch.cuda.device_count())


def list_gpus() -> list[GPUInfo]:
    """Describe every CUDA GPU this process can use, in torch index order.

    Returns:
        One :class:`GPUInfo` per visible GPU; an empty list on a CPU-only machine.

    Example:
        >>> [str(gpu) for gpu in list_gpus()]  # doctest: +SKIP
        ['cuda:0 NVIDIA H100 80GB HBM3 (79.2 GiB, compute 9.0)']
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
        >>> print(describe())  # doctest: +SKIP
        no CUDA GPU visible (no NVIDIA driver or GPU found): running on the CPU
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


def _check_ids(ids: object) -> list[int]:
    """Validate GPU ids and return them as plain ints; raise ValueError if bad."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple, range)):
        raise ValueError(
            f"ids={ids!r} ({type(ids).__name__}) is not a list; pass a list of GPU indices "
            "such as [0] or [0, 1]"
        )
    if len(ids) == 0:
        raise ValueError(
            "ids=[] selects no GPU; pass at least one index such as [0] (to hide "
            "every GPU from a child, set CUDA_VISIBLE_DEVICES='' yourself)"
        )
    checked = []
    for position, gpu_id in enumerate(ids):
        if isinstance(gpu_id, bool) or not isinstance(gpu_id, numbers.Integral):
            raise ValueError(
                f"ids[{position}]={gpu_id!r} ({type(gpu_id).__name__}) is not a GPU "
                f"index; use ints such as [0, 1], not {list(ids)!r}"
            )
        if gpu_id < 0:
            raise ValueError(
                f"ids[{position}]={gpu_id} is negative; GPU indices start at 0, "
                "e.g. [0, 1]"
            )
        checked.append(int(gpu_id))
    duplicates = sorted({i for i in checked if checked.count(i) > 1})
    if duplicates:
        raise ValueError(
            f"ids={checked} lists GPU {', '.join(map(str, duplicates))} more than "
            f"once; each GPU can appear once, e.g. {sorted(set(checked))}"
        )
    return checked


def visible_devices_env(
    ids: list[int] | tuple[int, ...],
    check_exists: bool = False,
    *,
    environ: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Environment variables that make a child process see exactly these GPUs.

    ``ids`` are the GPUs as this process numbers them. With no
    ``CUDA_VISIBLE_DEVICES`` set here, those are the physical indices in PCI
    bus order, as ``nvidia-smi`` lists them. If this process already runs on
    a subset, ``ids`` are positions in that subset and are mapped through it,
    so the child gets the same physical GPUs this process calls ``cuda:i``:
    a parent with ``CUDA_VISIBLE_DEVICES="4,5,6"`` asking for ``[1]`` gives
    the child ``"5"``. The child's ``cuda:0`` is then ``ids[0]``, its
    ``cuda:1`` is ``ids[1]``, and so on.

    Args:
        ids: Non-empty list or tuple of unique, non-negative int GPU indices.
        check_exists: If True, also require every id to be below
            :func:`gpu_count`.
        environ: Environment to read this process's ``CUDA_VISIBLE_DEVICES``
            and ``CUDA_DEVICE_ORDER`` from; defaults to ``os.environ``.

    Returns:
        ``{"CUDA_VISIBLE_DEVICES": ..., "CUDA_DEVICE_ORDER": ...}``. The order
        is ``"PCI_BUS_ID"``, except when mapping through an existing
        ``CUDA_VISIBLE_DEVICES``, where the parent's order is kept (CUDA's
        default ``"FASTEST_FIRST"`` if unset), since the parent's indices mean
        GPUs in that order.

    Raises:
        ValueError: If ``ids`` is empty, not a list/tuple, holds a non-int, a
            bool, a negative or a repeated index; if an id is past the end of
            this process's ``CUDA_VISIBLE_DEVICES``; or, with
            ``check_exists=True``, if an id is not below :func:`gpu_count`.

    Example:
        >>> visible_devices_env([2, 3], environ={})
        {'CUDA_VISIBLE_DEVICES': '2,3', 'CUDA_DEVICE_ORDER': 'PCI_BUS_ID'}
        >>> visible_devices_env([1], environ={"CUDA_VISIBLE_DEVICES": "4,5,6"})
        {'CUDA_VISIBLE_DEVICES': '5', 'CUDA_DEVICE_ORDER': 'FASTEST_FIRST'}
    """
    checked = _check_ids(ids)
    environ = os.environ if environ is None else environ
    if check_exists:
        count = gpu_count()
        too_big = [i for i in checked if i >= count]
        if too_big:
            if count == 0:
                reason = _why_no_gpu(environ.get("CUDA_VISIBLE_DEVICES"))
                seen = f"no CUDA GPU is visible here ({reason})"
                fix = "run on a machine with a GPU, or pass check_exists=False"
            else:
                seen = f"this process sees {count} GPU(s), cuda:0..cuda:{count - 1}"
                fix = f"use ids below {count}"
            raise ValueError(f"ids={checked} asks for GPU {too_big[0]} but {seen}; {fix}")

    parent = environ.get("CUDA_VISIBLE_DEVICES")
    if parent is None:
        return {
            "CUDA_VISIBLE_DEVICES": ",".join(map(str, checked)),
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        }
    parent_ids = _parse_visible(parent)
    too_big = [i for i in checked if i >= len(parent_ids)]
    if too_big:
        raise ValueError(
            f"ids={checked} asks for position {too_big[0]} of this process's "
            f"CUDA_VISIBLE_DEVICES={parent!r}, which holds {len(parent_ids)} usable "
            f"GPU(s); ids are positions in that list, so use ids below "
            f"{len(parent_ids)}, or unset CUDA_VISIBLE_DEVICES to use physical ids"
        )
    return {
        "CUDA_VISIBLE_DEVICES": ",".join(parent_ids[i] for i in checked),
        "CUDA_DEVICE_ORDER": environ.get("CUDA_DEVICE_ORDER", _CUDA_DEFAULT_ORDER),
    }


def child_env(
    ids: list[int] | tuple[int, ...],
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """A full environment for a subprocess that should see only these GPUs.

    Args:
        ids: GPUs as this process numbers them; see :func:`visible_devices_env`
            (ids are mapped through this process's ``CUDA_VISIBLE_DEVICES``).
        base: Environment to start from; defaults to a copy of ``os.environ``.
            It is copied, never modified.

    Returns:
        A new dict: ``base`` with ``CUDA_VISIBLE_DEVICES`` and
        ``CUDA_DEVICE_ORDER`` replaced.

    Raises:
        ValueError: If ``ids`` is invalid; see :func:`visible_devices_env`.

    Example:
        >>> import subprocess, sys
        >>> subprocess.run([sys.executable, "train.py"], env=child_env([2, 3]))  # doctest: +SKIP
    """
    env = dict(os.environ if base is None else base)
    env.update(visible_devices_env(ids))
    return env


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

"""A simulated ``torch.cuda`` for check processes: GPUs in name on a machine without one.

:func:`simulated_gpus` is the one place where the checks patch ``torch.cuda``;
what lessons build on it (DataParallel's pieces, DDP's ``device_ids``) is
:mod:`.parallel`. No CUDA call is made inside the block, so it runs the same on
a laptop, in CI and on a GPU machine.

Example:
    >>> from mgpu_lab.course.checks.sim.devices import Placed, reset
    >>> reset()
    >>> with simulated_gpus(2):
    ...     torch.cuda.set_device(1)
    ...     torch.cuda.is_available(), torch.cuda.device_count(), torch.cuda.current_device()
    (True, 2, 1)
    >>> Placed.moves
    [('set_device', 'cuda:0', 'cuda:1')]
    >>> with simulated_gpus(0):
    ...     torch.cuda.is_available()
    False
"""
from __future__ import annotations

import os
import torch
from contextlib import contextmanager

from .devices import Placed, cuda_device


_PATCHED = ("is_available", "device_count", "current_device", "set_device", "device", "synchronize")


class _Device:
    """``torch.cuda.device(d)``: a context manager that does nothing (there is no GPU to switch to)."""

    def __init__(self, device):
        self.device = device

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@contextmanager
def simulated_gpus(n: int, *, local_rank: int | None = None):
    """``torch.cuda`` reports ``n`` GPUs inside the block.

    ``is_available``, ``device_count``, ``current_device`` (0 until ``set_device``),
    ``set_device`` (logged in :attr:`Placed.moves` as ``("set_device", from, to)``),
    ``device`` (a context that does nothing) and ``synchronize`` (returns at once).

    Args:
        n: visible GPUs (0: none, ``is_available()`` is False).
        local_rank: this process is a rank that :func:`mgpu_lab.launch` gave ``cuda:local_rank``
            (what ``mgpu_lab.dist.device()`` returns).
    """
    saved = {name: getattr(torch.cuda, name) for name in _PATCHED}
    saved_device = os.environ.get("MGPU_LAB_DEVICE")
    current = [0]

    def set_device(device) -> None:
        name = str(cuda_device(device))
        Placed.moves.append(("set_device", f"cuda:{current[0]}", name))
        current[0] = torch.device(name).index or 0

    torch.cuda.is_available, torch.cuda.device_count = (lambda: n > 0), (lambda: n)
    torch.cuda.current_device, torch.cuda.set_device = (lambda: current[0]), set_device
    torch.cuda.device, torch.cuda.synchronize = _Device, (lambda device=None: None)
    if local_rank is not None:
        os.environ["MGPU_LAB_DEVICE"] = f"cuda:{local_rank}"
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(torch.cuda, name, value)
        if local_rank is not None:
            os.environ.pop("MGPU_LAB_DEVICE", None)
            if saved_device is not None:
                os.environ["MGPU_LAB_DEVICE"] = saved_device

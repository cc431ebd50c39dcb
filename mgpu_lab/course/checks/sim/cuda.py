"""A simulated ``torch.cuda`` for check processes: GPUs in name on a machine without one.
"""
from __future__ import annotations

import os
import torch
from contextlib import contextmanager
from torch import nn

from .moved import Moved, tag as _tag


@contextmanager
def simulated_gpus(n: int):
    """``torch.cuda`` reports ``n`` GPUs inside the block (no CUDA call is made)."""
    saved = torch.cuda.is_available, torch.cuda.device_count
    torch.cuda.is_available = lambda: n > 0
    torch.cuda.device_count = lambda: n
    try:
        yield
    finally:
        torch.cuda.is_available, torch.cuda.device_count = saved


# -- a node of virtual GPUs --------------------------------------------------------------
def _cuda_name(device) -> str:
    return str(torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cuda"))


class PlacedNet(nn.Sequential):
    """A network whose ``.to``/``.cuda``/``.cpu`` are logged as ``("model", device)``; it stays on the CPU."""

    def to(self, *args, **kwargs):
        device, dtype = torch._C._nn._parse_to(*args, **kwargs)[:2]
        if device is not None:
            Moved.log.append(("model", str(device)))
        return super().to(dtype) if dtype is not None else self

    def cuda(self, device=None):
        Moved.log.append(("model", _cuda_name(device)))
        return self

    def cpu(self):
        Moved.log.append(("model", "cpu"))
        return self


class Sample(Moved):
    """A tagged sample whose tag survives the DataLoader's collation: each batch made is logged."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs)
        if func is torch.stack and args and isinstance(args[0], (list, tuple)) and isinstance(args[0][0], Moved):
            Moved.log.append((args[0][0].tag, "batch made"))
            return _tag(out, args[0][0].tag)
        return out


def virtual_gpus(local_rank: int, count: int):
    """Make this rank a GPU rank in name: ``count`` visible GPUs, this one ``cuda:local_rank``.

    Tagged tensors moved to a GPU stay on the CPU (``Moved.virtual_cuda``);
    ``torch.cuda.set_device`` and DDP's ``device_ids`` are logged, and DDP
    wraps the (CPU) module without them. Returns a function that undoes it all.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    saved = (torch.cuda.is_available, torch.cuda.device_count, torch.cuda.set_device,
             torch.cuda.current_device, DDP.__init__, os.environ.get("MGPU_LAB_DEVICE"))
    current = [0]
    original_init = DDP.__init__

    def set_device(device):
        name = _cuda_name(device)
        Moved.log.append(("set_device", name))
        current[0] = torch.device(name).index or 0

    def init(self, module, device_ids=None, output_device=None, *args, **kwargs):
        ids = "None" if device_ids is None else ",".join(_cuda_name(d) for d in device_ids)
        Moved.log.append(("DDP device_ids", ids))
        original_init(self, module, None, None, *args, **kwargs)

    torch.cuda.is_available, torch.cuda.device_count = (lambda: True), (lambda: count)
    torch.cuda.set_device, torch.cuda.current_device = set_device, (lambda: current[0])
    DDP.__init__ = init
    os.environ["MGPU_LAB_DEVICE"] = f"cuda:{local_rank}"
    Moved.virtual_cuda = True

    def undo():
        (torch.cuda.is_available, torch.cuda.device_count, torch.cuda.set_device,
         torch.cuda.current_device, DDP.__init__, device) = saved
        os.environ["MGPU_LAB_DEVICE"] = device or ""
        Moved.virtual_cuda = False

    return undo

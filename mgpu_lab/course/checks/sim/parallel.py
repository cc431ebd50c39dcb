"""DistributedDataParallel over the simulated GPUs of :mod:`.cuda`: the one virtual DDP.

:func:`virtual_ddp` (lesson 04): ``DistributedDataParallel`` logs the
``device_ids`` it was given in :attr:`Placed.moves` as ``("DDP device_ids", "",
"cuda:1")`` (``"None"`` when none) and wraps the CPU module without them. It goes
inside :func:`.cuda.simulated_gpus`, which makes the GPUs visible. :func:`simulated_nccl`
(lessons 04, 05): ``torch.distributed.get_backend()`` says ``"nccl"`` while the collectives
still run on gloo, so code that picks its tensors' device by the backend takes the GPU path.

Example:
    >>> import torch.distributed as dist
    >>> from torch import nn
    >>> from torch.nn.parallel import DistributedDataParallel as DDP
    >>> from mgpu_lab.course.checks.sim.cuda import simulated_gpus
    >>> from mgpu_lab.course.checks.sim.devices import reset
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> reset()
    >>> with simulated_gpus(2, local_rank=1), virtual_ddp():
    ...     ddp = DDP(nn.Linear(2, 2), device_ids=[1])
    >>> Placed.moves, ddp.device_ids
    ([('DDP device_ids', '', 'cuda:1')], None)
    >>> dist.destroy_process_group()
"""
from __future__ import annotations

from contextlib import contextmanager

from .devices import Placed, cuda_device


@contextmanager
def virtual_ddp():
    """``DistributedDataParallel`` logs its ``device_ids`` and wraps the (CPU) module without them."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    original = DDP.__init__

    def init(self, module, device_ids=None, output_device=None, *args, **kwargs):
        ids = "None" if device_ids is None else ",".join(str(cuda_device(d)) for d in device_ids)
        Placed.moves.append(("DDP device_ids", "", ids))
        original(self, module, None, None, *args, **kwargs)

    DDP.__init__ = init
    try:
        yield
    finally:
        DDP.__init__ = original


@contextmanager
def simulated_nccl():
    """Inside the block ``torch.distributed.get_backend()`` is ``"nccl"`` (the collectives still run on gloo).

    Example:
        >>> import torch.distributed as dist
        >>> with simulated_nccl():
        ...     dist.get_backend()
        'nccl'
    """
    import torch.distributed as tdist

    original = tdist.get_backend
    tdist.get_backend = lambda group=None: "nccl"
    try:
        yield
    finally:
        tdist.get_backend = original

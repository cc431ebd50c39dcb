"""nn.DataParallel step by step, on whatever devices exist.

The checks, the tests and the benchmarks use it.

``nn.DataParallel`` runs one training step in one process like this:

1. **scatter**: split the batch along dim 0 into one chunk per device (``torch.chunk``);
2. **replicate**: copy the model onto every device, *every step* (the copies
   stay linked to the original through autograd);
3. **parallel_apply**: run each replica on its chunk, one Python thread per device;
4. **gather**: concatenate the outputs on the first device;
5. backward flows through the copies, so the gradients of all replicas are
   summed into the original parameters, on the first device.

PyTorch's own pieces are built for GPUs: ``torch.nn.parallel.scatter`` and
``replicate`` send chunks and copies to GPUs only, and ``gather`` takes outputs
on GPUs (it can concatenate them on a GPU or on the CPU, ``target_device="cpu"``);
``nn.DataParallel`` with fewer than two GPUs just calls the model. The steps
here (:func:`scatter`, :meth:`StepByStepDataParallel.replicas`, :func:`parallel_apply`,
:func:`gather`) do the same on any devices: with CUDA devices they call PyTorch's
pieces; on a CPU they make the same autograd-linked replicas on "devices" that
are all the CPU, run in threads.
Given a :class:`mgpu_lab.parallel.timeline.Timeline`, they record which step ran on
which device, and when.

Example:
    >>> model = torch.nn.Linear(4, 2)
    >>> dp = StepByStepDataParallel(model, devices=["cpu", "cpu"])
    >>> x = torch.randn(6, 4)
    >>> torch.allclose(dp(x), model(x))
    True
"""
from __future__ import annotations

import torch
from torch import nn

from mgpu_lab.parallel.dp_tools import (_devices, _lane, _span, cpu_threads, default_devices, parallel_apply,
                                        time_steps, traced_step)
from mgpu_lab.parallel.timeline import Timeline

__all__ = ["default_devices", "cpu_threads", "scatter", "parallel_apply", "gather",
           "StepByStepDataParallel", "traced_step", "time_steps"]


def _all_cuda(devices) -> bool:
    return all(d.type == "cuda" for d in devices)


def scatter(batch: torch.Tensor, devices) -> list[torch.Tensor]:
    """Split ``batch`` along dim 0 like ``torch.chunk`` and move chunk ``i`` to ``devices[i]``.

    Fewer chunks than devices come back when the batch is smaller than the
    device count (as with ``nn.DataParallel``).

    Example:
        >>> [c.shape[0] for c in scatter(torch.zeros(5, 3), ["cpu"] * 2)]
        [3, 2]
    """
    devices = _devices(devices)
    if batch.dim() == 0:
        raise ValueError("scatter needs a batch with a batch dimension (dim 0); got a 0-d tensor")
    chunks = batch.chunk(len(devices), dim=0)
    return [c.to(d, non_blocking=True) for c, d in zip(chunks, devices)]


def gather(outputs, device) -> torch.Tensor:
    """Concatenate the outputs along dim 0 on ``device`` (each moved there first)."""
    device = torch.device(device)
    if _all_cuda([o.device for o in outputs]) and device.type == "cuda":
        return torch.nn.parallel.gather(outputs, device)
    return torch.cat([o.to(device) for o in outputs], dim=0)


class StepByStepDataParallel(nn.Module):
    """``nn.DataParallel`` written out, on any devices, optionally recording a :class:`Timeline`.

    Args:
        module: the model; its parameters live on ``devices[0]``.
        devices: default :func:`default_devices` (all GPUs, or two CPU "devices").
        timeline: record scatter/replicate/forward/gather spans here.
    """

    def __init__(self, module: nn.Module, devices=None, timeline: Timeline | None = None):
        super().__init__()
        self.module = module
        self.devices = _devices(devices if devices is not None else default_devices())
        self.timeline = timeline
        if timeline is not None:
            for i, d in enumerate(self.devices):
                timeline.add_lane(_lane(i, d))

    def _span(self, lane_index, phase):
        d = self.devices[lane_index] if lane_index is not None else self.devices[0]
        return _span(self.timeline, None if lane_index is None else _lane(lane_index, d), phase, d)

    def replicas(self, devices=None) -> list[nn.Module]:
        """This step's copies of ``module``, one per device (default: every device), linked to it by autograd.

        With CUDA devices this is ``torch.nn.parallel.replicate`` (a broadcast of the
        parameters; its backward sums the replicas' gradients onto the first device).
        Otherwise each replica is a shallow copy of every module whose parameters
        are ``param.to(device)``: a differentiable copy, or, on the same device, the
        parameter itself, so every replica's gradient adds into ``param.grad``.
        Replicas are for one forward pass: :meth:`forward` makes new ones every step.

        Example:
            >>> dp = StepByStepDataParallel(torch.nn.Linear(4, 2), devices=["cpu", "cpu"])
            >>> [r is dp.module for r in dp.replicas()]
            [False, False]
        """
        devices = self.devices if devices is None else _devices(devices)
        detach = not torch.is_grad_enabled()
        if _all_cuda(devices):
            return torch.nn.parallel.replicate(self.module, devices, detach=detach)
        modules = list(self.module.modules())
        index = {m: i for i, m in enumerate(modules)}
        replicas = []
        for device in devices:
            copies = [m._replicate_for_data_parallel() for m in modules]
            for m, c in zip(modules, copies):
                for key, child in m._modules.items():
                    c._modules[key] = None if child is None else copies[index[child]]
                for key, param in m._parameters.items():
                    # A copy is not a leaf: set it as a plain attribute, as torch's replicate does.
                    copy = None if param is None else (param.detach() if detach else param).to(device)
                    object.__setattr__(c, key, copy)
                for key, buf in m._buffers.items():
                    c._buffers[key] = None if buf is None else buf.to(device)
            replicas.append(copies[0])
        return replicas

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        if len(self.devices) == 1:  # as nn.DataParallel: one device, no copies
            return self.module(batch.to(self.devices[0]))
        with self._span(0, "scatter"):
            chunks = scatter(batch, self.devices)
        with self._span(0, "replicate"):
            replicas = self.replicas(self.devices[: len(chunks)])
        outputs = parallel_apply(replicas, chunks, self.devices[: len(chunks)], self.timeline)
        with self._span(0, "gather"):
            return gather(outputs, self.devices[0])

"""nn.DataParallel step by step, on whatever devices exist, with a per-device timeline.

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
``nn.DataParallel`` with fewer than two GPUs just calls the model. The functions
here do the same steps on any devices: with CUDA devices they call PyTorch's
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

import threading
import time
from contextlib import contextmanager, nullcontext

import torch
from torch import nn

from mgpu_lab.parallel.timeline import Timeline

__all__ = ["default_devices", "cpu_threads", "scatter", "replicate", "parallel_apply", "gather",
           "StepByStepDataParallel", "train_step", "time_steps"]


def default_devices(n_cpu: int = 2) -> list[torch.device]:
    """Every visible GPU when there are at least two; else ``n_cpu`` CPU "devices"."""
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n >= 2:
        return [torch.device("cuda", i) for i in range(n)]
    return [torch.device("cpu")] * n_cpu


@contextmanager
def cpu_threads(n: int = 1):
    """Run the block with ``n`` intra-op CPU threads, then restore the previous number.

    With CPU "devices", ``cpu_threads(1)`` gives each replica one core, as each
    GPU is one device; the plain model then also computes on one core.

    Example:
        >>> with cpu_threads(1):
        ...     torch.get_num_threads()
        1
    """
    if n < 1:
        raise ValueError(f"n={n}: use at least one thread")
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _devices(devices) -> list[torch.device]:
    devices = [torch.device(d) for d in devices]
    if not devices:
        raise ValueError("devices is empty: pass at least one device, e.g. ['cpu', 'cpu'] or ['cuda:0', 'cuda:1']")
    return devices


def _all_cuda(devices) -> bool:
    return all(d.type == "cuda" for d in devices)


@contextmanager
def _span(timeline: Timeline | None, lane: str | None, phase: str, device: torch.device):
    """A span of ``timeline`` timed on the host, ending when ``device``'s work does; nothing without one.

    Host time, not CUDA events: DataParallel's phases run in several threads and
    copy between GPUs on streams of their own, and the lesson shows wall time.
    """
    if timeline is None:
        yield
        return
    with timeline.span(lane, phase):
        yield
        _sync(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


def replicate(model: nn.Module, devices) -> list[nn.Module]:
    """One replica of ``model`` per device; gradients of the replicas flow back into ``model``.

    With CUDA devices this is ``torch.nn.parallel.replicate`` (a broadcast of the
    parameters; its backward sums the replicas' gradients onto the first device).
    Otherwise each replica is a shallow copy of every module whose parameters
    are ``param.to(device)``: a differentiable copy, or, on the same device, the
    parameter itself, so every replica's gradient adds into ``param.grad``.
    Replicas are for one forward pass: make new ones every step.
    """
    devices = _devices(devices)
    detach = not torch.is_grad_enabled()
    if _all_cuda(devices):
        return torch.nn.parallel.replicate(model, devices, detach=detach)
    modules = list(model.modules())
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


def _lane(i: int, device: torch.device) -> str:
    return f"{device} (replica {i})" if device.type == "cpu" else str(device)


def parallel_apply(replicas, inputs, devices=None, timeline: Timeline | None = None) -> list:
    """Run ``replicas[i](inputs[i])`` in one thread per replica; outputs in replica order.

    The threads share one Python interpreter: only one of them runs Python
    code at a time (the GIL); they overlap only inside PyTorch's kernels.

    Raises:
        RuntimeError: a replica raised; the message names it.
    """
    if len(replicas) != len(inputs):
        raise ValueError(f"{len(replicas)} replicas but {len(inputs)} inputs: give one input per replica")
    devices = _devices(devices) if devices is not None else [next(r.parameters()).device for r in replicas]
    grad = torch.is_grad_enabled()
    results: list = [None] * len(replicas)

    def work(i):
        device = devices[i]
        try:
            with torch.set_grad_enabled(grad), (torch.cuda.device(device) if device.type == "cuda" else nullcontext()):
                with _span(timeline, _lane(i, device), "forward", device):
                    results[i] = replicas[i](inputs[i])
        except Exception as exc:  # noqa: BLE001 - re-raised in the caller's thread below
            results[i] = exc

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(replicas))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for i, out in enumerate(results):
        if isinstance(out, Exception):
            raise RuntimeError(f"replica {i} on {devices[i]} raised {type(out).__name__}: {out}") from out
    return results


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

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        if len(self.devices) == 1:  # as nn.DataParallel: one device, no copies
            return self.module(batch.to(self.devices[0]))
        with self._span(0, "scatter"):
            chunks = scatter(batch, self.devices)
        with self._span(0, "replicate"):
            replicas = replicate(self.module, self.devices[: len(chunks)])
        outputs = parallel_apply(replicas, chunks, self.devices[: len(chunks)], self.timeline)
        with self._span(0, "gather"):
            return gather(outputs, self.devices[0])


def train_step(model, batch, target, loss_fn, optimizer, timeline: Timeline | None = None) -> float:
    """One optimisation step; with a timeline, loss+backward and the optimizer step are recorded
    across every lane (backward runs through all replicas)."""
    optimizer.zero_grad(set_to_none=True)
    out = model(batch)
    device = out.device
    with _span(timeline, None, "loss+backward", device):
        loss = loss_fn(out, target.to(device))
        loss.backward()
    with _span(timeline, None, "optimizer", device):
        optimizer.step()
    return loss.item()


def time_steps(model, batch, target, steps: int = 10, warmup: int = 2, lr: float = 0.01) -> float:
    """Seconds per SGD training step of ``model`` (plain, DataParallel or step-by-step) on one batch."""
    params = list(model.parameters())
    device = params[0].device
    optimizer = torch.optim.SGD(params, lr=lr)
    loss_fn = nn.CrossEntropyLoss()
    for _ in range(warmup):
        train_step(model, batch, target, loss_fn, optimizer)
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        train_step(model, batch, target, loss_fn, optimizer)
    _sync(device)
    return (time.perf_counter() - start) / steps

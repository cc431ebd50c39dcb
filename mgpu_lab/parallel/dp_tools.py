"""What lesson 03's notebook uses around DataParallel: devices, threads, a timeline of steps, timing.

Here is what runs *around* the steps of ``nn.DataParallel`` (scatter, replicate,
gather), which the lesson builds: the devices to spread
over, the threads that run replicas (:func:`parallel_apply`), a module that runs
a DataParallel forward you pass it and draws its steps on a
:class:`~mgpu_lab.parallel.timeline.Timeline` (:class:`TracedDataParallel`), and
the timing of training steps.

Example:
    >>> model = torch.nn.Linear(4, 2)
    >>> def by_device(module, batch, devices):   # any forward over devices (here: one device)
    ...     return module(batch.to(devices[0]))
    >>> dp = TracedDataParallel(model, by_device, devices=["cpu"])
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

__all__ = ["default_devices", "cpu_threads", "parallel_apply", "TracedDataParallel", "traced_step", "time_steps"]


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


class TracedDataParallel(nn.Module):
    """A module whose forward is ``forward(module, batch, devices)``: a DataParallel forward you wrote.

    With a timeline, each forward is drawn on it: every forward of ``module`` or of a
    replica of it (replicas keep its hooks) is a "forward" span on the lane of the
    device its input is on (the k-th one of a step on the k-th lane when the devices
    are all the CPU); on the first device's lane, the time from the start of the
    step to the first replica's forward is "scatter+replicate", and the time from
    the last one's end to the gathered result is "gather".

    Args:
        module: the model, on ``devices[0]``.
        forward: ``forward(module, batch, devices)`` -> the gathered output.
        devices: default :func:`default_devices` (all GPUs, or two CPU "devices").
        timeline: draw the steps here.
    """

    def __init__(self, module: nn.Module, forward, devices=None, timeline: Timeline | None = None):
        super().__init__()
        self.module, self.run = module, forward
        self.devices = _devices(devices if devices is not None else default_devices())
        self.timeline = timeline
        self._ends: list = []
        if timeline is not None:
            for i, d in enumerate(self.devices):
                timeline.add_lane(_lane(i, d))
            # Closures, not bound methods: a replicate that deep-copies the module copies its hooks too.
            starts, ends, first = {}, self._ends, self.devices[0]

            def started(replica, args):
                starts[threading.get_ident()] = time.perf_counter()

            def ended(replica, args, output):
                device = output.device if isinstance(output, torch.Tensor) else first
                _sync(device)
                ends.append((starts.pop(threading.get_ident()), time.perf_counter(), device))

            module.register_forward_pre_hook(started)
            module.register_forward_hook(ended)

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        if self.timeline is None:
            return self.run(self.module, batch, self.devices)
        self._ends.clear()
        start = time.perf_counter()
        out = self.run(self.module, batch, self.devices)
        _sync(self.devices[0])
        end = time.perf_counter()
        first = _lane(0, self.devices[0])
        spans = sorted(self._ends)
        for k, (s, e, device) in enumerate(spans):
            self.timeline.add(_lane(k, device), "forward", s, e)
        if spans:
            self.timeline.add(first, "scatter+replicate", start, spans[0][0])
            self.timeline.add(first, "gather", max(e for _, e, _ in spans), end)
        return out


def traced_step(model, batch, target, loss_fn, optimizer, timeline: Timeline | None = None) -> float:
    """One optimisation step, drawn on ``timeline`` when one is given: loss+backward and the optimizer
    step are spans across every lane (backward runs through all replicas); the loss as a float."""
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
    """Seconds per SGD training step of ``model`` (plain, DataParallel or by hand) on one batch."""
    params = list(model.parameters())
    device = params[0].device
    optimizer = torch.optim.SGD(params, lr=lr)
    loss_fn = nn.CrossEntropyLoss()
    for _ in range(warmup):
        traced_step(model, batch, target, loss_fn, optimizer)
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        traced_step(model, batch, target, loss_fn, optimizer)
    _sync(device)
    return (time.perf_counter() - start) / steps

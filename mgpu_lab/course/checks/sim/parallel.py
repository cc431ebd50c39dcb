"""PyTorch's data-parallel wrappers over the simulated GPUs of :mod:`.cuda`: DataParallel's pieces and DDP.

* :func:`virtual_data_parallel`: ``torch.nn.parallel``'s ``replicate``,
  ``parallel_apply``, ``scatter`` and ``gather`` (lesson 03's forward by hand) run
  on the CPU and place what they make on the named GPUs (:mod:`.devices`):
  replicas of a :class:`PlacedModule` are put on their devices, chunks and
  outputs are moved there by name.
* :func:`virtual_ddp` (lesson 04): ``DistributedDataParallel`` logs the
  ``device_ids`` it was given in :attr:`Placed.moves` as ``("DDP device_ids", "",
  "cuda:1")`` (``"None"`` when none) and wraps the CPU module without them.

Both go inside :func:`.cuda.simulated_gpus`, which makes the GPUs visible.

Example:
    >>> from torch import nn
    >>> from mgpu_lab.course.checks.sim.cuda import simulated_gpus
    >>> from mgpu_lab.course.checks.sim.devices import PlacedModule, place, reset
    >>> reset()
    >>> model = PlacedModule(nn.Linear(3, 2), name="model", out_tag="output", device="cuda:0")
    >>> with simulated_gpus(2), virtual_data_parallel():
    ...     chunks = torch.nn.parallel.scatter(place(torch.ones(4, 3), "batch"), [0, 1])
    ...     replicas = torch.nn.parallel.replicate(model, [0, 1])
    ...     outs = torch.nn.parallel.parallel_apply(replicas, chunks)
    ...     torch.nn.parallel.gather(outs, 0).device
    device(type='cuda', index=0)
    >>> [(m is model, tag, x, on) for m, tag, x, on, _ in PlacedModule.inputs]
    [(False, 'batch', 'cuda:0', 'cuda:0'), (False, 'batch', 'cuda:1', 'cuda:1')]
"""
from __future__ import annotations

import torch
from contextlib import contextmanager

from .devices import CPU, Placed, PlacedModule, cuda_device, resolve


def _names(devices) -> list[torch.device]:
    return [resolve(cuda_device(d)) for d in devices]


def replicate(network, devices, detach: bool = False):
    """Autograd-linked copies of ``network`` (the CPU path of :mod:`mgpu_lab.parallel.data_parallel`),
    each put on its device by name."""
    from mgpu_lab.parallel.data_parallel import replicate as cpu_replicate

    names = _names(devices)
    with torch.set_grad_enabled(torch.is_grad_enabled() and not detach):
        replicas = cpu_replicate(network, ["cpu"] * len(names))
    for replica, name in zip(replicas, names):
        if isinstance(replica, PlacedModule):
            replica.put_on(name)
    return replicas


def parallel_apply(modules, inputs, kwargs_tup=None, devices=None):
    """Each module on its input, one after the other."""
    kwargs_tup = kwargs_tup or ({},) * len(modules)
    return [m(*(x if isinstance(x, (list, tuple)) else (x,)), **kw) for m, x, kw in zip(modules, inputs, kwargs_tup)]


def scatter(inputs, target_gpus, dim: int = 0):
    """``torch.chunk`` of the batch, chunk i moved to GPU i by name."""
    names = _names(target_gpus)
    return tuple(c.to(name) for c, name in zip(inputs.chunk(len(names), dim), names))


def gather(outputs, target_device, dim: int = 0):
    """Every output moved to ``target_device`` by name, then concatenated."""
    name = CPU if target_device in ("cpu", -1) else _names([target_device])[0]
    return torch.cat([o.to(name) for o in outputs], dim)


@contextmanager
def virtual_data_parallel(fn=None):
    """``torch.nn.parallel``'s DataParallel pieces are this module's inside the block; so are the
    names in ``fn``'s globals bound to them (``from torch.nn.parallel import replicate``)."""
    import torch.nn.parallel as par

    swaps = {par.replicate: replicate, par.parallel_apply: parallel_apply, par.scatter: scatter, par.gather: gather}
    saved = {name: getattr(par, name) for name in ("replicate", "parallel_apply", "scatter", "gather")}
    g = getattr(fn, "__globals__", {})
    bound = {k: v for k, v in g.items() if any(v is orig for orig in swaps)}
    for name, orig in saved.items():
        setattr(par, name, swaps[orig])
    g.update({k: swaps[v] for k, v in bound.items()})
    try:
        yield
    finally:
        for name, orig in saved.items():
            setattr(par, name, orig)
        g.update(bound)


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

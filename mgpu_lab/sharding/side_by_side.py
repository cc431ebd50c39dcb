"""Lesson 08's measured result: DDP, ZeRO-1, ZeRO-2 and FSDP2 side by side in the same ranks.

:func:`scheme_rank` trains the same :class:`~mgpu_lab.sharding.fsdp.BlockNet` with Adam
under each scheme, in every rank, and measures what the lesson compares: the
bytes the rank holds (:func:`mgpu_lab.sharding.zero.held_bytes`), the peak bytes of a
step (:func:`mgpu_lab.sharding.fsdp.peak_bytes`: ``torch.cuda.max_memory_allocated`` on a
GPU), the elements its collectives move in a step (:func:`mgpu_lab.comm.record.record`;
DDP's all-reduce is made visible by registering PyTorch's own ``allreduce_hook``) and
the time per step, measured in steps that are not recorded.
:func:`compare` launches it.

Example:
    >>> rows = compare(2, width=64, depth=2)   # the lesson runs 4 ranks and a wider model
    launch: 2 ranks · ...
    >>> [r["scheme"] for r in rows[0]]
    ['DDP', 'ZeRO-1', 'ZeRO-2', 'FSDP2']
"""
from __future__ import annotations

import functools
import statistics
import time

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from mgpu_lab.sharding import fsdp, zero
from mgpu_lab.comm.record import record, summarize

__all__ = ["SCHEMES", "scheme_rank", "compare"]

SCHEMES = ("DDP", "ZeRO-1", "ZeRO-2", "FSDP2")
STAGE = {"DDP": 0, "ZeRO-1": 1, "ZeRO-2": 2, "FSDP2": 3}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _build(scheme: str, model, device: torch.device, lr: float):
    """``(what to call, what steps, the module whose parameters count, the optimizer that holds state)``."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    adam = lambda params: torch.optim.Adam(params, lr=lr)  # noqa: E731
    if scheme == "DDP":
        # .grad as views into DDP's buckets (else the buckets are a second copy of the gradients);
        # PyTorch's own allreduce_hook does what DDP does without a hook, in Python, where it is recorded
        net = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                  gradient_as_bucket_view=True)
        net.register_comm_hook(None, default_hooks.allreduce_hook)
        opt = adam(net.parameters())
        return net, opt, model, opt
    if scheme in ("ZeRO-1", "ZeRO-2"):
        flat = zero.FlatZero(model, STAGE[scheme], adam)
        return model, flat, model, flat.optimizer
    fsdp.shard_model(model, fsdp.make_mesh(device))
    opt = adam(model.parameters())
    return model, opt, model, opt


def scheme_rank(width: int = 256, depth: int = 4, features: int = 64, classes: int = 10, batch: int = 32,
                steps: int = 3, lr: float = 1e-3, schemes=SCHEMES) -> list[dict]:
    """In every rank: train under each scheme: one warm-up step, one recorded step, ``steps`` timed ones.

    Returns:
        One dict per scheme: ``scheme``, ``n_params``, ``held`` (dict of bytes),
        ``formula`` (:func:`~mgpu_lab.sharding.zero.zero_memory`), ``peak`` (bytes of
        one step), ``moved`` (elements per step, by collective), ``step_s``
        (median seconds per step), ``device``.
    """
    import torch.distributed as tdist

    device = fsdp.rank_device()
    world = tdist.get_world_size()
    x, y = fsdp.batch(batch, features, classes)
    rows = []
    for scheme in schemes:
        model = fsdp.BlockNet(features, width, depth, classes).to(device)
        n = sum(p.numel() for p in model.parameters())
        net, stepper, module, opt = _build(scheme, model, device, lr)
        fsdp.train_steps(net, stepper, x, y, 1)  # warm-up: the optimizer creates its state
        with record() as log:  # a recorder slows every operation down: the timed steps are not recorded
            fsdp.train_steps(net, stepper, x, y, 1)
        times = []
        for _ in range(steps):
            _sync(device)
            start = time.perf_counter()
            fsdp.train_steps(net, stepper, x, y, 1)
            _sync(device)
            times.append(time.perf_counter() - start)
        peak = fsdp.peak_bytes(functools.partial(fsdp.train_steps, net, stepper, x, y, 1), device)
        rows.append({"scheme": scheme, "n_params": n, "held": zero.held_bytes(module, opt),
                     "formula": zero.zero_memory(n, world, STAGE[scheme]), "peak": peak,
                     "moved": summarize(log, "numel"),
                     "step_s": statistics.median(times), "device": str(device)})
        del net, stepper, module, opt, model
    return rows


def compare(nprocs: int = 4, **kwargs) -> list[list[dict]]:
    """Launch :func:`scheme_rank` in ``nprocs`` ranks: NCCL with a GPU per rank, else gloo on the CPU."""
    from mgpu_lab import devices
    from mgpu_lab.launcher.launch import launch

    backend = None if devices.gpu_count() >= nprocs else "gloo"
    return launch(scheme_rank, nprocs, backend=backend, **kwargs)

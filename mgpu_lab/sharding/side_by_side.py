"""Lesson 08's measured result: DDP, ZeRO-1, ZeRO-2 and FSDP2 side by side in the same ranks.

:func:`scheme_rank` trains the same :class:`~mgpu_lab.sharding.fsdp.BlockNet` with Adam
under each scheme, in every rank, and measures what the lesson compares: the
bytes the rank holds (:func:`mgpu_lab.sharding.zero.held_bytes`), the peak bytes of a
step (:func:`mgpu_lab.sharding.fsdp.peak_bytes`: ``torch.cuda.max_memory_allocated`` on a
GPU), the elements its collectives move in a step (:func:`mgpu_lab.comm.record.record`;
DDP's all-reduce is made visible by registering PyTorch's own ``allreduce_hook``) and
the time per step, measured in steps that are not recorded.
:func:`compare` launches it; its ZeRO-1 row runs the optimizer it is given after DDP (the notebook
gives the learner's ``ShardedAdam``). The lesson's demos that run ZeRO by hand and FSDP2
show their results only (:func:`one_step_collectives`, :func:`zero_by_hand`, :func:`pitfalls`).

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

__all__ = ["SCHEMES", "scheme_rank", "compare", "one_step_collectives", "zero_by_hand", "pitfalls"]

SCHEMES = ("DDP", "ZeRO-1", "ZeRO-2", "FSDP2")
STAGE = {"DDP": 0, "ZeRO-1": 1, "ZeRO-2": 2, "FSDP2": 3}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _ddp(model, device: torch.device):
    """DDP whose all-reduce is recorded: PyTorch's own ``allreduce_hook`` does in Python what DDP does in C++."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    # .grad as views into DDP's buckets (else the buckets are a second copy of the gradients)
    net = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True)
    net.register_comm_hook(None, default_hooks.allreduce_hook)
    return net


def _build(scheme: str, model, device: torch.device, lr: float, zero1=None):
    """``(what to call, what steps, the module whose parameters count, the optimizer that holds state)``."""
    from mgpu_lab.sharding import flat, wrap  # here, not at the top: see the module's docstring

    adam = lambda params: torch.optim.Adam(params, lr=lr)  # noqa: E731
    if scheme == "DDP" or (scheme == "ZeRO-1" and zero1 is not None):
        net = _ddp(model, device)
        opt = adam(net.parameters()) if scheme == "DDP" else zero1(net.parameters(), lr=lr)
        return net, opt, model, opt
    if scheme in ("ZeRO-1", "ZeRO-2"):
        flat_zero = flat.FlatZero(model, STAGE[scheme], adam)
        return model, flat_zero, model, flat_zero.optimizer
    wrap.shard_model(model, fsdp.make_mesh(device))
    opt = adam(model.parameters())
    return model, opt, model, opt


def scheme_rank(width: int = 256, depth: int = 4, features: int = 64, classes: int = 10, batch: int = 32,
                steps: int = 3, lr: float = 1e-3, schemes=SCHEMES, zero1=None) -> list[dict]:
    """In every rank: train under each scheme: one warm-up step, one recorded step, ``steps`` timed ones.

    Args:
        zero1: a ZeRO-1 optimizer class used after DDP, called as ``zero1(params, lr=lr)`` (lesson 08's
            ``ShardedAdam``, the learner's): the ZeRO-1 row is then DDP + it. None: ZeRO-1 on the
            library's flat parameter (reduce-scatter, Adam on the shard, all-gather).

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
        net, stepper, module, opt = _build(scheme, model, device, lr, zero1)
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


# -- the lesson's demos in ranks: results, not the code of its exercises ------------------------
def one_step_collectives() -> dict:
    """In every rank: the collectives of one Adam step under DDP, ZeRO-2 by hand and FSDP2 (``record()`` events).

    DDP's all-reduce runs in C++; PyTorch's own ``allreduce_hook`` does the same in Python, where it is recorded.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from mgpu_lab.sharding import flat, wrap

    x, y = fsdp.batch(8, features=8)
    adam = lambda params: torch.optim.Adam(params, lr=1e-3)  # noqa: E731
    ddp = DDP(fsdp.BlockNet())
    ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    zero_model = fsdp.BlockNet()
    flat_zero = flat.FlatZero(zero_model, 2, adam)
    sharded = wrap.shard_model(fsdp.BlockNet(), fsdp.make_mesh())
    schemes = [("DDP", ddp, adam(ddp.parameters())), ("ZeRO-2", zero_model, flat_zero),
               ("FSDP2", sharded, adam(sharded.parameters()))]
    out = {}
    for name, net, opt in schemes:
        with record() as log:
            fsdp.train_steps(net, opt, x, y, 1)
        out[name] = log.events
    return out


def zero_by_hand(steps: int = 3) -> dict:
    """In every rank: ``steps`` Adam steps under DDP, ZeRO-1 and ZeRO-2 by hand; the weights and the bytes held."""
    from mgpu_lab.sharding import flat

    x, y = fsdp.batch(12, features=8)
    adam = lambda params: torch.optim.Adam(params, lr=1e-2)  # noqa: E731
    out = {}
    for scheme in ("DDP", "ZeRO-1", "ZeRO-2"):
        model = fsdp.BlockNet(width=10, depth=2)
        if scheme == "DDP":
            net = DDP(model, gradient_as_bucket_view=True)  # .grad are views into DDP's buckets: no second copy
            opt = step_with = adam(net.parameters())
        else:
            net, step_with = model, flat.FlatZero(model, STAGE[scheme], adam)
            opt = step_with.optimizer
        fsdp.train_steps(net, step_with, x, y, steps)
        out[scheme] = {"weights": fsdp.full_params(model), "held": zero.held_bytes(model, opt)["total"]}
    return out


def pitfalls() -> dict:
    """In every rank: an unpadded reduce-scatter (its error), and a parameter updated from strided shards.

    Returns:
        ``{"unpadded": the error's text, "block": max error of contiguous blocks, "strided": of strided shards}``.
    """
    import torch.distributed as tdist

    from mgpu_lab.core import compat

    compat.install()
    rank, world = tdist.get_rank(), tdist.get_world_size()
    param, grad = torch.linspace(-1, 1, 12), torch.arange(12.0) * (rank + 1)
    out = {"unpadded": ""}
    try:
        tdist.reduce_scatter_single(torch.empty(10 // world), grad[:10])
    except RuntimeError as err:
        out["unpadded"] = "RuntimeError: " + str(err)[str(err).find("Check failed"):].strip()
    mine = torch.empty(12 // world)
    tdist.reduce_scatter_single(mine, grad)
    s = 12 // world
    mean = torch.arange(12.0) * (world + 1) / 2
    for name, shard in (("block", param[rank * s:(rank + 1) * s]), ("strided", param[rank::world])):
        full = torch.empty(12)
        tdist.all_gather_single(full, (shard - mine / world).contiguous())
        out[name] = (full - (param - mean)).abs().max().item()
    return out

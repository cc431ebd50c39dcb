"""DDP's communication hooks and torch.compile, measured in real ranks, and how DDP scales.

- :func:`hooks_probe`: the same training with DDP's plain all-reduce, bfloat16
  compression and PowerSGD: losses, accuracy, bytes all-reduced per step;
- :func:`compile_probe`: a DDP model compiled two ways, with a backend that counts the
  graphs it is handed: for a model of the user's own class, ``torch.compile(DDP(model))``
  and ``model.compile()`` before wrapping both hand it one graph per bucket of TorchDynamo's
  DDPOptimizer, which computes its own buckets (a 1 MiB first one), so that each bucket's
  all-reduce can start in backward; for an ``nn.Sequential`` (torch's own ``forward``),
  compiling the DDP wrapper hands it none;
- :func:`throughput_probe`: samples per second of a DDP training step, for the
  scaling table (1, 2, 4 ranks against the ideal).

Example:
    >>> from mgpu_lab import launch
    >>> from mgpu_lab.comm import ddp_hooks
    >>> runs = launch(ddp_hooks.hooks_probe, 2)[0]
    launch: 2 ranks · ...
    >>> runs["bf16"]["bytes per step"] / runs["fp32"]["bytes per step"]
    0.5
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as tdist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

__all__ = ["hooks_probe", "OwnForward", "compile_probe", "throughput_probe", "single_process_throughput"]


def _data(n: int, features: int, classes: int, seed: int):
    from mgpu_lab.data.datasets import synthetic_classification

    ds = synthetic_classification(n, features=features, classes=classes, seed=seed, noise=2.5)
    return ds.tensors


def _model(features: int, width: int, classes: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(features, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, classes))


def hooks_probe(steps: int = 40, batch: int = 32, lr: float = 0.1, features: int = 32, width: int = 64,
                classes: int = 8, extra: dict | None = None) -> dict:
    """In a rank: one training run per communication hook, from the same weights on the same data.

    ``fp32`` is torch's ``allreduce_hook`` (what DDP does without a hook, but through
    ``dist.all_reduce``, so its bytes can be counted), ``bf16`` torch's ``bf16_compress_hook``,
    ``powerSGD`` a rank-1 PowerSGD (plain all-reduce for the first 2 steps, as
    PowerSGD must; error feedback on). ``extra`` adds hooks by name, each registered with
    a fresh dict as its state (lesson 09's error-feedback hook). Each rank trains on its
    own ``batch`` samples per step. Bytes are those handed to all-reduce in one step after the start.

    Returns:
        ``{name: {"losses": [...], "accuracy": float, "bytes per step": int,
        "seconds per step": float}}`` and ``"gradient bytes"``.
    """
    from mgpu_lab.comm.record import record

    rank, world = tdist.get_rank(), tdist.get_world_size()
    x, y = _data(steps * batch * world + 512, features, classes, seed=1)
    test_x, test_y = x[-512:], y[-512:]
    hooks = {
        "fp32": (None, default_hooks.allreduce_hook),
        "bf16": (None, default_hooks.bf16_compress_hook),
        "powerSGD": (powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2,
                                                 min_compression_rate=2), powerSGD_hook.powerSGD_hook),
        **{name: ({}, hook) for name, hook in (extra or {}).items()},
    }
    out = {}
    for name, hook in hooks.items():
        model = _model(features, width, classes)
        ddp = DDP(model)
        ddp.register_comm_hook(*hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=lr)
        losses, seconds, sent = [], [], 0
        for step in range(steps):
            lo = (step * world + rank) * batch
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = nn.functional.cross_entropy(ddp(x[lo:lo + batch]), y[lo:lo + batch])
            if step == 3:
                with record() as log:
                    loss.backward()
                sent = sum(e["bytes"] for e in log.events if e["op"] == "all_reduce")
            else:
                loss.backward()
            opt.step()
            seconds.append(time.perf_counter() - t0)
            avg = loss.detach().clone()
            tdist.all_reduce(avg)
            losses.append(avg.item() / world)
        with torch.no_grad():
            accuracy = (model(test_x).argmax(1) == test_y).float().mean().item()
        out[name] = {"losses": losses, "accuracy": accuracy, "bytes per step": sent,
                     "seconds per step": statistics.median(seconds[3:])}
    out["gradient bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    return out


def _counted(model, ddp_wrap, how: str, cap_mb: float, x) -> dict:
    """Compile ``model`` ``how`` with a backend that counts graphs; two steps; DDP's buckets and gradients."""
    graphs: list = []

    def counting_backend(gm, example_inputs):
        graphs.append(sum(1 for node in gm.graph.nodes if node.op in ("call_module", "call_function")))
        return gm.forward

    torch._dynamo.reset()
    if how == "compiled first":
        model.compile(backend=counting_backend)
    ddp = ddp_wrap(model, bucket_cap_mb=cap_mb)
    run = torch.compile(ddp, backend=counting_backend) if how == "wrapped first" else ddp
    buckets: list = []

    def hook(state, bucket):
        buckets.append(bucket.buffer().numel() * bucket.buffer().element_size() / 2**20)
        return default_hooks.allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, hook)
    try:
        for _ in range(2):  # DDP rebuilds its buckets after the first iteration: keep the second's
            buckets.clear()
            ddp.zero_grad()
            run(x).square().mean().backward()
    except Exception as exc:  # noqa: BLE001 - DDPOptimizer's AssertionError is what this shows
        return {"graphs": f"{type(exc).__name__}: {exc}", "buckets": None, "grads": None}
    return {"graphs": graphs, "buckets": [round(b, 3) for b in buckets],
            "grads": [p.grad.clone() for p in model.parameters()]}


class OwnForward(nn.Module):
    """A model of the user's own class around ``layers``: its ``forward`` is user code, not torch's."""

    def __init__(self, layers: nn.Module):
        super().__init__()
        self.layers = layers

    def forward(self, x):
        return self.layers(x)


def compile_probe(cap_mb: float, width: int = 512, depth: int = 4, model: str = "own class") -> dict:
    """In a rank: the graphs TorchDynamo hands a backend for a DDP model, compiled two ways.

    ``"wrapped first"``: ``torch.compile(DDP(model))``; ``"compiled first"``: ``model.compile()``, then
    ``DDP(model)``. For a model of the user's own class (``model="own class"``, :class:`OwnForward`) both
    give the same graphs: TorchDynamo does not trace DDP's own ``forward`` (torch's code) but catches the
    first frame below it that is not torch's, the user's ``forward``, and its DDPOptimizer cuts that graph
    into buckets it computes itself, by DDP's rule, with a first bucket of 1 MiB and the others of
    ``cap_mb`` (an AssertionError when ``cap_mb`` is below 1). For ``model="sequential"`` the model *is*
    torch's ``nn.Sequential``: wrapped first, the frame compiled is DDP's ``forward`` and everything it calls
    is torch's own code, which TorchDynamo does not trace from the top, so the backend gets no graph and the
    model runs uncompiled; compiled first, torch 2.14 traces ``Sequential.forward`` (torch 2.11 does not
    either way). The backend runs each graph as it is (no code generation). The layers are
    :func:`mgpu_lab.comm.ddp_buckets.mlp`'s.

    Returns:
        Per way ``{"graphs": operations per graph (or the error), "buckets": DDP's buckets
        in MiB}``, and ``"same gradients"``: both ways' gradients equal uncompiled DDP's.

    Raises:
        ValueError: ``model`` is neither ``"own class"`` nor ``"sequential"``.
    """
    import logging

    from mgpu_lab.comm.ddp_buckets import mlp

    kinds = {"own class": lambda: OwnForward(mlp(width, depth)), "sequential": lambda: mlp(width, depth)}
    if model not in kinds:
        raise ValueError(f"model={model!r}: pick 'own class' (a user's nn.Module) or 'sequential' (nn.Sequential)")
    torch._logging.set_logs(dynamo=logging.ERROR)  # not the warning that DDP's record_function is ignored
    x = torch.randn(8, width) + tdist.get_rank()
    eager = _counted(kinds[model](), DDP, "eager", cap_mb, x)
    out = {how: _counted(kinds[model](), DDP, how, cap_mb, x) for how in ("wrapped first", "compiled first")}
    same = all(run["grads"] is not None and all(torch.allclose(a, b, atol=1e-6)
                                                for a, b in zip(run["grads"], eager["grads"]))
               for run in out.values())
    for run in out.values():
        run.pop("grads")
    return {**out, "same gradients": same}


def throughput_probe(model_fn, batch: int = 64, steps: int = 8) -> dict:
    """In a rank: median seconds of a DDP training step (batch per rank) and samples/s of all ranks.

    Every rank computes with one thread, so one rank uses one CPU core whatever the
    world size (on a GPU, one GPU). ``cpu share`` is the CPU time the slowest-served
    rank got over the timed steps' wall time: near 1 when it had a core to itself.
    """
    from mgpu_lab import dist as mdist

    torch.set_num_threads(1)
    device = mdist.device()
    model = model_fn().to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x = torch.randn(batch, next(model.parameters()).shape[1], device=device)
    times, cpu = [], 0.0
    for i in range(steps + 2):
        tdist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        opt.zero_grad()
        ddp(x).square().mean().backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= 2:  # the first steps build the buckets and warm up
            times.append(time.perf_counter() - t0)
            cpu += time.process_time() - c0
    step = torch.tensor([statistics.median(times)])
    tdist.all_reduce(step, op=tdist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
    share = torch.tensor([cpu / sum(times)])
    tdist.all_reduce(share, op=tdist.ReduceOp.MIN)
    world = tdist.get_world_size()
    return {"seconds per step": step.item(), "samples per second": world * batch / step.item(),
            "cpu share": share.item(), "device": str(device)}


def single_process_throughput(model_fn, batch: int, device_ids: list[int], steps: int = 8) -> float:
    """Samples/s of the same training step in one process: one GPU, or ``nn.DataParallel`` over several.

    ``batch`` is the whole batch (DataParallel splits it over ``device_ids``). Needs CUDA.

    Raises:
        RuntimeError: no CUDA GPU, or fewer GPUs than ``device_ids`` names.
    """
    if not torch.cuda.is_available() or torch.cuda.device_count() <= max(device_ids):
        raise RuntimeError(f"single_process_throughput needs CUDA GPUs {device_ids}; "
                           f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} visible")
    device = torch.device("cuda", device_ids[0])
    model = model_fn().to(device)
    net = nn.DataParallel(model, device_ids=device_ids) if len(device_ids) > 1 else model
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    x = torch.randn(batch, next(model.parameters()).shape[1], device=device)
    times = []
    for i in range(steps + 2):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        opt.zero_grad()
        net(x).square().mean().backward()
        opt.step()
        torch.cuda.synchronize(device)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return batch / statistics.median(times)

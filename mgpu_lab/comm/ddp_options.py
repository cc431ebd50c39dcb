"""What DDP's options do, each shown in real ranks: unused parameters, no_sync,
gradient_as_bucket_view, static_graph, and SyncBatchNorm against per-rank statistics.

- :func:`options_probe`: the unused-parameter error and its two fixes, the all-reduce
  count with and without ``no_sync``, and where the gradients live with
  ``gradient_as_bucket_view``;
- :func:`batchnorm_probe`: per-rank BatchNorm statistics against the statistics of
  the whole global batch (the ones SyncBatchNorm normalises with), here from all-reduced
  sums and counts; on GPUs also the real ``nn.SyncBatchNorm``, which refuses CPU tensors.

Example:
    >>> from mgpu_lab import launch
    >>> from mgpu_lab.comm import ddp_options
    >>> facts = launch(ddp_options.options_probe, 2)[0]
    launch: 2 ranks · ...
    >>> facts["unused"]["default"][:40]
    'Expected to have finished reduction in t'
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as tdist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

__all__ = ["TwoHeads", "options_probe", "batchnorm_probe"]


class TwoHeads(nn.Module):
    """A trunk and two heads; ``forward`` uses head ``a`` only, so head ``b`` gets no gradient."""

    def __init__(self, width: int = 8):
        super().__init__()
        torch.manual_seed(0)
        self.trunk, self.a, self.b = nn.Linear(width, width), nn.Linear(width, 2), nn.Linear(width, 2)

    def forward(self, x):
        return self.a(torch.relu(self.trunk(x)))


def _first_sentence(text: str) -> str:
    return text.strip().split(". ")[0].split("\n")[0] + "."


def _train(ddp, steps: int = 3, width: int = 8) -> None:
    for _ in range(steps):
        ddp.zero_grad()
        ddp(torch.randn(4, width)).sum().backward()


def _unused() -> dict:
    out = {}
    try:
        _train(DDP(TwoHeads()))
        out["default"] = "no error"
    except RuntimeError as err:  # raised by the second forward, on every rank alike
        out["default"] = _first_sentence(str(err))
    for option in ("find_unused_parameters", "static_graph"):
        ddp = DDP(TwoHeads(), **{option: True})
        _train(ddp)
        out[option] = {"ok": True, "b.weight.grad": None if ddp.module.b.weight.grad is None else "set",
                       "a.weight.grad": None if ddp.module.a.weight.grad is None else "set"}
    return out


def _count_allreduces(ddp, counter: list) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    def hook(state, bucket):
        counter.append(bucket.index())
        return default_hooks.allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, hook)


def _no_sync(accumulate: int = 4) -> dict:
    out = {}
    for use_no_sync in (False, True):
        ddp, calls = DDP(nn.Linear(8, 2)), []
        _count_allreduces(ddp, calls)
        for i in range(accumulate):
            last = i == accumulate - 1
            with (ddp.no_sync() if use_no_sync and not last else contextlib.nullcontext()):
                ddp(torch.randn(4, 8)).sum().backward()
        out["no_sync" if use_no_sync else "plain"] = len(calls)
    return out


def _grad_views(bucket_cap_mb: float = 0.001) -> dict:
    out = {}
    for view in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))
        ddp = DDP(model, bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=view)
        _train(ddp, 2, 16)
        storages = {p.grad.untyped_storage().data_ptr() for p in model.parameters()}
        out[str(view)] = {"grad storages": len(storages), "parameters": len(list(model.parameters())),
                          "buckets": len(str(ddp._get_ddp_logging_data().get("rebuilt_bucket_sizes", "")).split(","))}
    out["grad bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    return out


def options_probe() -> dict:
    """In a rank: the facts of section "DDP's options" as plain data.

    Returns:
        ``{"unused": {...}, "no_sync": {...}, "views": {...}}``: the first sentence of the
        error DDP raises when a parameter gets no gradient, and what each fix leaves in
        ``.grad``; all-reduce calls over 4 micro-batches with and without ``no_sync``;
        distinct gradient storages with and without ``gradient_as_bucket_view``.
    """
    return {"unused": _unused(), "no_sync": _no_sync(), "views": _grad_views()}


def batchnorm_probe(channels: int = 3, batch: int = 64, shift: float = 2.0) -> dict:
    """In a rank: BatchNorm's batch mean on this rank's data against the global batch's.

    Rank ``r`` draws its batch around ``r * shift`` (data that differs per rank, as
    with a sampler that groups by source). A BatchNorm in training mode normalises
    with the statistics of its own input; SyncBatchNorm with those of the global
    batch (it all-gathers every rank's mean, inverse std and count); here they are
    computed from every rank's sum, sum of squares and count, all-reduced.

    Returns:
        ``local_mean``/``local_var`` (this rank), ``synced_mean``/``synced_var`` (from
        the all-reduced sums), ``global_mean``/``global_var`` (one process holding the
        whole global batch), ``sync_bn``: the running mean a real ``nn.SyncBatchNorm``
        keeps, or the error it raises for CPU tensors.
    """
    from mgpu_lab import dist as mdist

    rank, world = tdist.get_rank(), tdist.get_world_size()
    torch.manual_seed(rank)
    x = torch.randn(batch, channels) + rank * shift
    mean, var = x.mean(0), x.var(0, unbiased=False)
    stats = torch.cat([x.sum(0), x.square().sum(0), torch.tensor([float(batch)])])
    tdist.all_reduce(stats)  # the global statistics, from sums, sums of squares and counts
    total = stats[-1]
    synced_mean = stats[:channels] / total
    synced_var = stats[channels:2 * channels] / total - synced_mean.square()
    everyone = [torch.empty_like(x) for _ in range(world)]
    tdist.all_gather(everyone, x)
    whole = torch.cat(everyone)
    out = {"local_mean": mean.tolist(), "local_var": var.tolist(), "synced_mean": synced_mean.tolist(),
           "synced_var": synced_var.tolist(), "global_mean": whole.mean(0).tolist(),
           "global_var": whole.var(0, unbiased=False).tolist()}
    device = mdist.device() if tdist.get_backend() == "nccl" else torch.device("cpu")
    bn = nn.SyncBatchNorm(channels, momentum=1.0).to(device)  # momentum 1: running stats = this batch's
    try:
        bn(x.to(device))
        out["sync_bn"] = bn.running_mean.tolist()
    except ValueError as err:
        out["sync_bn"] = f"{type(err).__name__}: {err}"
    return out

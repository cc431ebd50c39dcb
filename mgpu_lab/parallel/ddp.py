"""DistributedDataParallel training, as lesson 04 teaches it, for later lessons to reuse.

The pieces work in a rank started by :func:`mgpu_lab.launch` and under
``torchrun`` alike (and in a single process without a process group):

- :func:`wrap` and :func:`distributed_loader`: DDP with ``device_ids`` on GPUs, a
  ``DistributedSampler`` with a per-rank batch size;
- :func:`fit` and :func:`train`: the training loop with ``set_epoch``,
  gradient accumulation under ``no_sync`` and mixed precision (autocast in
  :func:`autocast_dtype`; a GradScaler with float16), counting the gradient all-reduces;
- :func:`reference_train`, :func:`max_diff`, :func:`cpu_state` (from
  :mod:`mgpu_lab.parallel.baseline`): the same training in one process with the
  global batch, the result DDP must reproduce;
- :func:`evaluate` and :func:`mean_over_ranks`: exact distributed evaluation;
- :func:`save_checkpoint` and :func:`load_checkpoint` (from
  :mod:`mgpu_lab.parallel.checkpoint`): rank 0 writes, every rank resumes with
  ``map_location`` and ``weights_only=True``.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from mgpu_lab import launch
    >>> from mgpu_lab.data import datasets
    >>> from mgpu_lab.parallel import ddp
    >>> ds = datasets.synthetic_classification(64)
    >>> def model_fn():              # the same initial weights in every process
    ...     torch.manual_seed(0)
    ...     return nn.Linear(8, 3)
    >>> states = launch(ddp.train, 2, model_fn, ds, 2, 8, 0.1)   # batch 8 per rank
    launch: 2 ranks · ...
    >>> ref = ddp.reference_train(model_fn, ds, 2, 16, 0.1)      # global batch 16
    >>> ddp.max_diff(states[0], ref) < 1e-5
    True
"""
from __future__ import annotations

import contextlib
import sys
import time

import torch
import torch.distributed as tdist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from mgpu_lab import dist as mdist
from mgpu_lab.parallel.baseline import cpu_state, max_diff, reference_train, shard_sums
from mgpu_lab.parallel.checkpoint import load_checkpoint, save_checkpoint

__all__ = ["wrap", "distributed_loader", "fit", "train", "reference_train", "max_diff", "evaluate",
           "mean_over_ranks", "save_checkpoint", "load_checkpoint", "cpu_state", "autocast_dtype"]


def _initialised() -> bool:
    return tdist.is_available() and tdist.is_initialized()


def wrap(model: nn.Module, device: torch.device | None = None) -> nn.Module:
    """Move ``model`` to this rank's device and wrap it in DDP (``device_ids`` on a GPU).

    DDP broadcasts rank 0's parameters at construction, so every rank starts
    identical. Without a process group the model is returned unwrapped.

    Example:
        >>> model = wrap(nn.Linear(8, 3))   # in a rank: DistributedDataParallel on cpu or cuda:LOCAL_RANK
    """
    device = device or mdist.device()
    model = model.to(device)
    if not _initialised():
        return model
    if device.type == "cuda":
        return DDP(model, device_ids=[device.index], output_device=device.index)
    return DDP(model)  # CPU modules: device_ids must be None


def distributed_loader(dataset, batch_size: int, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                num_replicas: int | None = None, rank: int | None = None, **loader_kwargs):
    """A DataLoader over this rank's shard: ``(loader, sampler)``.

    ``batch_size`` is per rank; the global batch is ``batch_size * world_size``.
    The sampler does the shuffling, so ``shuffle`` goes to the sampler, never to
    the DataLoader (passing both is a ValueError). Call ``sampler.set_epoch(epoch)``
    every epoch.

    Example:
        >>> from mgpu_lab.data import datasets
        >>> loader, sampler = distributed_loader(datasets.synthetic_classification(64), batch_size=8)
        >>> len(loader), len(sampler)     # one process: the whole set, 8 batches of 8
        (8, 64)
    """
    if "sampler" in loader_kwargs or loader_kwargs.get("shuffle"):
        raise ValueError("distributed_loader builds the DistributedSampler itself: pass shuffle=, seed=, "
                         "drop_last= to distributed_loader, not sampler= or a DataLoader shuffle=True")
    sampler = DistributedSampler(dataset, num_replicas=mdist.world_size() if num_replicas is None else num_replicas,
                                 rank=mdist.rank() if rank is None else rank, shuffle=shuffle, seed=seed,
                                 drop_last=drop_last)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, **loader_kwargs), sampler


def _log(message: str) -> None:
    """Rank 0 prints, in one write: lines of ranks sharing a pipe (torchrun) never interleave."""
    if mdist.is_main_process():
        sys.stdout.write(message + "\n")
        sys.stdout.flush()


def _count_allreduces(model: DDP, stats: dict) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    def hook(state, bucket):
        stats["allreduces"] += 1
        return default_hooks.allreduce_hook(None, bucket)

    model.register_comm_hook(None, hook)


def autocast_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 where the hardware has it (CPUs; GPUs of compute capability 8.0+), else float16 (V100, T4).

    bfloat16 has float32's range and needs no GradScaler; float16 does. ``autocast_dtype(cpu)`` is bfloat16.
    """
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0):
        return torch.float16
    return torch.bfloat16


def fit(model: nn.Module, loader, optimizer, epochs: int, *, loss_fn=None, accumulate: int = 1,
        no_sync: bool = True, set_epoch: bool = True, amp: bool = False, start_epoch: int = 0,
        log_every: int | None = None, on_epoch_end=None) -> dict:
    """Train ``model`` (DDP-wrapped or not) for ``epochs - start_epoch`` epochs; return stats.

    Args:
        model: the model, on its device.
        loader: batches of ``(inputs, labels)``; its sampler gets ``set_epoch``.
        optimizer: steps once per ``accumulate`` batches.
        epochs: train until this epoch (exclusive).
        loss_fn: default ``nn.CrossEntropyLoss()`` (mean over the batch).
        accumulate: batches per optimizer step; the first ``accumulate - 1`` run under
            ``model.no_sync()`` so DDP all-reduces gradients once per step.
        set_epoch: ``False`` reproduces the bug of the same order every epoch.
        amp: autocast in :func:`autocast_dtype` (float16 with a GradScaler on older GPUs).
        start_epoch: the epoch to resume from.
        log_every: rank 0 prints the loss every this many optimizer steps (0: at
            epoch ends only; None: silent).
        on_epoch_end: ``f(epoch)`` called by every rank after each epoch (e.g. checkpoints).

    Returns:
        ``{"losses": [...], "steps": n, "allreduces": n or None, "seconds": s}``
        (``allreduces`` counts DDP's gradient all-reduce calls, one per bucket).

    Raises:
        ValueError: ``accumulate`` below 1.
    """
    if accumulate < 1:
        raise ValueError(f"accumulate={accumulate} must be >= 1 (batches per optimizer step)")
    loss_fn = loss_fn or nn.CrossEntropyLoss()
    device = next(model.parameters()).device
    is_ddp = isinstance(model, DDP)
    stats = {"losses": [], "steps": 0, "allreduces": 0 if is_ddp else None, "seconds": 0.0}
    if is_ddp:
        _count_allreduces(model, stats)
    amp_dtype = autocast_dtype(device)
    scaler = torch.amp.GradScaler("cuda", enabled=amp and amp_dtype == torch.float16)  # float16 only
    sampler = getattr(loader, "sampler", None)
    start = time.perf_counter()
    for epoch in range(start_epoch, epochs):
        if set_epoch and hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)  # without it every epoch has epoch 0's order
        model.train()
        n_batches = len(loader)
        for i, (x, y) in enumerate(loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            step_now = (i + 1) % accumulate == 0 or i + 1 == n_batches
            skip = is_ddp and no_sync and not step_now
            sync = model.no_sync() if skip else contextlib.nullcontext()
            with sync:
                with torch.autocast(device.type, dtype=amp_dtype, enabled=amp):
                    loss = loss_fn(model(x), y)
                scaler.scale(loss / accumulate).backward()
            if step_now:
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                stats["steps"] += 1
                if log_every and stats["steps"] % log_every == 0:
                    _log(f"epoch {epoch} step {stats['steps']}: loss {loss.item():.4f}")
            stats["losses"].append(loss.item())
        if log_every is not None and stats["losses"]:
            _log(f"epoch {epoch}: last loss {stats['losses'][-1]:.4f}")
        if on_epoch_end is not None:
            on_epoch_end(epoch)
    stats["seconds"] = time.perf_counter() - start
    return stats


def train(model_fn, dataset, epochs: int, batch_size: int, lr: float, *, seed: int = 0,
          **fit_kwargs) -> dict[str, torch.Tensor]:
    """Train ``model_fn()`` with DDP on this rank's shard; return the final state_dict (on the CPU).

    ``batch_size`` is per rank (global batch ``batch_size * world_size``), the
    optimizer is plain SGD with ``lr`` as given, the loss mean cross-entropy,
    and the sampler ``DistributedSampler(shuffle=True, seed=seed)`` with
    ``set_epoch`` every epoch.

    Example:
        >>> from mgpu_lab import launch
        >>> from mgpu_lab.data import datasets
        >>> def model_fn():
        ...     torch.manual_seed(0)                 # the same initial weights on every rank
        ...     return nn.Linear(8, 3)
        >>> states = launch(train, 2, model_fn, datasets.synthetic_classification(64), 2, 8, 0.1)
        launch: 2 ranks · ...
        >>> sorted(states[0]), torch.equal(states[0]["weight"], states[1]["weight"])   # replicas stay equal
        (['bias', 'weight'], True)
    """
    model = wrap(model_fn())
    loader, _ = distributed_loader(dataset, batch_size, shuffle=True, seed=seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    fit(model, loader, optimizer, epochs, **fit_kwargs)
    return cpu_state(model)


def _comm_device() -> torch.device:
    nccl = _initialised() and tdist.get_backend() == "nccl"
    return mdist.device() if nccl else torch.device("cpu")


def mean_over_ranks(local_sum: float, local_count: int) -> float:
    """The mean over every rank's samples: all_reduce the sums and the counts, then divide.

    Example:
        >>> from mgpu_lab import launch
        >>> def mean_of_two_ranks():   # rank 0 has 3 samples summing to 6, rank 1 one sample of 10
        ...     return mean_over_ranks(*[(6.0, 3), (10.0, 1)][torch.distributed.get_rank()])
        >>> launch(mean_of_two_ranks, 2)     # (6 + 10) / 4 on every rank
        launch: 2 ranks · ...
        [4.0, 4.0]
    """
    if not _initialised():
        return float(local_sum) / local_count
    t = torch.tensor([float(local_sum), float(local_count)], dtype=torch.float64, device=_comm_device())
    tdist.all_reduce(t)  # SUM: every rank now holds the totals
    return (t[0] / t[1]).item()


@torch.no_grad()
def evaluate(model: nn.Module, dataset, batch_size: int = 256, how: str = "exact") -> dict:
    """Accuracy and mean cross-entropy of ``model`` on ``dataset``, split over the ranks.

    Args:
        how: ``"exact"``: rank r takes samples r, r+N, ... (no padding; counts may
            differ) and the sums and counts are all-reduced: the single-process
            numbers. ``"padded"``: a ``DistributedSampler``, whose padding
            duplicates count twice, each rank's mean weighing the same.
            ``"drop_last"``: a sampler that drops the tail. The last two are the
            usual mistakes.

    Returns:
        ``{"accuracy", "loss", "counted": samples evaluated over all ranks, "local": this rank's}``.

    Raises:
        ValueError: unknown ``how``.

    Example:
        >>> from mgpu_lab import launch
        >>> from mgpu_lab.data import datasets
        >>> def accuracy(val_set):   # every rank scores its share; all get the whole set's figure
        ...     torch.manual_seed(0)
        ...     return evaluate(nn.Linear(8, 3), val_set)["accuracy"]
        >>> a, b = launch(accuracy, 2, datasets.synthetic_classification(50))
        launch: 2 ranks · ...
        >>> a == b == accuracy(datasets.synthetic_classification(50))   # = one process over all 50
        True
    """
    sums = shard_sums(model, dataset, how=how, batch_size=batch_size)
    n, world = sums["count"], mdist.world_size()
    if how == "exact":  # totals over every rank, then one division
        result = {"accuracy": mean_over_ranks(sums["correct"], n), "loss": mean_over_ranks(sums["loss"], n)}
    else:  # the mistake: average the ranks' averages
        result = {"accuracy": mean_over_ranks(sums["correct"] / max(n, 1), 1),
                  "loss": mean_over_ranks(sums["loss"] / max(n, 1), 1)}
    return {**result, "counted": round(mean_over_ranks(n, 1) * world), "local": n}

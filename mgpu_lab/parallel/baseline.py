"""What a DDP run is measured against: one process with the global batch, and each rank's share of an evaluation.

DDP training (:mod:`mgpu_lab.parallel.ddp`, which ``scripts/`` run) builds on what is here.

- :func:`reference_train`: one process, plain SGD, the global batch: the weights
  DDP must end with;
- :func:`max_diff` and :func:`cpu_state`: compare two state_dicts, copy one off
  its device (the module inside DDP, without the ``module.`` prefix);
- :func:`shard_sums`: the sums and the count of this rank's share of an
  evaluation, for the three ways of splitting it (``exact``, ``padded``, ``drop_last``),
  to be combined over the ranks.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from mgpu_lab.data import datasets
    >>> def model_fn():
    ...     torch.manual_seed(0)
    ...     return nn.Linear(8, 3)
    >>> ds = datasets.synthetic_classification(64)
    >>> a, b = reference_train(model_fn, ds, 2, 16, 0.1), reference_train(model_fn, ds, 2, 16, 0.1)
    >>> max_diff(a, b)                     # one process is deterministic
    0.0
    >>> shard_sums(model_fn(), ds, how="exact")["count"]   # no process group: one rank, every sample
    64
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset

from mgpu_lab import dist as mdist

__all__ = ["reference_train", "max_diff", "cpu_state", "shard_sums"]


def cpu_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """A detached CPU copy of the state_dict (of the module inside DDP: no ``module.`` prefix).

    Example:
        >>> sorted(cpu_state(nn.Linear(2, 1)))
        ['bias', 'weight']
    """
    inner = model.module if isinstance(model, DDP) else model
    return {k: v.detach().cpu().clone() for k, v in inner.state_dict().items()}


def reference_train(model_fn, dataset, epochs: int, batch_size: int, lr: float, *, seed: int = 0,
                    set_epoch: bool = True) -> dict[str, torch.Tensor]:
    """Train ``model_fn()`` in this one process with ``batch_size`` the global batch; return its weights.

    The order is a ``DistributedSampler`` of one replica (``shuffle=True``, ``seed``,
    ``set_epoch`` every epoch unless ``set_epoch=False``, the bug), the optimizer
    plain SGD with ``lr``, the loss mean cross-entropy, one step per batch. With N
    ranks each taking every N-th index of the same order, the union of the ranks'
    k-th batches of ``B/N`` samples is exactly the k-th batch of ``B`` here (when N
    divides the data set), so DDP must end with these weights.

    Example:
        >>> from mgpu_lab.data import datasets
        >>> ref = reference_train(lambda: nn.Linear(8, 3), datasets.synthetic_classification(64), 2, 16, 0.1)
        >>> sorted(ref), ref["weight"].shape
        (['bias', 'weight'], torch.Size([3, 8]))
    """
    device = mdist.device()
    model = model_fn().to(device)
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    loss_fn = nn.CrossEntropyLoss()
    for epoch in range(epochs):
        if set_epoch:
            sampler.set_epoch(epoch)
        for x, y in DataLoader(dataset, batch_size=batch_size, sampler=sampler):
            loss = loss_fn(model(x.to(device)), y.to(device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    return cpu_state(model)


def max_diff(a: dict, b: dict) -> float:
    """Largest absolute difference between two state_dicts with the same keys.

    Raises:
        ValueError: the keys differ (named in the message).

    Example:
        >>> max_diff({"w": torch.ones(2)}, {"w": torch.zeros(2)})
        1.0
    """
    if set(a) != set(b):
        raise ValueError(f"state_dicts differ in keys: only in the first {sorted(set(a) - set(b))}, "
                         f"only in the second {sorted(set(b) - set(a))}; unwrap DDP with model.module")
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a) if a else 0.0


@torch.no_grad()
def shard_sums(model: nn.Module, dataset, how: str = "exact", batch_size: int = 256) -> dict:
    """Correct predictions, summed cross-entropy and samples of this rank's share of ``dataset``.

    Args:
        how: ``"exact"``: rank r takes samples r, r+N, ... (no padding; counts may
            differ by one). ``"padded"``: a ``DistributedSampler``, whose padding
            duplicates count twice. ``"drop_last"``: a sampler that drops the tail.

    Returns:
        ``{"correct", "loss", "count"}`` of this rank (its share only: nothing is reduced).

    Raises:
        ValueError: unknown ``how``.
    """
    if how not in ("exact", "padded", "drop_last"):
        raise ValueError(f"how={how!r}: use 'exact', 'padded' or 'drop_last'")
    world, rank = mdist.world_size(), mdist.rank()
    if how == "exact":
        part = Subset(dataset, range(rank, len(dataset), world))
    else:
        sampler = DistributedSampler(dataset, world, rank, shuffle=False, drop_last=how == "drop_last")
        part = Subset(dataset, list(sampler))
    model.eval()
    device = next(model.parameters()).device
    correct = loss = 0.0
    for x, y in DataLoader(part, batch_size=batch_size):
        out, y = model(x.to(device)), y.to(device)
        correct += (out.argmax(1) == y).sum().item()
        loss += nn.functional.cross_entropy(out, y, reduction="sum").item()
    return {"correct": correct, "loss": loss, "count": len(part)}

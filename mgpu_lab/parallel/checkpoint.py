"""Checkpoints in a DDP job: rank 0 writes, every rank resumes on its own device.

Example:
    >>> import tempfile
    >>> from mgpu_lab import launch
    >>> def resume(path):                                     # every rank runs it
    ...     save_checkpoint(path, nn.Linear(2, 1), epoch=3)   # rank 0 writes, every rank waits for it
    ...     state = load_checkpoint(path, nn.Linear(2, 1))    # map_location: this rank's device
    ...     return state["epoch"] + 1
    >>> launch(resume, 2, f"{tempfile.mkdtemp()}/last.pt")
    launch: 2 ranks · ...
    [4, 4]
"""
from __future__ import annotations

import os

import torch
import torch.distributed as tdist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from mgpu_lab import dist as mdist

__all__ = ["save_checkpoint", "load_checkpoint"]


def save_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer=None, epoch: int = 0, **extra) -> None:
    """Rank 0 writes ``{"model", "optimizer", "epoch", ...}`` to ``path``; every rank waits for it.

    The file is written under a temporary name and renamed, so a crash never
    leaves half a checkpoint; the barrier keeps other ranks from reading early.

    Example:
        >>> import tempfile
        >>> path = f"{tempfile.mkdtemp()}/last.pt"
        >>> save_checkpoint(path, nn.Linear(2, 1), torch.optim.SGD(nn.Linear(2, 1).parameters(), 0.1), epoch=3)
        >>> sorted(torch.load(path, weights_only=True))
        ['epoch', 'model', 'optimizer']
    """
    if mdist.is_main_process():
        inner = model.module if isinstance(model, DDP) else model
        state = {"model": inner.state_dict(), "epoch": epoch, **extra}
        if optimizer is not None:
            state["optimizer"] = optimizer.state_dict()
        os.makedirs(os.path.dirname(os.fspath(path)) or ".", exist_ok=True)
        tmp = f"{os.fspath(path)}.tmp"
        torch.save(state, tmp)
        os.replace(tmp, path)
    if tdist.is_available() and tdist.is_initialized():
        tdist.barrier()


def load_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer=None, device=None) -> dict:
    """Load a :func:`save_checkpoint` file into ``model`` (and ``optimizer``) on this rank.

    ``map_location`` puts the tensors on this rank's device (a checkpoint written
    from ``cuda:0`` would otherwise land on ``cuda:0`` on every rank), and
    ``weights_only=True``, torch's default since 2.6 (written out: before 2.6 it
    was False), unpickles only tensors, primitive types and
    plain containers, never arbitrary objects.

    Returns:
        The whole checkpoint dict (``epoch`` and extras).

    Raises:
        FileNotFoundError: no file at ``path`` (named in the message).
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no checkpoint at {os.fspath(path)!r}; train with save_checkpoint first")
    state = torch.load(path, map_location=device or mdist.device(), weights_only=True)
    (model.module if isinstance(model, DDP) else model).load_state_dict(state["model"])
    if optimizer is not None and "optimizer" in state:
        optimizer.load_state_dict(state["optimizer"])
    return state

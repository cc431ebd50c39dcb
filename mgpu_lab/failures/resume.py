"""Training that survives a crash: atomic snapshot files and exact resume of DDP training.

What ``scripts/resumable_train.py`` trains with; the course's checks compare runs with it.

A process can die at any instruction (SIGKILL, the out-of-memory killer, a
node that loses power), so a snapshot written in place can be left half
written, and the job that restarts from it fails on ``torch.load``.
:func:`save_atomically` writes to a temporary file in the same directory and
renames it over the old one: ``os.replace`` is atomic within one file system,
so the path always holds the old snapshot or the new one.

:func:`train` is DDP training (lesson 04's) that snapshots every
``snapshot_every`` steps (model, optimizer, step, every rank's RNG state) and,
started again, resumes from the last snapshot so exactly that the final
weights equal those of a run that was never interrupted. Run it under
``torchrun --max-restarts=N`` (``scripts/resumable_train.py``) and a killed
rank costs at most ``snapshot_every`` steps of work.

Example:
    >>> import tempfile
    >>> path = f"{tempfile.mkdtemp()}/snap.pt"
    >>> save_atomically({"step": 3}, path)
    >>> load_snapshot(path)["step"]
    3
"""
from __future__ import annotations

import contextlib
import os
import tempfile

import torch
import torch.distributed as tdist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from mgpu_lab import dist as mdist
from .snapshot import MOMENTUM, load_snapshot, rng_state, set_rng_state

__all__ = ["save_atomically", "train"]


def save_atomically(obj, path: str | os.PathLike) -> None:
    """``torch.save(obj, path)`` such that a crash at any moment leaves the old file or the new one.

    The object goes to a temporary file in ``path``'s directory (same file
    system, so the rename below cannot fail with "cross-device link"), is
    flushed and ``fsync``-ed, then ``os.replace`` swaps it in atomically. The
    directory is ``fsync``-ed too, so the rename itself survives a power loss.
    If ``torch.save`` raises, the temporary file is removed and ``path`` is
    untouched.

    Args:
        obj: anything ``torch.save`` accepts.
        path: the file to (re)place.

    Raises:
        Whatever ``torch.save`` raises (e.g. a pickling error); ``path`` keeps its old content.

    Example:
        >>> import tempfile
        >>> path = f"{tempfile.mkdtemp()}/last.pt"
        >>> save_atomically({"weight": torch.ones(2), "step": 100}, path)
        >>> sorted(torch.load(path, weights_only=True)), sorted(os.listdir(os.path.dirname(path)))
        (['step', 'weight'], ['last.pt'])
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=os.path.basename(path) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _gather_rng() -> list:
    if not (tdist.is_available() and tdist.is_initialized()):
        return [rng_state()]
    states = [None] * tdist.get_world_size()
    tdist.all_gather_object(states, rng_state())
    return states


def train(model_fn, dataset, epochs: int, batch_size: int, lr: float, snapshot_path: str,
          snapshot_every: int) -> dict[str, torch.Tensor]:
    """DDP training that snapshots every ``snapshot_every`` steps and resumes from the snapshot exactly.

    Runs in every rank (process group initialised). The training is lesson
    04's: ``DistributedSampler(dataset)`` with ``set_epoch``, ``batch_size`` per
    rank, ``SGD(lr, momentum=0.9)``, mean cross-entropy. Every
    ``snapshot_every`` optimizer steps rank 0 writes, atomically, the model,
    the optimizer, the step count and every rank's RNG state. Started again
    (e.g. by ``torchrun --max-restarts``), it loads the snapshot, skips the
    batches of the current epoch that were already trained on, restores the
    RNG *after* ``iter(loader)`` (which draws a seed from it), and goes on.
    Restarted with another world size (elastic membership), it keeps the
    weights and optimizer and redoes the snapshot's epoch from its start:
    the shards differ, so the resume is no longer bit-exact.

    Args:
        model_fn: builds the model (the same initial weights on every rank).
        dataset: the training set. epochs, batch_size, lr: as in lesson 04.
        snapshot_path: the snapshot file (rank 0 writes it; every rank reads it).
        snapshot_every: optimizer steps between snapshots (>= 1).

    Returns:
        The model's ``state_dict()`` after training.

    Raises:
        ValueError: ``snapshot_every`` < 1.

    Example:
        >>> from mgpu_lab import launch
        >>> from mgpu_lab.data import datasets
        >>> def model_fn():
        ...     torch.manual_seed(0)                 # the same initial weights on every rank
        ...     return torch.nn.Linear(8, 3)
        >>> path = os.path.join(tempfile.mkdtemp(), "snap.pt")
        >>> states = launch(train, 2, model_fn, datasets.synthetic_classification(32), 2, 4, 0.1, path, 4)
        launch: 2 ranks · ...
        >>> os.path.exists(path), torch.equal(states[0]["weight"], states[1]["weight"])
        (True, True)
    """
    if snapshot_every < 1:
        raise ValueError(f"snapshot_every={snapshot_every} must be >= 1 (optimizer steps between snapshots)")
    device = mdist.device()
    model = model_fn().to(device)
    ddp_model = DDP(model, device_ids=[device.index]) if device.type == "cuda" else DDP(model)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr, momentum=MOMENTUM)
    sampler = DistributedSampler(dataset)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    loss_fn = nn.CrossEntropyLoss()
    per_epoch, step, rng = len(loader), 0, None
    snap = load_snapshot(snapshot_path)
    if snap is not None:
        model.load_state_dict(snap["model"])
        optimizer.load_state_dict(snap["optimizer"])
        if len(snap["rng"]) == tdist.get_world_size():
            step, rng = snap["step"], snap["rng"][tdist.get_rank()]
        else:  # elastic: another world size shards the data differently; redo the snapshot's epoch
            step = snap["step"] // snap["per_epoch"] * per_epoch
    for epoch in range(step // per_epoch, epochs):
        sampler.set_epoch(epoch)
        batches = iter(loader)  # draws a seed from torch's RNG: restore the RNG after this, not before
        for _ in range(step - epoch * per_epoch):
            next(batches)  # trained on before the snapshot
        if rng is not None:
            set_rng_state(rng)
            rng = None
        for x, y in batches:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss_fn(ddp_model(x), y).backward()
            optimizer.step()
            step += 1
            if step % snapshot_every == 0:
                rngs = _gather_rng()  # a collective: every rank takes part
                if mdist.is_main_process():
                    save_atomically({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                     "step": step, "per_epoch": per_epoch, "rng": rngs}, snapshot_path)
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}

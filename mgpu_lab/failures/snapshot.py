"""Training state that a resume needs: every rank's RNG state, and a snapshot read back onto the CPU.

A snapshot that lets DDP training resume exactly holds the model, the optimizer,
the step and every rank's random state (:func:`rng_state`, restored with
:func:`set_rng_state`); :func:`load_snapshot` reads one with every tensor on the
CPU.

Example:
    >>> import tempfile
    >>> path = f"{tempfile.mkdtemp()}/snap.pt"
    >>> torch.save({"step": 3, "rng": [rng_state("cpu")]}, path)
    >>> sorted(load_snapshot(path))
    ['rng', 'step']
"""
from __future__ import annotations

import os

import torch

from mgpu_lab import dist as mdist

__all__ = ["rng_state", "set_rng_state", "load_snapshot", "MOMENTUM"]

MOMENTUM = 0.9  # SGD's momentum buffers are optimizer state that a resume must restore


def rng_state(device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """This rank's random state: torch's CPU generator and, on a GPU, that GPU's (dropout there draws from it).

    Args:
        device: the rank's device (default :func:`mgpu_lab.dist.device`).
    """
    device = torch.device(device) if device is not None else mdist.device()
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, torch.Tensor], device: torch.device | None = None) -> None:
    """Restore :func:`rng_state`'s result (tensors loaded onto a GPU are brought back to the CPU first)."""
    device = torch.device(device) if device is not None else mdist.device()
    torch.set_rng_state(state["cpu"].cpu())
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


def load_snapshot(path: str | os.PathLike) -> dict | None:
    """The snapshot at ``path`` with every tensor on the CPU, or None when there is none.

    ``map_location="cpu"``: a snapshot written by rank 0 on ``cuda:0`` would
    otherwise be loaded onto ``cuda:0`` by every rank; ``load_state_dict``
    then copies the values to wherever the model lives.
    """
    if not os.path.exists(path):
        return None
    return torch.load(path, map_location="cpu", weights_only=True)

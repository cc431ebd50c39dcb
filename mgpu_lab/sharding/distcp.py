"""Distributed checkpoints of a sharded model: every rank writes its own shards, any world size reads them.

``torch.distributed.checkpoint`` (DCP) saves a state dict of DTensors as one
file per rank (``__<rank>_0.distcp``) plus a ``.metadata`` file that says which
slice of which tensor sits where; loading reads the slices each rank needs for
*its* sharding, so a checkpoint written by 4 ranks loads into 2 (resharding).
``get_state_dict`` / ``set_state_dict`` turn a model and its optimizer into such
a state dict and back (the optimizer's state keyed by parameter name).

Example:
    >>> import tempfile
    >>> from mgpu_lab import launch
    >>> from mgpu_lab.sharding.fsdp import BlockNet, make_mesh
    >>> from mgpu_lab.sharding.wrap import shard_model
    >>> def save_then_load(path):                      # in every rank
    ...     model = shard_model(BlockNet(), make_mesh())
    ...     optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ...     save_checkpoint(model, optimizer, path)
    ...     load_checkpoint(model, optimizer, path)    # any world size reads it; here the same
    >>> path = f"{tempfile.mkdtemp()}/step-100"
    >>> _ = launch(save_then_load, 2, path)
    launch: 2 ranks · ...
    >>> sorted(layout(path)["files"])                  # a file per rank, and where each slice went
    ['.metadata', '__0_0.distcp', '__1_0.distcp']
"""
from __future__ import annotations

import os

import torch
from torch import nn

__all__ = ["save_checkpoint", "load_checkpoint", "layout", "export_consolidated", "full_state"]


def save_checkpoint(model: nn.Module, optimizer, path: str) -> None:
    """Save ``model`` and ``optimizer`` to the directory ``path``, each rank its own shards.

    A collective: every rank calls it. Rank 0 also writes ``.metadata``.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)  # DTensors: each rank's shards
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)


def load_checkpoint(model: nn.Module, optimizer, path: str) -> None:
    """Load a :func:`save_checkpoint` directory into ``model`` and ``optimizer``, resharding as needed.

    A collective: every rank calls it. The state dict to load into comes from
    ``get_state_dict`` (which also creates the optimizer's state if it has not
    stepped yet); DCP reads into its tensors in place; ``set_state_dict`` puts it back.

    Raises:
        FileNotFoundError: ``path`` has no ``.metadata`` (not a DCP checkpoint).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise FileNotFoundError(f"{path!r} holds no DCP checkpoint (no .metadata file); "
                                "write one with save_checkpoint(model, optimizer, path) in every rank")
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def layout(path: str) -> dict:
    """What a DCP directory holds, as plain data.

    Returns:
        ``{"files": {name: bytes}, "tensors": {key: {"shape": [...], "chunks": n,
        "sizes": [[...], ...], "files": [names]}}}``: ``chunks`` is how many slices
        of the tensor were written (one per rank), ``sizes`` their shapes,
        ``files`` where they went.
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    files = {name: os.path.getsize(os.path.join(path, name)) for name in sorted(os.listdir(path))}
    meta = FileSystemReader(path).read_metadata()
    where: dict = {}
    for index, info in meta.storage_data.items():
        where.setdefault(index.fqn, set()).add(info.relative_path)
    tensors = {key: {"shape": list(value.size), "chunks": len(value.chunks),
                     "sizes": [list(chunk.sizes) for chunk in value.chunks], "files": sorted(where.get(key, ()))}
               for key, value in meta.state_dict_metadata.items() if isinstance(value, TensorStorageMetadata)}
    return {"files": files, "tensors": tensors}


def export_consolidated(path: str, out_file: str) -> dict:
    """Turn a DCP directory into one ``torch.save`` file (no process group needed); return its tensors.

    For inference: ``torch.load(out_file, weights_only=True)["model"]`` is a plain
    state dict that ``model.load_state_dict`` accepts, on any number of devices.
    """
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(path, out_file)
    return torch.load(out_file, weights_only=True)


def full_state(model: nn.Module, optimizer) -> dict:
    """Model and optimizer state as full CPU tensors, flat keys (``"model.head.weight"``,
    ``"optim.state.head.weight.exp_avg"``); a collective. For comparisons, not for checkpoints."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    out = {f"model.{k}": v.detach().cpu().clone() for k, v in model_state.items()}
    for name, state in optim_state.get("state", {}).items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                out[f"optim.state.{name}.{key}"] = value.detach().cpu().clone()
    return out

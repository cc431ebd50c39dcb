"""Record the collectives a piece of code issues: which, how many elements, in which order.

Sharded training is a choice of collectives: DDP all-reduces the gradients,
ZeRO reduce-scatters them and all-gathers the parameters. :func:`record_collectives`
makes that visible in a rank: while it is active, every call of a
``torch.distributed`` collective (by your code, or by ``fully_shard``, which
calls the same functions) is appended to a list as a plain dict::

    {"op": "reduce_scatter", "call": "reduce_scatter_single", "numel": 12,
     "bytes": 48, "dtype": "torch.float32", "device": "cpu"}

``numel`` is the size of the *whole* tensor the collective works on: the
input of a reduce-scatter, the output of an all-gather, the tensor of an
all-reduce. A call of a deprecated name (``reduce_scatter_tensor``,
``all_gather_into_tensor``) is recorded once, under its own name, although it
calls the new one inside. DDP's gradient all-reduce runs in C++ and is not
seen here (count it with a communication hook, as :func:`mgpu_lab.parallel.ddp.fit` does).

Example:
    >>> from mgpu_lab import launch
    >>> def in_a_rank():
    ...     with record_collectives() as log:
    ...         tdist.all_reduce(torch.ones(4))
    ...     return [(c["op"], c["numel"]) for c in log]
    >>> launch(in_a_rank, 2)
    launch: 2 ranks · ...
    [[('all_reduce', 4)], [('all_reduce', 4)]]
"""
from __future__ import annotations

import contextlib
import inspect
import threading

import torch
import torch.distributed as tdist
from torch.distributed import distributed_c10d as c10d

__all__ = ["record_collectives", "summarize", "OPS"]

# name -> (the kind of collective, the argument that holds the whole tensor(s), the input argument)
OPS = {
    "all_reduce": ("all_reduce", "tensor", "tensor"),
    "reduce_scatter_single": ("reduce_scatter", "input", "input"),
    "reduce_scatter_tensor": ("reduce_scatter", "input", "input"),
    "reduce_scatter": ("reduce_scatter", "input_list", "input_list"),
    "all_gather_single": ("all_gather", "output_tensor", "input_tensor"),
    "all_gather_into_tensor": ("all_gather", "output_tensor", "input_tensor"),
    "all_gather": ("all_gather", "tensor_list", "tensor"),
    "broadcast": ("broadcast", "tensor", "tensor"),
    "reduce": ("reduce", "tensor", "tensor"),
    "all_to_all_single": ("all_to_all", "input", "input"),
}
_depth = threading.local()


def _numel(value) -> tuple[int, torch.Tensor | None]:
    if isinstance(value, torch.Tensor):
        return value.numel(), value
    tensors = [t for t in (value or []) if isinstance(t, torch.Tensor)]
    return sum(t.numel() for t in tensors), (tensors[0] if tensors else None)


def _wrap(name: str, original, log: list, keep_inputs: bool):
    kind, whole, source = OPS[name]
    signature = inspect.signature(original)

    def recorded(*args, **kwargs):
        if getattr(_depth, "n", 0):  # called from a recorded collective (a deprecated alias): once
            return original(*args, **kwargs)
        try:
            bound = signature.bind(*args, **kwargs).arguments
        except TypeError:  # wrong arguments: let the real function say so
            return original(*args, **kwargs)
        numel, sample = _numel(bound.get(whole))
        entry = {"op": kind, "call": name, "numel": int(numel),
                 "bytes": int(numel * (sample.element_size() if sample is not None else 0)),
                 "dtype": str(sample.dtype) if sample is not None else "",
                 "device": str(sample.device) if sample is not None else ""}
        if keep_inputs and isinstance(bound.get(source), torch.Tensor):
            entry["input"] = bound[source].detach().to("cpu", copy=True)
        log.append(entry)
        _depth.n = 1
        try:
            return original(*args, **kwargs)
        finally:
            _depth.n = 0

    return recorded


@contextlib.contextmanager
def record_collectives(keep_inputs: bool = False):
    """Record every ``torch.distributed`` collective called inside the ``with`` block.

    Args:
        keep_inputs: also keep a CPU copy of each call's input tensor under ``"input"``
            (e.g. to see which shard a rank contributed to an all-gather).

    Yields:
        The list the calls are appended to, one dict per call (see the module docstring).

    Example:
        >>> from mgpu_lab import launch
        >>> from mgpu_lab.sharding.fsdp import BlockNet, make_mesh, shard_model
        >>> def fsdp_step():
        ...     model = shard_model(BlockNet(), make_mesh())   # an FSDP2 model
        ...     with record_collectives() as log:
        ...         model(torch.ones(2, 8)).sum().backward()
        ...     return summarize(log)
        >>> launch(fsdp_step, 2)[0]   # 4 blocks + the root: 5 gathers forward, the blocks' 4 again backward
        launch: 2 ranks · ...
        {'all_gather': 9, 'reduce_scatter': 5}
    """
    log: list = []
    saved = []
    for name in OPS:
        for module in (tdist, c10d):
            original = getattr(module, name, None)
            if original is None:
                continue
            saved.append((module, name, original))
            setattr(module, name, _wrap(name, original, log, keep_inputs))
    try:
        yield log
    finally:
        for module, name, original in reversed(saved):
            setattr(module, name, original)


def summarize(log: list, what: str = "calls") -> dict:
    """Per kind of collective: the number of calls (``what="calls"``) or the elements moved (``"numel"``).

    Example:
        >>> summarize([{"op": "all_gather", "numel": 8}, {"op": "all_gather", "numel": 8}], "numel")
        {'all_gather': 16}
    """
    if what not in ("calls", "numel", "bytes"):
        raise ValueError(f"what={what!r}: use 'calls', 'numel' or 'bytes'")
    out: dict = {}
    for entry in log:
        out[entry["op"]] = out.get(entry["op"], 0) + (1 if what == "calls" else entry[what])
    return out

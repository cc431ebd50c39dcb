"""The torch names the course is written with, on the older torch releases it runs on (2.11 and later).

The lessons use torch 2.14's collective names. Two of them are newer than the
oldest torch the course is tested on: ``dist.reduce_scatter_single`` and
``dist.all_gather_single`` appeared in torch 2.13, as the new names of
``reduce_scatter_tensor`` and ``all_gather_into_tensor`` (same arguments, same
result; torch 2.14 deprecates the old names). On a torch without them,
:func:`install` adds them to ``torch.distributed`` as those older functions,
so a lesson's code runs unchanged. The launcher's ranks, and the modules of
this package that call them, install them when they start; nothing is changed
on a torch that has them.

One fix, too, on torch before 2.12: a pipeline schedule's first exchange
(``_initialize_stages``) warms up every stage's neighbours with a batched send
and receive, and when two neighbouring stages sit on the same rank (ZBV's V
puts stages 1 and 2 of 4 on rank 1) it sends to the rank itself. gloo has no
connection to itself and stops with "Pair is not connected"; torch 2.12 and
later warm up stages differently. :func:`install` drops those sends and
receives to the rank itself from the warm-up: stages on one rank hand their
tensors on in memory, so nothing else changes.

Example:
    >>> import torch.distributed as dist
    >>> from mgpu_lab.core import compat
    >>> added = compat.install()
    >>> callable(dist.reduce_scatter_single) and callable(dist.all_gather_single)
    True
"""
from __future__ import annotations

import torch
import torch.distributed as tdist

__all__ = ["ALIASES", "install", "needs_pipeline_warmup_fix", "fix_pipeline_warmup"]

#: New name -> the older function with the same arguments and result (torch < 2.13).
ALIASES = {"reduce_scatter_single": "reduce_scatter_tensor", "all_gather_single": "all_gather_into_tensor"}


def needs_pipeline_warmup_fix(version: str | None = None) -> bool:
    """Whether this torch's pipeline warm-up sends to the rank itself (torch before 2.12).

    Example:
        >>> needs_pipeline_warmup_fix("2.11.0+cu130"), needs_pipeline_warmup_fix("2.14.1")
        (True, False)
    """
    from torch.torch_version import TorchVersion

    return TorchVersion(version or torch.__version__) < (2, 12)


def fix_pipeline_warmup() -> bool:
    """Drop the sends and receives to the rank itself from pipeline stages' warm-up. False if already done."""
    from torch.distributed.pipelining import stage

    base = stage._PipelineStageBase
    original = base._get_init_p2p_neighbors_ops
    if hasattr(original, "__wrapped__"):
        return False

    def warmup_ops(self):
        me = tdist.get_rank(self.group)
        return [op for op in original(self) if op.group_peer != me]
    warmup_ops.__wrapped__ = original
    base._get_init_p2p_neighbors_ops = warmup_ops
    return True


def install() -> list[str]:
    """Add each name of :data:`ALIASES` that this torch lacks to ``torch.distributed``; fix the pipeline warm-up.

    Returns:
        The names added: ``[]`` on torch 2.13 and later (or when torch was built without distributed
        support, where there is nothing to alias). The warm-up's fix is not listed.
    """
    if not tdist.is_available():
        return []
    added = []
    for new, old in ALIASES.items():
        if not hasattr(tdist, new) and hasattr(tdist, old):
            setattr(tdist, new, getattr(tdist, old))
            added.append(new)
    if needs_pipeline_warmup_fix():
        fix_pipeline_warmup()
    return added

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

Example:
    >>> import torch.distributed as dist
    >>> from mgpu_lab.core import compat
    >>> added = compat.install()
    >>> callable(dist.reduce_scatter_single) and callable(dist.all_gather_single)
    True
"""
from __future__ import annotations

import torch.distributed as tdist

__all__ = ["ALIASES", "install"]

#: New name -> the older function with the same arguments and result (torch < 2.13).
ALIASES = {"reduce_scatter_single": "reduce_scatter_tensor", "all_gather_single": "all_gather_into_tensor"}


def install() -> list[str]:
    """Add each name of :data:`ALIASES` that this torch lacks to ``torch.distributed``.

    Returns:
        The names added: ``[]`` on torch 2.13 and later (or when torch was
        built without distributed support, where there is nothing to alias).
    """
    if not tdist.is_available():
        return []
    added = []
    for new, old in ALIASES.items():
        if not hasattr(tdist, new) and hasattr(tdist, old):
            setattr(tdist, new, getattr(tdist, old))
            added.append(new)
    return added

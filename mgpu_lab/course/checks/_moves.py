"""Tensors that record where they were moved, so a forgotten move shows on a CPU.

On a machine without a GPU, ``labels.to(device)`` changes no number; a check
that must catch "forgot to move the labels" tags the tensors it hands to the
learner's code and reads :attr:`Moved.log` afterwards.

Example:
    >>> x = tag(torch.ones(2), "inputs")
    >>> Moved.log = []
    >>> _ = x.to("cpu")
    >>> Moved.log
    [('inputs', 'cpu')]
"""
from __future__ import annotations

import torch


class Moved(torch.Tensor):
    """A tensor that records its ``.to``/``.cuda``/``.cpu`` moves in ``Moved.log`` as ``(tag, device)``.

    The device is the one asked for (``".cpu()"`` for ``.cpu()``). Results of
    any operation are plain tensors again: only the tensors the check tagged
    are tracked.
    """

    log: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu) and isinstance(args[0], Moved):
            if func is torch.Tensor.cpu:
                target = ".cpu()"
            elif func is torch.Tensor.cuda:
                target = kwargs.get("device", args[1] if len(args) > 1 else "cuda")
            else:
                target = torch._C._nn._parse_to(*args[1:], **kwargs)[0]
            Moved.log.append((getattr(args[0], "tag", "?"), str(target)))
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        return out.as_subclass(torch.Tensor) if isinstance(out, Moved) else out


def tag(tensor: torch.Tensor, name: str) -> Moved:
    """``tensor`` as a :class:`Moved` whose moves are logged under ``name``."""
    out = tensor.as_subclass(Moved)
    out.tag = name
    return out

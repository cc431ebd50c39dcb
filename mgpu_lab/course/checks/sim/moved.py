"""Tensors that record where they were moved, so a forgotten move shows on a CPU.

On a machine without a GPU, ``labels.to(device)`` changes no number; a check
that must catch "forgot to move the labels" tags the tensors it hands to the
learner's code and reads :attr:`Moved.log` afterwards.

A check can also hand the learner a GPU's name on a machine without one: with
:attr:`Moved.virtual_cuda` set, a tagged tensor's move to ``cuda:N`` is logged
and its data stays on the CPU, so ``train_step(..., device=cuda:1)`` runs here
and an answer that moves the batch to ``"cpu"`` (or to ``cuda:0``) instead of
``device`` shows in the log.

Example:
    >>> x = tag(torch.ones(2), "inputs")
    >>> Moved.log = []
    >>> _ = x.to("cpu")
    >>> Moved.log
    [('inputs', 'cpu')]
    >>> Moved.virtual_cuda = True
    >>> y = tag(torch.ones(2), "labels").to("cuda:1", non_blocking=True)
    >>> Moved.log[-1], y.device.type
    (('labels', 'cuda:1'), 'cpu')
    >>> Moved.virtual_cuda = False
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
    #: Moves to ``cuda:N`` are logged and kept on the CPU (a GPU's name on a machine without one).
    virtual_cuda: bool = False

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu) and isinstance(args[0], Moved):
            dtype = None
            if func is torch.Tensor.cpu:
                target = ".cpu()"
            elif func is torch.Tensor.cuda:
                index = kwargs.get("device", args[1] if len(args) > 1 else None)
                target = torch.device("cuda", index) if isinstance(index, int) else torch.device(index or "cuda")
            else:
                target, dtype = torch._C._nn._parse_to(*args[1:], **kwargs)[:2]
            Moved.log.append((getattr(args[0], "tag", "?"), str(target)))
            if cls.virtual_cuda and isinstance(target, torch.device) and target.type == "cuda":
                with torch._C.DisableTorchFunctionSubclass():
                    kept = args[0].to(dtype) if dtype is not None else args[0].clone()
                return kept.as_subclass(torch.Tensor)
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        return out.as_subclass(torch.Tensor) if isinstance(out, Moved) else out


def tag(tensor: torch.Tensor, name: str) -> Moved:
    """``tensor`` as a :class:`Moved` whose moves are logged under ``name``."""
    out = tensor.as_subclass(Moved)
    out.tag = name
    return out

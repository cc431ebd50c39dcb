"""Virtual GPUs for lesson 06's probes: where every tensor would be, on a machine without one.

On a CPU, ``h.to(dev2)`` changes no number, so a forgotten move passes any check
that compares numbers. The probes of lesson 06 therefore give the learner's code
names of GPUs (``cuda:2``, ``cuda:3``) and track placement themselves:

* a :class:`Placed` tensor keeps its data on the CPU, and its ``.device`` says
  where it would be; ``.to``/``.cuda``/``.cpu`` change that (every move is logged
  in :attr:`Placed.moves`), and whatever is computed from it (``torch.chunk`` of a
  batch, a loss times a weight, ...) stays Placed on the same device;
* a :class:`Stage` wraps a module: ``stage.to(device)`` places it (virtually), its
  parameters report that device, and every forward records the device of its
  input: on two GPUs a stage given a tensor from another device raises
  "Expected all tensors to be on the same device"; here the probe records it;
* a :class:`PlacedLoss` records the devices of the output and the labels.

This is a simulation of placement, not of GPUs: the data never leaves the CPU,
so it runs the same on a laptop, in CI and on a GPU machine.

Example:
    >>> x = place(torch.ones(4, 2), "inputs", "cpu")
    >>> parts = torch.chunk(x, 2)
    >>> parts[0].to("cuda:1").device, Placed.moves[-1]
    (device(type='cuda', index=1), ('inputs', 'cpu', 'cuda:1'))
"""
from __future__ import annotations

import torch
from torch import nn

CPU = torch.device("cpu")


def device_of(name) -> torch.device:
    """``name`` as a device; ``cuda`` without an index is the current one, cuda:0 (no set_device here)."""
    dev = torch.device(name)
    return torch.device("cuda", 0) if dev.type == "cuda" and dev.index is None else dev


class Placed(torch.Tensor):
    """A CPU tensor that says it is on :attr:`vdev` and carries a :attr:`tag` (``"inputs"``, ...).

    ``moves`` collects every move as ``(tag, from, to)`` with ``to`` as asked
    (``"cuda"`` stays ``"cuda"`` there; :func:`device_of` reads it as cuda:0).
    """

    moves: list = []  # not 'log': that is Tensor.log, the logarithm

    @property
    def device(self) -> torch.device:  # where the tensor would be
        return self.vdev

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu) and isinstance(args[0], Placed):
            return _move(func, args[0], args[1:], kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        src = _first_placed(args, kwargs)
        return out if src is None else _wrap(out, src)


def _move(func, src: "Placed", args, kwargs):
    dtype = None
    if func is torch.Tensor.cpu:
        asked = CPU
    elif func is torch.Tensor.cuda:
        index = kwargs.get("device", args[0] if args else None)
        asked = torch.device("cuda", index) if isinstance(index, int) else torch.device(index or "cuda")
    elif args and isinstance(args[0], torch.Tensor):  # .to(other): other's device and dtype
        asked, dtype = args[0].device, args[0].dtype
    else:
        asked, dtype = torch._C._nn._parse_to(*args, **kwargs)[:2]
    if asked is not None:
        Placed.moves.append((src.tag, str(src.vdev), str(asked)))
    with torch._C.DisableTorchFunctionSubclass():
        data = src.to(dtype) if dtype is not None else src.view_as(src)
    return place(data, src.tag, src.vdev if asked is None else device_of(asked))


def _first_placed(args, kwargs):
    for a in (*args, *kwargs.values()):
        if isinstance(a, Placed):
            return a
        if isinstance(a, (list, tuple)):
            found = next((b for b in a if isinstance(b, Placed)), None)
            if found is not None:
                return found
    return None


def _wrap(out, src: "Placed"):
    if isinstance(out, Placed):
        return out
    if isinstance(out, torch.Tensor):
        return place(out, src.tag, src.vdev)
    if isinstance(out, (tuple, list)) and any(isinstance(o, torch.Tensor) for o in out):
        return type(out)(_wrap(o, src) for o in out)
    return out


def place(tensor: torch.Tensor, tag: str, device) -> Placed:
    """``tensor`` (data kept on the CPU) as a :class:`Placed` tensor on ``device``."""
    with torch._C.DisableTorchFunctionSubclass():
        out = tensor.as_subclass(Placed)
    out.tag, out.vdev = tag, device_of(device)
    return out


def plain(tensor):
    """The data of a Placed tensor as a plain tensor (the same autograd graph)."""
    if isinstance(tensor, Placed):
        with torch._C.DisableTorchFunctionSubclass():
            return tensor.as_subclass(torch.Tensor)
    return tensor


def where(tensor) -> torch.device:
    """Where a tensor would be: a Placed tensor's device; any other tensor is on the CPU."""
    return tensor.vdev if isinstance(tensor, Placed) else (tensor.device if isinstance(tensor, torch.Tensor) else CPU)


class VirtualParameter(nn.Parameter):
    """A parameter whose ``.device`` is its stage's virtual device (its data stays on the CPU)."""

    @property
    def device(self) -> torch.device:
        return getattr(self, "vdev", CPU)

    def __deepcopy__(self, memo):
        copied = super().__deepcopy__(memo)
        copied.vdev = self.device
        return copied


class Stage(nn.Module):
    """``inner`` on a virtual device: records its moves and the device and size of every input.

    ``Stage.log`` holds ``(name, "to", device)`` for every move of the stage and
    ``(name, "input", tag, input device, stage device, batch size)`` for every forward.
    """

    log: list = []

    def __init__(self, inner: nn.Module, name: str, out_tag: str, device=CPU):
        super().__init__()
        for module in inner.modules():
            for key, p in list(module._parameters.items()):
                if p is not None:
                    module._parameters[key] = VirtualParameter(p.data, p.requires_grad)
        self.inner, self.name, self.out_tag = inner, name, out_tag
        self._place(device)

    def _place(self, device) -> None:
        self.vdev = device_of(device)
        for p in self.parameters():
            p.vdev = self.vdev

    def to(self, *args, **kwargs):
        device, dtype = torch._C._nn._parse_to(*args, **kwargs)[:2]
        if dtype is not None:
            super().to(dtype=dtype)
        if device is not None:
            Stage.log.append((self.name, "to", str(device)))
            self._place(device)
        return self

    def cuda(self, device=None):
        return self.to(torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cuda"))

    def cpu(self):
        return self.to(CPU)

    def forward(self, x):
        tag = x.tag if isinstance(x, Placed) else "a tensor your code made"
        Stage.log.append((self.name, "input", tag, str(where(x)), str(self.vdev), len(x)))
        return place(self.inner(plain(x)), self.out_tag, self.vdev)


class PlacedLoss(nn.Module):
    """A loss function that records ``(output device, labels device)`` of every call in ``PlacedLoss.log``."""

    log: list = []

    def __init__(self, loss_fn):
        super().__init__()
        self.loss_fn = loss_fn

    def forward(self, output, target):
        tag = target.tag if isinstance(target, Placed) else "a tensor your code made"
        PlacedLoss.log.append((str(where(output)), str(where(target)), tag))
        return place(self.loss_fn(plain(output), plain(target)), "loss", where(output))


def reset() -> None:
    """Empty every log (at the start of each run)."""
    Placed.moves, Stage.log, PlacedLoss.log = [], [], []

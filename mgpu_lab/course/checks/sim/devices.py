"""Virtual devices: tensors and modules that know where they would be, on a machine without GPUs.

On a CPU, ``labels.to(device)`` changes no number, so a forgotten move passes any
check that compares numbers. The checks therefore give the learner's code names
of GPUs (``cuda:1``, ``cuda:3``) and track placement themselves:

* a :class:`Placed` tensor keeps its data on the CPU, says where it would be
  (``.device``) and carries a ``tag`` (``"inputs"``, ``"labels"``, ...); every
  ``.to``/``.cuda``/``.cpu`` is logged in :attr:`Placed.moves` as ``(tag, from,
  to)``, an operation given tensors of several devices in :attr:`Placed.mixes`
  (a GPU would refuse it), and a batch that ``torch.stack`` makes of placed
  samples (a DataLoader's collation) in :attr:`Placed.batches`;
* a tracked tensor (``tracked=True``) hands its tag and device on to whatever is
  computed from it (its moved copy, ``torch.chunk`` of it, a loss times a weight);
  an untracked one (``tracked=False``) gives plain tensors, so that a tagged
  tensor reaching a model or a loss was never moved;
* a :class:`PlacedModule` (its layers inside, as ``nn.Sequential``) logs its own
  moves in the same log, records the device of every input in
  :attr:`PlacedModule.inputs`, and with ``virtual_parameters`` its parameters
  (:class:`PlacedParameter`) report its device;
* a :class:`PlacedLoss` records the devices of the output and the labels.

:func:`parse_move` is the one reader of ``.to``/``.cuda``/``.cpu`` arguments.
This is a simulation of placement, not of GPUs: the data never leaves the CPU,
so it runs the same on a laptop, in CI and on a GPU machine.

Example:
    >>> reset()
    >>> x = place(torch.ones(4, 2), "inputs")
    >>> parts = torch.chunk(x, 2)
    >>> moved = parts[0].to("cuda:1", non_blocking=True)
    >>> moved.device, moved.tag, Placed.moves
    (device(type='cuda', index=1), 'inputs', [('inputs', 'cpu', 'cuda:1')])
    >>> _ = torch.cat([moved, parts[1]])
    >>> Placed.mixes
    [('cat', ['cuda:1', 'cpu'])]
    >>> labels = place(torch.zeros(4), "labels", tracked=False)
    >>> type(labels.cuda()).__name__, Placed.moves[-1]
    ('Tensor', ('labels', 'cpu', 'cuda'))
    >>> model = PlacedModule(nn.Linear(2, 3), name="model", out_tag="output").to("cuda:1")
    >>> out = model(moved)
    >>> out.device, Placed.moves[-1], PlacedModule.inputs[-1][1:]
    (device(type='cuda', index=1), ('model', 'cpu', 'cuda:1'), ('inputs', 'cuda:1', 'cuda:1', 2))
"""
from __future__ import annotations

import torch
from torch import nn

CPU = torch.device("cpu")


UNTAGGED = "a tensor your code made"  # the tag of an input no check placed


def cuda_device(device=None) -> torch.device:
    """The device ``.cuda(device)`` asks for: ``cuda:i`` for an int, ``cuda`` (no index) for None."""
    return torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cuda")


def resolve(device) -> torch.device:
    """``device`` as a device; ``cuda`` without an index is cuda:0 (a placed tensor does not follow
    ``torch.cuda.set_device``: judges that must, read it from the log)."""
    dev = torch.device(device)
    return torch.device("cuda", 0) if dev.type == "cuda" and dev.index is None else dev


def parse_move(method: str, *args, **kwargs) -> tuple:
    """What ``x.<method>(*args, **kwargs)`` asks for (``method``: ``"to"``, ``"cuda"`` or ``"cpu"``).

    Returns:
        ``(device, dtype)``: the device as asked (``cuda`` keeps no index; None for a
        dtype-only ``.to``), and the dtype (None: unchanged). ``.to(other)`` asks for
        where ``other`` is (:func:`where`) and its dtype.

    Example:
        >>> parse_move("to", "cuda:1", non_blocking=True), parse_move("cuda"), parse_move("to", torch.float64)
        ((device(type='cuda', index=1), None), (device(type='cuda'), None), (None, torch.float64))
    """
    if method == "cpu":
        return CPU, None
    if method == "cuda":
        return cuda_device(kwargs.get("device", args[0] if args else None)), None
    if args and isinstance(args[0], torch.Tensor):
        return where(args[0]), args[0].dtype
    kwargs = {k: v for k, v in kwargs.items() if k != "copy"}  # Tensor.to's, unknown to modules' parser
    device, dtype = torch._C._nn._parse_to(*args, **kwargs)[:2]
    return device, dtype


_MOVES = {torch.Tensor.to: "to", torch.Tensor.cuda: "cuda", torch.Tensor.cpu: "cpu"}


class Placed(torch.Tensor):
    """A CPU tensor that says it is on :attr:`vdev` and carries a :attr:`tag`; see the module docstring.

    ``moves`` holds ``(tag, from, to)`` for every move (``to`` as asked: ``"cuda"``
    stays ``"cuda"``; :func:`resolve` reads it as cuda:0), ``mixes`` ``(operation,
    devices)``, ``batches`` the tag of every batch stacked from placed samples.
    """

    moves: list = []  # not 'log': that is Tensor.log, the logarithm
    mixes: list = []
    batches: list = []
    tag, vdev, tracked = "?", CPU, True

    @property
    def device(self) -> torch.device:  # where the tensor would be
        return self.vdev

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _MOVES and isinstance(args[0], Placed):
            return _move(args[0], _MOVES[func], args[1:], kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        placed = [a for a in _flat(args) + _flat(list(kwargs.values())) if isinstance(a, Placed)]
        if not placed:
            return out
        devices = list(dict.fromkeys(str(p.vdev) for p in placed))
        if len(devices) > 1:
            Placed.mixes.append((getattr(func, "__name__", str(func)), devices))
        src = placed[0]
        if func is torch.stack and args and isinstance(args[0], (list, tuple)) and isinstance(args[0][0], Placed):
            Placed.batches.append(src.tag)
            return place(out, src.tag, src.vdev, tracked=src.tracked)
        return _wrap(out, src) if src.tracked else plain(out)


def _move(src: Placed, method: str, args, kwargs):
    asked, dtype = parse_move(method, *args, **kwargs)
    if asked is not None:
        Placed.moves.append((src.tag, str(src.vdev), str(asked)))
    with torch._C.DisableTorchFunctionSubclass():
        data = src.to(dtype) if dtype is not None else src.view_as(src)
    if not src.tracked:
        return plain(data)
    return place(data, src.tag, src.vdev if asked is None else asked, tracked=True)


def _flat(items) -> list:
    out = []
    for a in items:
        out.extend(_flat(a) if isinstance(a, (list, tuple)) else [a])
    return out


def _wrap(out, src: Placed):
    if isinstance(out, Placed):
        return out
    if isinstance(out, torch.Tensor):
        return place(out, src.tag, src.vdev)
    if isinstance(out, (tuple, list)) and any(isinstance(o, torch.Tensor) for o in out):
        return type(out)(_wrap(o, src) for o in out)
    return out


def place(tensor: torch.Tensor, tag: str, device=CPU, *, tracked: bool = True) -> Placed:
    """``tensor`` (an alias: its data stays on the CPU, autograd goes through) as a :class:`Placed` tensor.

    Args:
        tensor: the data.
        tag: the name its moves are logged under (``"inputs"``, ``"labels"``, ...).
        device: where it would be (``cuda`` without an index: cuda:0).
        tracked: whether what is computed from it (moves included) stays Placed, with this tag and
            device; untracked, results are plain tensors.
    """
    with torch._C.DisableTorchFunctionSubclass():
        out = tensor.as_subclass(Placed)
    out.tag, out.vdev, out.tracked = tag, resolve(device), tracked
    return out


def plain(tensor):
    """The data of a Placed tensor as a plain tensor (the same autograd graph); anything else as it is."""
    if isinstance(tensor, Placed):
        with torch._C.DisableTorchFunctionSubclass():
            return tensor.as_subclass(torch.Tensor)
    return tensor


def where(tensor) -> torch.device:
    """Where a tensor would be: a Placed tensor's device, any other tensor's own (a
    :class:`PlacedParameter` reports its module's); what is no tensor is on the CPU."""
    if isinstance(tensor, Placed):
        return tensor.vdev
    return tensor.device if isinstance(tensor, torch.Tensor) else CPU


def tag_of(tensor) -> str:
    """A Placed tensor's tag, else :data:`UNTAGGED`."""
    return tensor.tag if isinstance(tensor, Placed) else UNTAGGED


class PlacedParameter(nn.Parameter):
    """A parameter whose ``.device`` is its module's virtual device (its data stays on the CPU)."""

    @property
    def device(self) -> torch.device:
        return getattr(self, "vdev", CPU)

    def __deepcopy__(self, memo):
        copied = super().__deepcopy__(memo)
        copied.vdev = self.device
        return copied


class PlacedModule(nn.Sequential):
    """Layers run in order (as ``nn.Sequential``) on a virtual device; its moves and inputs are recorded.

    ``.to``/``.cuda``/``.cpu`` log ``(name, from, to)`` in :attr:`Placed.moves` and only
    rename the device (a dtype is applied). Every forward appends ``(module, input tag,
    input device, module device, batch size)`` to :attr:`PlacedModule.inputs` and runs the
    layers on the input's data.

    Args:
        modules: the layers.
        name: the name its moves are logged under (``"model"``, ``"stage1"``); a slice of it
            (``model[:2]``, as of any ``nn.Sequential``) is a ``"model"`` on the CPU.
        out_tag: its outputs are tracked Placed tensors with this tag on its device; None: plain.
        device: where it starts.
        virtual_parameters: its parameters report its device (a model on cuda:2 whose
            ``next(model.parameters()).device`` says so); else they report the CPU.
    """

    inputs: list = []

    def __init__(self, *modules: nn.Module, name: str = "model", out_tag: str | None = None, device=CPU,
                 virtual_parameters: bool = False):
        super().__init__(*modules)
        if virtual_parameters:
            for module in self.modules():
                for key, p in list(module._parameters.items()):
                    if p is not None:
                        module._parameters[key] = PlacedParameter(p.data, p.requires_grad)
        self.name, self.out_tag, self.virtual_parameters = name, out_tag, virtual_parameters
        self.put_on(device)

    def put_on(self, device) -> None:
        """Place it on ``device`` without logging a move (what the check does, not the learner)."""
        self.vdev = resolve(device)
        if self.virtual_parameters:
            for p in self.parameters():
                p.vdev = self.vdev

    def _moved(self, method: str, args, kwargs):
        device, dtype = parse_move(method, *args, **kwargs)
        if dtype is not None:
            super().to(dtype=dtype)
        if device is not None:
            Placed.moves.append((self.name, str(self.vdev), str(device)))
            self.put_on(device)
        return self

    def to(self, *args, **kwargs):
        return self._moved("to", args, kwargs)

    def cuda(self, device=None):
        return self._moved("cuda", (device,), {})

    def cpu(self):
        return self._moved("cpu", (), {})

    def forward(self, input):
        PlacedModule.inputs.append((self, tag_of(input), str(where(input)), str(self.vdev), len(input)))
        out = super().forward(plain(input))
        return out if self.out_tag is None else place(out, self.out_tag, self.vdev)


class PlacedLoss(nn.Module):
    """A loss function that records ``(output device, labels device, labels tag)`` of every call in
    :attr:`PlacedLoss.calls`; the loss of a Placed output is Placed on the output's device."""

    calls: list = []

    def __init__(self, loss_fn):
        super().__init__()
        self.loss_fn = loss_fn

    def forward(self, input, target):
        PlacedLoss.calls.append((str(where(input)), str(where(target)), tag_of(target)))
        loss = self.loss_fn(plain(input), plain(target))
        return place(loss, "loss", input.vdev, tracked=input.tracked) if isinstance(input, Placed) else loss


_FACTORIES = ("empty", "zeros", "ones", "full", "rand", "randn", "randint", "arange", "tensor", "empty_strided")


class VirtualFactories(torch.overrides.TorchFunctionMode):
    """While active, a tensor made by a factory (``torch.empty``, ``zeros``, ``ones``, ``full``, ``rand``,
    ``randn``, ``randint``, ``arange``, ``tensor``, ``empty_strided``) with ``device=`` a GPU is made on the
    CPU and returned as a tracked :class:`Placed` tensor on that device, tagged :data:`UNTAGGED`; one made
    without ``device=`` stays a plain CPU tensor, as it would beside a GPU stage.

    Example:
        >>> with VirtualFactories():
        ...     buf, cpu_buf = torch.empty(2, 3, device="cuda:1"), torch.zeros(2)
        >>> buf.device, buf.shape, cpu_buf.device
        (device(type='cuda', index=1), torch.Size([2, 3]), device(type='cpu'))
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        device = kwargs.get("device")
        if name in _FACTORIES and device is not None and torch.device(
                str(device) if not isinstance(device, int) else f"cuda:{device}").type == "cuda":
            out = func(*args, **{**kwargs, "device": "cpu"})
            return place(out, UNTAGGED, resolve(device if not isinstance(device, int) else f"cuda:{device}"))
        return func(*args, **kwargs)


def reset() -> None:
    """Empty every log (at the start of each run)."""
    Placed.moves, Placed.mixes, Placed.batches, PlacedModule.inputs, PlacedLoss.calls = [], [], [], [], []

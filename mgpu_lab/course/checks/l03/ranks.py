"""What lesson 03's checks run in a fresh process: the learner's replicate and forward on simulated GPUs.

The check's model (:class:`Probe`: a linear layer, a nested block with a buffer)
starts on ``cuda:0`` of simulated GPUs (:func:`..sim.cuda.simulated_gpus`): its
parameters are :class:`SimParameter` leaves whose data stays on the CPU, which say
they are on ``cuda:0`` and whose ``.to(device)`` gives a differentiable copy that
says it is on ``device`` (:class:`..sim.devices.Placed`); its buffers are Placed
tensors. Everything computed from them knows its (simulated) device, and an
operation given tensors of two devices is recorded, as a GPU would refuse it;
during backward a gradient sent to a GPU stays where it is (:func:`gradients_stay`),
so an answer whose own backward adds the gradients on the first device runs. Every
forward of the model or of a replica of it is recorded: the replica, the chunk's
device, the replica's device, the chunk's size. :func:`run_replicate` judges
``replicate(model, devices)``, :func:`run_dps` ``data_parallel_forward(model, batch,
devices)`` with the check's own :func:`reference_replicate` under the name ``replicate`` (each
exercise judged on its own); both return plain evidence that :mod:`.checkers` judges.
"""
from __future__ import annotations

import copy
import torch
from contextlib import contextmanager
from torch import nn

from ..sim.cuda import simulated_gpus
from ..sim.devices import Placed, parse_move, place, plain, reset, resolve, tag_of, where
from ..sim.outcome import one_thread, outcome


class SimParameter(Placed, nn.Parameter):
    """A leaf parameter that says it is on a (simulated) device; ``.to(device)`` is a differentiable copy."""

    def __new__(cls, data, requires_grad=True, device="cuda:0"):
        out = torch.Tensor._make_subclass(cls, data, requires_grad)
        out.tag, out.vdev, out.tracked = "model", resolve(device), True
        return out

    def __deepcopy__(self, memo):
        if id(self) not in memo:
            memo[id(self)] = type(self)(self.data.clone(), self.requires_grad, self.vdev)
        return memo[id(self)]

    @property
    def data(self):
        return torch.Tensor.data.__get__(self)

    @data.setter
    def data(self, value):  # a module's .to(device) sets its parameters' .data to their moved copies
        torch.Tensor.data.__set__(self, plain(value))
        if isinstance(value, Placed):
            self.vdev = value.vdev


class SimBuffer(Placed):
    """A buffer that says it is on a (simulated) device, and survives ``copy.deepcopy`` as one."""

    def __deepcopy__(self, memo):
        if id(self) not in memo:
            memo[id(self)] = sim_buffer(plain(self).detach().clone(), self.vdev)
        return memo[id(self)]


def sim_buffer(data: torch.Tensor, device) -> SimBuffer:
    with torch._C.DisableTorchFunctionSubclass():
        out = data.as_subclass(SimBuffer)
    out.tag, out.vdev, out.tracked = "model", resolve(device), True
    return out


class Scale(nn.Module):
    """Multiplies by a buffer (as BatchNorm's running statistics, a buffer moves with its replica)."""

    def __init__(self, n: int):
        super().__init__()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, n))

    def forward(self, x):
        return x * self.scale


class Probe(nn.Module):
    """The check's model; every forward (its own or a replica's) is appended to :attr:`calls`."""

    calls: list = []

    def __init__(self):
        super().__init__()
        self.inp, self.act = nn.Linear(5, 8), nn.Tanh()
        self.block = nn.Sequential(nn.Linear(8, 3), Scale(3))

    def forward(self, x):
        Probe.calls.append((self, tag_of(x), str(where(x)), str(where(self.inp.weight)), len(x)))
        return self.block(self.act(self.inp(x)))


def models(device="cuda:0") -> tuple[Probe, Probe]:
    """The model on the simulated ``device`` and a plain twin with the same weights (the reference)."""
    torch.manual_seed(0)
    twin = Probe()
    model = copy.deepcopy(twin)
    for module in model.modules():
        for key, p in list(module._parameters.items()):
            module._parameters[key] = SimParameter(p.data.clone(), True, device)
        for key, b in list(module._buffers.items()):
            module._buffers[key] = sim_buffer(b.clone(), device)
    Probe.calls = []
    return model, twin


@contextmanager
def gradients_stay():
    """Inside the block (a backward), a plain tensor sent to a GPU stays where it is.

    Gradients are plain tensors (the simulation tracks what the forward computes): an
    answer whose backward brings them to the model's device (``grad.to(source)``, as
    a broadcast's reduce-add does) would otherwise ask the real CUDA for it.
    """
    to, cuda = torch.Tensor.to, torch.Tensor.cuda

    def stay_to(self, *args, **kwargs):
        if not isinstance(self, Placed):
            device, dtype = parse_move("to", *args, **kwargs)
            if device is not None and device.type == "cuda":
                return self if dtype is None else to(self, dtype)
        return to(self, *args, **kwargs)

    def stay_cuda(self, *args, **kwargs):
        return cuda(self, *args, **kwargs) if isinstance(self, Placed) else self

    torch.Tensor.to, torch.Tensor.cuda = stay_to, stay_cuda
    try:
        yield
    finally:
        torch.Tensor.to, torch.Tensor.cuda = to, cuda


def _tensors(model: nn.Module):
    """``(path, key, kind)`` of every parameter and buffer of the model's tree."""
    for path, sub in model.named_modules():
        for key in sub._parameters:
            yield path, key, "parameter"
        for key in sub._buffers:
            yield path, key, "buffer"


def _sub(root, path: str):
    try:
        return root.get_submodule(path) if path else root
    except AttributeError:
        return None


def _structure(model, replicas) -> dict:
    """Where every tensor of every replica is, what it is, and which modules are shared."""
    placement, kinds, shared = [], set(), []
    mine = {path: sub for path, sub in model.named_modules()}
    for i, replica in enumerate(replicas):
        for path, key, kind in _tensors(model):
            sub = _sub(replica, path)
            t = getattr(sub, key, None) if sub is not None else None
            name = f"{path}.{key}" if path else key
            placement.append((i, kind, name, str(where(t)) if isinstance(t, torch.Tensor) else "missing"))
            if kind == "parameter" and isinstance(t, torch.Tensor):
                kinds.add("detached" if not t.requires_grad else "leaf" if t.is_leaf else "linked")
        for path, sub in mine.items():
            theirs = _sub(replica, path)
            if theirs is sub:
                shared.append(f"replica {i}'s {path or 'root module'} is the model's own")
            for j in range(i):
                if theirs is not None and theirs is _sub(replicas[j], path):
                    shared.append(f"replicas {j} and {i} share {path or 'the root module'}")
    return {"placement": placement, "kinds": sorted(kinds), "shared": shared}


def _model_kept(model, before: dict) -> list:
    """What of the model changed: a parameter replaced, no longer a leaf, or moved off cuda:0."""
    changed = []
    for (path, key), p in before.items():
        now = getattr(_sub(model, path), key, None) if _sub(model, path) is not None else None
        name = f"{path}.{key}" if path else key
        if now is not p:
            changed.append(f"the model's {name} was replaced")
        elif str(where(p)) != "cuda:0":
            changed.append(f"the model's {name} is now on {where(p)}")
    return changed


def _mixes() -> list:
    """The operations given tensors of several devices, torch's own bookkeeping (``_has_...``) left out."""
    return [(op, devices) for op, devices in Placed.mixes if not op.startswith("_")]


def _grads(model, twin, xs, weights) -> dict:
    """Compare the model's .grad with the sum (and the mean, and replica 0's part) of the chunks' gradients."""
    got = [None if p.grad is None else plain(p.grad).detach().clone() for p in model.parameters()]
    if any(g is None for g in got):
        return {"grads": "missing"}
    parts = []
    for x, w in zip(xs, weights):
        twin.zero_grad()
        (twin(x) * w).sum().backward()
        parts.append([p.grad.clone() for p in twin.parameters()])
    total = [sum(gs) for gs in zip(*parts)]

    def same(a):
        return all(torch.allclose(g, r, atol=1e-5) for g, r in zip(got, a))
    if same(total):
        return {"grads": "equal"}
    if same([t / len(parts) for t in total]):
        return {"grads": "averaged"}
    if same(parts[0]):
        return {"grads": "first only"}
    return {"grads": "different"}


def replicate_report(replicate, n_gpus: int, devices: list) -> dict:
    """``replicate(model, devices)`` on ``n_gpus`` simulated GPUs: the replicas' placement, structure, outputs
    on chunks already on their devices, and the model's gradients after a backward through all of them."""
    model, twin = models()
    before = {(path, key): getattr(_sub(model, path), key) for path, key, kind in _tensors(model)
              if kind == "parameter"}
    devices = [torch.device(d) for d in devices]
    reset()
    with simulated_gpus(n_gpus):
        replicas = replicate(model, list(devices))
        if not isinstance(replicas, (list, tuple)) or not all(isinstance(r, nn.Module) for r in replicas):
            return {"type": type(replicas).__name__}
        report = {"type": "list", "count": len(replicas), "devices": [str(d) for d in devices],
                  **_structure(model, replicas), "changed": _model_kept(model, before)}
        if len(replicas) != len(devices):
            return report
        torch.manual_seed(1)
        xs = [torch.randn(2 + i, 5) for i in range(len(devices))]
        outs = [r(place(x.clone(), "batch", d)) for r, x, d in zip(replicas, xs, devices)]
    report["mixes"] = _mixes()
    report["close"] = [torch.allclose(plain(o).detach(), twin(x).detach(), atol=1e-5) for o, x in zip(outs, xs)]
    weights = [torch.randn(o.shape) for o in outs]
    if not all(plain(o).requires_grad for o in outs):
        return {**report, "grads": "missing"}
    with gradients_stay():
        sum((plain(o) * w).sum() for o, w in zip(outs, weights)).backward()
    return {**report, **_grads(model, twin, xs, weights)}


def run_replicate(replicate, scenarios) -> list:
    """:func:`replicate_report` for every ``(n_gpus, devices)``, each an outcome."""
    one_thread()
    return [outcome(replicate_report, replicate, n, devices) for n, devices in scenarios]


# -- data_parallel_forward ----------------------------------------------------------------
def reference_replicate(module: nn.Module, devices: list) -> list:
    """The check's own replicate, given to the learner's forward so that it is judged on its own.

    One tree of shallow module copies per device whose parameters are ``param.to(device)``
    (computed from the module's: a backward adds their gradients into its ``.grad``) and
    whose buffers are moved copies.
    """
    out = []
    for device in devices:
        copies = {m: copy.copy(m) for m in module.modules()}
        for original, replica in copies.items():
            replica._modules = {k: None if c is None else copies[c] for k, c in original._modules.items()}
            replica._buffers = {k: None if b is None else b.to(device) for k, b in original._buffers.items()}
            replica._parameters = {}
            for key, p in original._parameters.items():
                setattr(replica, key, None if p is None else p.to(device))
        out.append(copies[module])
    return out


@contextmanager
def check_s_replicate(fn):
    """Inside the block the global ``replicate`` of ``fn`` (a notebook function: the learner's own) is
    :func:`reference_replicate`; restored after."""
    names = getattr(fn, "__globals__", None)
    if names is None:
        yield
        return
    missing = object()
    saved = names.get("replicate", missing)
    names["replicate"] = reference_replicate
    try:
        yield
    finally:
        if saved is missing:
            names.pop("replicate", None)
        else:
            names["replicate"] = saved


def run_dp(data_parallel_forward, n_devices: int, batch_size: int) -> dict:
    """Run the learner's forward on ``[cuda:0, ..., cuda:n-1]`` (simulated) and a CPU batch; report."""
    model, twin = models()
    torch.manual_seed(2)
    devices = [torch.device("cuda", i) for i in range(n_devices)]
    batch = torch.randn(batch_size, 5)
    reset()
    with simulated_gpus(n_devices), check_s_replicate(data_parallel_forward):
        out = data_parallel_forward(model, place(batch.clone(), "batch"), list(devices))
    # The log keeps the modules themselves, not their id(): a replica made and dropped inside
    # a loop can be freed and its id reused by the next one.
    calls = list(Probe.calls)  # (module, chunk's tag, chunk's device, module's device, size)
    chunks = [c.shape[0] for c in torch.chunk(batch, n_devices)]
    report = {"moves": list(Placed.moves), "mixes": _mixes(), "chunks": chunks,
              "devices": [str(d) for d in devices[: len(chunks)]],
              "calls": [(size, x_on, m_on) for _, _, x_on, m_on, size in calls],
              "sizes": sorted(c[4] for c in calls), "instances": len({id(c[0]) for c in calls}),
              "original_runs": sum(c[0] is model for c in calls)}
    if not isinstance(out, torch.Tensor):
        return {**report, "type": type(out).__name__}
    on = str(where(out))
    out = plain(out)
    expected = twin(batch)
    report.update({"type": "Tensor", "shape": tuple(out.shape), "where": on, "values": out.detach().clone(),
                   "expected": expected.detach().clone(), "grads": "no graph"})
    if out.requires_grad and out.shape == expected.shape:
        weights = torch.randn(expected.shape)
        with gradients_stay():
            (out * weights).sum().backward()
        report.update(_grads(model, twin, [batch], [weights]))
    return report


def run_dps(data_parallel_forward, scenarios) -> list:
    """:func:`run_dp` for every ``(n_devices, batch_size)``, each an outcome."""
    one_thread()
    return [outcome(run_dp, data_parallel_forward, n, b) for n, b in scenarios]

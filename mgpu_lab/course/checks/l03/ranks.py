"""What lesson 03's checks run in a fresh process: the learner's DataParallel forward on simulated GPUs.

:func:`run_dp` hands the learner's ``data_parallel_forward`` a batch and the
device list ``[cuda:0, cuda:1, ...]`` on any machine. Every tensor derived from
the batch is a :class:`Placed` tensor that knows the (simulated) device it is
on: ``.to``/``.cuda``/``.cpu`` move it there by name (its data stays on the
CPU), ``.device`` reports it, and an operation that combines tensors of two
devices is recorded, as a GPU would refuse it. Inside the process, PyTorch's
``replicate``, ``parallel_apply``, ``scatter`` and ``gather`` (and
``torch.cuda.device``) are replaced by CPU stand-ins that place replicas on the
named devices. The :class:`Probe` model records, for every chunk, its size, the
replica that ran it, where the chunk was and where that replica was. The
evidence is plain data that :mod:`.checkers` judges.
"""
from __future__ import annotations

import copy
import torch
from contextlib import contextmanager
from torch import nn


_DEVICE = torch.Tensor.device


_MOVES = (torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu)


def run_split(split_batch, calls) -> list:
    """``split_batch(batch, n)`` for every ``(batch, n)``: the chunks as a list, or what else came."""
    from ..sim.outcome import one_thread, outcome

    one_thread()
    out = []
    for batch, n in calls:
        got = outcome(split_batch, batch, n)
        if got[0] == "ok":
            value = got[1]
            if isinstance(value, (list, tuple)) and all(isinstance(c, torch.Tensor) for c in value):
                got = ("ok", [c.detach().clone() for c in value])
            else:
                got = ("ok", f"a {type(value).__name__}, not a list of tensors")
        out.append(got)
    return out


# -- tensors that know their (simulated) device ---------------------------------------------
def _target(func, args, kwargs):
    """The device a ``.to``/``.cuda``/``.cpu`` call asks for (None: a dtype-only ``.to``), and its dtype."""
    if func is torch.Tensor.cpu:
        return "cpu", None
    if func is torch.Tensor.cuda:
        index = kwargs.get("device", args[1] if len(args) > 1 else None)
        return str(torch.device("cuda", index) if isinstance(index, int) else torch.device(index or "cuda")), None
    device, dtype = torch._C._nn._parse_to(*args[1:], **kwargs)[:2]
    return (None if device is None else str(device)), dtype


def _where(name: str) -> str:
    return "cuda:0" if name == "cuda" else name  # .cuda() / "cuda" mean the current GPU: cuda:0 here


class Placed(torch.Tensor):
    """A tensor on a named, possibly simulated, device (``where``); see the module docstring.

    ``Placed.moves`` holds ``(role, from, to)`` for every move, ``Placed.mixes``
    ``(operation, devices)`` for every operation given tensors on several devices.
    """

    moves: list = []
    mixes: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__self__", None) is _DEVICE:
            return torch.device(_where(getattr(args[0], "where", "cpu")))
        placed = [a for a in _flat(args) + _flat(list(kwargs.values())) if isinstance(a, Placed)]
        if func in _MOVES and isinstance(args[0], Placed):
            target, dtype = _target(func, args, kwargs)
            if target is not None:
                src = args[0]
                Placed.moves.append((src.role, src.where, target))
                with torch._C.DisableTorchFunctionSubclass():
                    data = src.to(dtype) if dtype is not None else src
                return place(data, _where(target), src.role)
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        wheres = list(dict.fromkeys(p.where for p in placed))
        if len(wheres) > 1:
            Placed.mixes.append((getattr(func, "__name__", str(func)), wheres))
        return _wrap(out, wheres[0], placed[0].role) if placed else out


def _flat(items) -> list:
    out = []
    for a in items:
        out.extend(_flat(a) if isinstance(a, (list, tuple)) else [a])
    return out


def place(tensor: torch.Tensor, where: str, role: str) -> Placed:
    """``tensor`` (an alias: autograd goes through) as a :class:`Placed` tensor on ``where``."""
    out = tensor.as_subclass(Placed)
    out.where, out.role = where, role
    return out


def _wrap(out, where, role):
    if isinstance(out, torch.Tensor):
        return place(out, where, role)
    if isinstance(out, (tuple, list)):
        return type(out)([_wrap(o, where, role) for o in out])
    return out


def plain(tensor):
    return tensor.as_subclass(torch.Tensor) if isinstance(tensor, Placed) else tensor


# -- the model ------------------------------------------------------------------------
class Probe(nn.Module):
    """A small MLP that records, per forward: chunk size, module instance, chunk's device, its own device.

    ``.to``/``.cuda`` of the module only rename where it is (a real move to a
    simulated GPU would fail).
    """

    calls: list = []

    def __init__(self, where: str = "cpu"):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
        self.where = where

    def to(self, *args, **kwargs):
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
        if device is not None:
            self.where = _where(str(device))
        return self

    def cuda(self, device=None):
        self.where = _where(str(torch.device("cuda", device) if isinstance(device, int) else
                                torch.device(device or "cuda")))
        return self

    def forward(self, x):
        # Keep the module itself, not its id(): a replica made and dropped inside a
        # loop can be freed and its id reused by the next one.
        Probe.calls.append((int(x.shape[0]), self, getattr(x, "where", "an untracked tensor"), self.where))
        return place(self.net(plain(x)), self.where, "output")


# -- PyTorch's DataParallel pieces, for simulated GPUs -----------------------------------
def _devices(devices) -> list[str]:
    return [_where(str(torch.device("cuda", d) if isinstance(d, int) else torch.device(d))) for d in devices]


def sim_replicate(network, devices, detach: bool = False):
    from mgpu_lab.parallel.data_parallel import replicate  # its CPU path: autograd-linked shallow copies

    names = _devices(devices)
    with torch.set_grad_enabled(torch.is_grad_enabled() and not detach):
        replicas = replicate(network, ["cpu"] * len(names))
    for replica, name in zip(replicas, names):
        replica.where = name
    return replicas


def sim_parallel_apply(modules, inputs, kwargs_tup=None, devices=None):
    kwargs_tup = kwargs_tup or ({},) * len(modules)
    return [m(*(x if isinstance(x, (list, tuple)) else (x,)), **kw) for m, x, kw in zip(modules, inputs, kwargs_tup)]


def sim_scatter(inputs, target_gpus, dim: int = 0):
    names = _devices(target_gpus)
    return tuple(c.to(name) for c, name in zip(inputs.chunk(len(names), dim), names))


def sim_gather(outputs, target_device, dim: int = 0):
    name = "cpu" if target_device in ("cpu", -1) else _devices([target_device])[0]
    return torch.cat([o.to(name) for o in outputs], dim)


class _SimDevice:
    """``torch.cuda.device(d)`` as a context manager that does nothing (no GPU to switch to)."""

    def __init__(self, device):
        self.device = device

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@contextmanager
def simulated_gpus(n: int, fn):
    """Inside the block, ``n`` GPUs are named and DataParallel's pieces run on the CPU (see the module
    docstring); names in ``fn``'s globals bound to PyTorch's pieces are swapped too."""
    import torch.nn.parallel as par

    swaps = {par.replicate: sim_replicate, par.parallel_apply: sim_parallel_apply, par.scatter: sim_scatter,
             par.gather: sim_gather}
    saved_par = {k: getattr(par, k) for k in ("replicate", "parallel_apply", "scatter", "gather")}
    saved_cuda = {k: getattr(torch.cuda, k) for k in ("device", "is_available", "device_count", "synchronize")}
    g = getattr(fn, "__globals__", {})
    saved_globals = {k: v for k, v in g.items() if any(v is orig for orig in swaps)}
    for name, orig in saved_par.items():
        setattr(par, name, swaps[orig])
    torch.cuda.device = _SimDevice
    torch.cuda.is_available, torch.cuda.device_count = (lambda: True), (lambda: n)
    torch.cuda.synchronize = lambda device=None: None
    for k, v in saved_globals.items():
        g[k] = swaps[v]
    try:
        yield
    finally:
        for name, orig in saved_par.items():
            setattr(par, name, orig)
        for name, orig in saved_cuda.items():
            setattr(torch.cuda, name, orig)
        g.update(saved_globals)


def run_dp(data_parallel_forward, n_devices: int, batch_size: int) -> dict:
    """Run the learner's forward on ``[cuda:0, ..., cuda:n-1]`` (simulated) and a CPU batch; report."""
    torch.manual_seed(0)
    devices = [torch.device("cuda", i) for i in range(n_devices)]
    model = Probe(where="cuda:0")
    ref = copy.deepcopy(model)
    batch = torch.randn(batch_size, 5)
    Probe.calls, Placed.moves, Placed.mixes = [], [], []
    with simulated_gpus(n_devices, data_parallel_forward):
        out = data_parallel_forward(model, place(batch.clone(), "cpu", "batch"), list(devices))
    calls = list(Probe.calls)
    report = {"moves": list(Placed.moves), "mixes": list(Placed.mixes),
              "chunks": [c.shape[0] for c in torch.chunk(batch, n_devices)],
              "devices": [str(d) for d in devices[: len(torch.chunk(batch, n_devices))]],
              "calls": [(size, x_where, m_where) for size, _, x_where, m_where in calls],
              "sizes": sorted(c[0] for c in calls), "instances": len({id(c[1]) for c in calls}),
              "original_runs": sum(c[1] is model for c in calls)}
    if not isinstance(out, torch.Tensor):
        return {**report, "type": type(out).__name__}
    where = getattr(out, "where", "cpu")
    out = plain(out)
    expected = ref(batch).as_subclass(torch.Tensor)
    report.update({"type": "Tensor", "shape": tuple(out.shape), "where": where, "values": out.detach().clone(),
                   "expected": expected.detach().clone(), "grads": "no graph"})
    if out.requires_grad and out.shape == expected.shape:
        weights = torch.randn(expected.shape)
        (out * weights).sum().backward()
        (expected * weights).sum().backward()
        grads = [p.grad for p in model.parameters()]
        if any(g is None for g in grads):
            report["grads"] = "missing"
        elif all(torch.allclose(g, r.grad, atol=1e-5) for g, r in zip(grads, ref.parameters())):
            report["grads"] = "equal"
        else:
            report["grads"] = "different"
    return report


def run_dps(data_parallel_forward, scenarios) -> list:
    """:func:`run_dp` for every ``(n_devices, batch_size)``, each an outcome."""
    from ..sim.outcome import one_thread, outcome

    one_thread()
    return [outcome(run_dp, data_parallel_forward, n, b) for n, b in scenarios]

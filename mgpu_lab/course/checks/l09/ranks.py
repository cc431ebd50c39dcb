"""What lesson 09's checks run inside real ranks; they return plain evidence, judged in :mod:`.checkers`.

- :func:`run_ring`: the learner's ``ring_allreduce`` on several tensors, each call
  recorded with :mod:`mgpu_lab.comm.record` (every send/recv and collective, its peer
  and bytes), next to ``dist.all_reduce``'s answer computed before any of it runs;
- :func:`run_mini_ddp`: the learner's ``MiniDDP`` next to torch's DDP, from different
  weights on each rank, on the same data, for a few SGD steps: the weights after
  construction, both gradients per step, and every collective of the learner's backward
  and ``finish_gradient_sync`` in order, with a mark where backward reached the first
  layer and where it returned;
- :func:`run_feedback`: DDP with the learner's error-feedback hook next to DDP without
  one (different data per rank), then 20 steps on the same data on both ranks with the
  learner's hook, plain bf16 compression and no compression: gradients, what the hook
  all-reduced and returned, the residuals it kept in ``state``.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as tdist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from mgpu_lab.comm.record import record
from .. import _references


# -- ring_allreduce ----------------------------------------------------------------------
def _describe(value) -> dict:
    if not isinstance(value, torch.Tensor):
        return {"type": type(value).__name__}
    value = value.detach()
    return {"type": "Tensor", "shape": list(value.shape), "dtype": str(value.dtype), "device": str(value.device),
            "values": value.cpu().reshape(-1).tolist() if value.device.type != "meta" else None}


def run_ring(ring_allreduce, trials: list) -> list:
    """Probe: one entry per trial ``(shape, dtype name, meta)``; stops at the first error.

    With ``meta`` true, tensors created without a device land on ``meta`` while the
    learner's code runs (``torch.set_default_device``), and a send or receive of a
    tensor that is not on the input's device raises: a buffer made without
    ``device=`` would be a CPU tensor on a GPU rank.
    """
    rank = tdist.get_rank()
    inputs, expected = [], []
    for k, (shape, dtype, _) in enumerate(trials):  # every reference first: no collective after learner code
        g = torch.Generator().manual_seed(7919 * rank + k)
        x = torch.randint(-40, 40, tuple(shape), generator=g).to(getattr(torch, dtype))
        total = x.clone()
        tdist.all_reduce(total)
        inputs.append(x)
        expected.append(total.reshape(-1).tolist())
    out = []
    for (shape, dtype, meta), x, want in zip(trials, inputs, expected):
        entry = {"shape": list(shape), "dtype": dtype, "meta": meta, "expected": want, "events": []}
        out.append(entry)
        log = None
        try:
            with record(ring_allreduce, expect_device=x.device if meta else None) as log:
                if meta:
                    torch.set_default_device("meta")
                try:
                    given = x.clone()
                    got = ring_allreduce(given)
                finally:
                    if meta:
                        torch.set_default_device(None)
            entry["result"] = _describe(got)
            entry["input_changed"] = given.device.type != "meta" and not torch.equal(given, x)
        except NotImplementedError:
            raise
        except Exception as exc:  # noqa: BLE001 - the checker judges it; later trials would see stray messages
            entry["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            entry["events"] = log.events if log is not None else []
            break
        entry["events"] = log.events
    return out


# -- MiniDDP ------------------------------------------------------------------------------
CAP = 1088  # bytes: Net's buckets are 1360, 1088 (exactly at the cap) and 576 bytes
SMALL_CAP = 256  # bytes: smaller than Net's largest parameters (1024): buckets of 272, 1088, 1088 and 576
WORLD = 3  # ranks: an answer that assumes 2 (a hard-coded divisor, halves) fails


class _Mark(torch.autograd.Function):
    """Identity; its backward notes, in the open recording, that backward has reached the first layer."""

    log = None

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if _Mark.log is not None:
            _Mark.log.events.append({"op": "mark", "at": "first layer"})
        return grad


class Net(nn.Module):
    """Four Linear layers of unequal sizes, a buffer that differs per seed; optionally a frozen parameter last.

    Parameter bytes in registration order: 512, 64, 1024, 64, 1024, 64, 256, 16. The buffer
    ``shift`` (16 values, ``seed / 10``) is added after the first layer, so a rank that
    keeps its own buffer computes other gradients than DDP, which broadcasts rank 0's.
    """

    def __init__(self, seed: int, frozen: bool = False):
        super().__init__()
        torch.manual_seed(seed)
        self.l0, self.l1, self.l2, self.l3 = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.register_buffer("shift", torch.full((16,), seed / 10))
        if frozen:
            self.scale = nn.Parameter(torch.full((4,), 0.5), requires_grad=False)

    def forward(self, x):
        h = _Mark.apply(torch.tanh(self.l0(x) + self.shift))
        out = self.l3(torch.tanh(self.l2(torch.tanh(self.l1(h)))))
        return out * self.scale if hasattr(self, "scale") else out


def _error(exc) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:400]


def _grads(model) -> list:
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters() if p.requires_grad]


class _WatchedWork:
    """An asynchronous all-reduce's Work that notes, in the recording, when ``wait()`` is called on it.

    ``get_future()`` hands out the real future (``torch.futures.wait_all`` and ``then`` need it), so a
    wait on the future goes unseen: such an answer is judged by when its all-reduces start only.
    """

    def __init__(self, work, note):
        self._work, self._note = work, note

    def wait(self, *args, **kwargs):
        self._note()
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


@contextmanager
def _async_spy(flags: list, log):
    """Note ``async_op`` of every ``dist.all_reduce`` call while the block runs (inside the recording ``log``),
    and put ``{"op": "wait", "call": "Work.wait", "index": k}`` in ``log`` when the k-th all-reduce's Work
    is waited on: a hook that waits at once overlaps nothing, whatever ``async_op`` says."""
    inner = tdist.all_reduce

    def spy(tensor, op=tdist.ReduceOp.SUM, group=None, async_op=False):
        index = len(flags)
        flags.append(bool(async_op))
        work = inner(tensor, op=op, group=group, async_op=async_op)
        if work is None:
            return None

        def note():
            log.events.append({"op": "wait", "call": "Work.wait", "index": index})

        return _WatchedWork(work, note)

    tdist.all_reduce = spy
    try:
        yield
    finally:
        tdist.all_reduce = inner


def _local_grads(model, x) -> list:
    """This rank's own gradients (no averaging), from copies of the parameters that carry no hooks."""
    named = {n: p.detach().clone().requires_grad_(p.requires_grad) for n, p in model.named_parameters()}
    loss = torch.func.functional_call(model, named, (x,)).square().mean()
    leaves = [p for p in named.values() if p.requires_grad]
    return list(torch.autograd.grad(loss, leaves))


def _mini_steps(mini, model, ref, steps: int, out: dict) -> None:
    rank = tdist.get_rank()
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(steps):
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(31 * rank + step))
        ref_opt.zero_grad()
        ref(x).square().mean().backward()
        entry = {"ref": _grads(ref.module), "events": [], "async": [], "local": _local_grads(model, x)}
        out["steps"].append(entry)
        opt.zero_grad()
        loss = mini(x).square().mean()
        with record() as log, _async_spy(entry["async"], log):
            _Mark.log = log
            try:
                loss.backward()
                log.events.append({"op": "mark", "at": "backward returned"})
                mini.finish_gradient_sync()
            finally:
                _Mark.log = None
        entry["events"] = [e for e in log.events if e["op"] != "barrier"]
        entry["mini"] = _grads(model)
        opt.step()
        ref_opt.step()


_BUCKETING = "_compute_bucket_assignment_by_size"


def _holds_bucketing(mini_cls) -> bool:
    """Whether a method of the answer names torch's C++ bucketing function through a global that is it
    (imported by name before the ranks started, so no attribute swap reaches it)."""
    import types

    original = getattr(tdist, _BUCKETING, None)
    for value in vars(mini_cls).values():
        fn = getattr(value, "__func__", value)
        if not isinstance(fn, types.FunctionType):
            continue
        codes = [fn.__code__]
        while codes:
            code = codes.pop()
            if any(fn.__globals__.get(n) is original for n in code.co_names):
                return True
            codes += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return False


@contextmanager
def _no_torch_bucketing(mini_cls=None):
    """``torch.distributed._compute_bucket_assignment_by_size`` (C++, DDP's bucketing) as a tripwire meanwhile.

    A C++ function cannot carry the code-object tripwire of :mod:`.._references`, so the
    attributes an answer would reach it by (on ``torch.distributed`` and on the C extension
    module it comes from) are swapped for one while the learner's code runs, and an answer
    whose methods name it through a global that holds it trips at once.
    """
    import torch._C._distributed_c10d as c10d_ext

    name = "torch.distributed:" + _BUCKETING
    original = getattr(tdist, _BUCKETING, None)
    if original is None:
        yield
        return
    if mini_cls is not None and _holds_bucketing(mini_cls):
        _references.called(name)

    def tripwire(*args, **kwargs):
        _references.called(name)

    modules = [m for m in (tdist, c10d_ext) if getattr(m, _BUCKETING, None) is original]
    for module in modules:
        setattr(module, _BUCKETING, tripwire)
    try:
        yield
    finally:
        for module in modules:
            setattr(module, _BUCKETING, original)


def _state(model) -> list:
    """A model's parameters and buffers, detached copies, in registration order."""
    return [t.detach().clone() for t in [*model.parameters(), *model.buffers()]]


def run_mini_ddp(mini_cls, frozen: bool = False, steps: int = 3, cap: int = CAP) -> dict:
    """Probe: ``mini_cls(Net(1 + rank), cap)`` against ``DDP(Net(1 + rank), bucket_cap_mb=cap / 2**20)``.

    Both start from weights and buffers that differ between ranks (DDP broadcasts rank 0's);
    every step feeds each rank its own batch. ``frozen`` adds a parameter that requires no
    gradient; a ``cap`` below the largest parameter's bytes puts that parameter alone over it.
    """
    rank = tdist.get_rank()
    out = {"error": None, "start": None, "steps": [], "sizes": None, "cap": cap}
    with _references.allowed():
        ref = DDP(Net(1 + rank, frozen), bucket_cap_mb=cap / 2**20)
    model = Net(1 + rank, frozen)
    out["sizes"] = [p.numel() * p.element_size() for p in model.parameters() if p.requires_grad]
    out["n_params"] = len(list(model.parameters()))
    try:
        with _no_torch_bucketing(mini_cls):
            mini = mini_cls(model, cap)
        out["start"], out["rank0"] = _state(model), _state(Net(1, frozen))
        with _no_torch_bucketing():
            _mini_steps(mini, model, ref, steps, out)
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001 - the checker judges it
        out["error"] = _error(exc)
    return out


def run_mini_all(mini_cls) -> dict:
    """Probe: :func:`run_mini_ddp` as it is, with a frozen parameter, and with a cap below the largest
    parameter, in the same ranks."""
    return {"plain": run_mini_ddp(mini_cls), "frozen": run_mini_ddp(mini_cls, frozen=True, steps=2),
            "small_cap": run_mini_ddp(mini_cls, steps=1, cap=SMALL_CAP)}


# -- error_feedback_hook -------------------------------------------------------------------
def hook_model() -> nn.Module:
    """Three layers, the same weights on every rank and in every DDP."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def plain_bf16(state, bucket):
    """The check's yardstick: bf16 compression without error feedback."""
    buffer = bucket.buffer()
    low = buffer.to(torch.bfloat16).div_(tdist.get_world_size())
    return tdist.all_reduce(low, async_op=True).get_future().then(lambda fut: buffer.copy_(fut.value()[0]))


def _watched(hook, seen: list):
    """``hook`` wrapped: note each bucket (index, size, largest gradient) and what the future returns."""

    def watched(state, bucket):
        buffer = bucket.buffer()
        want = {"index": bucket.index(), "numel": buffer.numel(), "buffer_dtype": str(buffer.dtype),
                "buffer_shape": list(buffer.shape), "largest": float(buffer.abs().max())}
        fut = hook(state, bucket)
        if not isinstance(fut, torch._C.Future):  # what .then() returns is the C class, not torch.futures.Future
            seen.append({**want, "type": type(fut).__name__})
            return fut

        def note(f):
            value = f.value()
            seen.append({**want, **_describe(value)})
            return value

        return fut.then(note)

    return watched


def _train_hooked(hook, state, batches, watch=None) -> tuple:
    """DDP with ``hook`` (None: DDP's own all-reduce) on ``batches``; gradients per step, events."""
    ddp = DDP(hook_model(), bucket_cap_mb=0.002)
    if hook is not None:
        ddp.register_comm_hook(state, hook if watch is None else _watched(hook, watch))
    grads, events = [], []
    for x in batches:
        ddp.zero_grad()
        loss = ddp(x).square().mean()
        with record(hook) if hook is not None else _nothing() as log:
            loss.backward()
        events += [e for e in (log.events if log else []) if e["op"] != "barrier"]
        grads.append([p.grad.detach().clone() for p in ddp.module.parameters()])
    return grads, events


@contextmanager
def _nothing():
    yield None


def _residuals(state) -> dict:
    return {k: {"type": type(v).__name__, "numel": v.numel() if isinstance(v, torch.Tensor) else None,
                "dtype": str(v.dtype) if isinstance(v, torch.Tensor) else None,
                "largest": float(v.detach().abs().max()) if isinstance(v, torch.Tensor) and v.numel() else 0.0}
            for k, v in state.items()}


def run_feedback(hook, steps: int = 3, long: int = 20) -> dict:
    """Probe: the learner's hook on DDP (a dict as its state) against DDP without a hook, then 20 steps.

    First ``steps`` steps with a different batch on each rank: both gradients per step, the
    events, what the hook returned, the residuals it kept. Then ``long`` steps with the same
    batch on both ranks (so that the all-reduce's own bf16 sum is exact): the summed
    gradients with no compression, plain bf16 compression and the learner's hook.
    """
    rank = tdist.get_rank()
    out = {"error": None, "state_type": None}
    g = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randn(8, 16, generator=g) for _ in range(steps)]
    exact, _ = _train_hooked(None, None, batches)
    state, seen = {}, []
    out.update(exact=exact, seen=seen)
    try:
        out["hooked"], out["events"] = _train_hooked(hook, state, batches, seen)
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001 - DDP refused the hook's answer, or the hook raised
        out["error"] = _error(exc)
        return out
    out["residuals"] = _residuals({k: v for k, v in state.items() if isinstance(k, int)})
    out["keys"] = sorted(map(repr, state))
    g = torch.Generator().manual_seed(7)  # the same on both ranks
    same = [torch.randn(8, 16, generator=g) * (1 + torch.rand(8, 1, generator=g)) for _ in range(long)]
    sums = {}
    for name, fn in (("exact", None), ("plain", plain_bf16), ("hooked", hook)):
        try:
            grads, events = _train_hooked(fn, {}, same, [] if fn is not None else None)
        except NotImplementedError:
            raise
        except Exception as exc:  # noqa: BLE001 - judged by the checker
            out["long_error"] = _error(exc)
            return out
        if name == "hooked":
            out["long_sent"] = [e["dtype"] for e in events if e["op"] == "all_reduce"]
        sums[name] = torch.cat([torch.stack([gr[i] for gr in grads]).sum(0).reshape(-1)
                                for i in range(len(grads[0]))])
    out["long"] = {"plain": float((sums["plain"] - sums["exact"]).norm()),
                   "hooked": float((sums["hooked"] - sums["exact"]).norm()),
                   "norm": float(sums["exact"].norm())}
    return out

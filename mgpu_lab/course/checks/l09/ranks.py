"""What lesson 09's checks run inside real ranks; they return plain evidence, judged in :mod:`.checkers`.

- :func:`run_ring`: the learner's ``ring_allreduce`` on several tensors, each call
  recorded with :mod:`mgpu_lab.comm.record` (every send/recv and collective, its peer
  and bytes), next to ``dist.all_reduce``'s answer computed before any of it runs;
- :func:`call_all`: the learner's ``bucket_assignment`` on many inputs, in one process;
- :func:`run_hook`: DDP with the learner's communication hook next to DDP without
  one, from the same weights on the same data: both gradients, the dtypes handed to
  all_reduce inside the hook, and the dtype and shape of what the hook's future returns.
"""
from __future__ import annotations

import torch
import torch.distributed as tdist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from mgpu_lab.comm.record import record
from ..sim.outcome import outcomes


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
                    got = ring_allreduce(x.clone())
                finally:
                    if meta:
                        torch.set_default_device(None)
            entry["result"] = _describe(got)
        except NotImplementedError:
            raise
        except Exception as exc:  # noqa: BLE001 - the checker judges it; later trials would see stray messages
            entry["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            entry["events"] = log.events if log is not None else []
            break
        entry["events"] = log.events
    return out


# -- bucket_assignment -------------------------------------------------------------------
def call_all(fn, cases: list) -> list:
    """Probe: ``fn(*case)`` for every case: ``("ok", buckets as lists of ints)`` or ``("raised", type, message)``."""
    return outcomes(fn, cases, keep=lambda got: [[int(i) for i in bucket] for bucket in got])


# -- bf16_compress_hook ------------------------------------------------------------------
def hook_model(dtype: torch.dtype) -> nn.Module:
    """Three layers, the same weights on every rank and in both DDPs."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)).to(dtype)


def run_hook(hook, dtype_name: str = "float32", steps: int = 2) -> dict:
    """Probe: gradients of DDP with ``hook`` and without, per step; what went through the hook.

    ``bucket_cap_mb`` is small so that the model's gradients fill several buckets.
    """
    dtype = getattr(torch, dtype_name)
    rank = tdist.get_rank()
    plain, hooked = DDP(hook_model(dtype), bucket_cap_mb=0.002), DDP(hook_model(dtype), bucket_cap_mb=0.002)
    returned: list = []

    def watched(state, bucket):
        buffer = bucket.buffer()
        fut = hook(state, bucket)
        if not isinstance(fut, torch._C.Future):  # what .then() returns is the C class, not torch.futures.Future
            returned.append({"type": type(fut).__name__})
            return fut
        want = {"buffer_dtype": str(buffer.dtype), "buffer_shape": list(buffer.shape)}

        def note(f):
            value = f.value()
            returned.append({**want, **_describe(value)})
            return value

        return fut.then(note)

    hooked.register_comm_hook(None, watched)
    g = torch.Generator().manual_seed(100 + rank)
    out = {"steps": [], "error": None, "events": [], "returned": returned}
    for _ in range(steps):
        x = torch.randn(8, 16, generator=g).to(dtype)
        step = {}
        for name, ddp in (("plain", plain), ("hooked", hooked)):
            ddp.zero_grad()
            loss = ddp(x).square().mean()
            if name == "plain":
                loss.backward()
            else:
                try:
                    with record(hook) as log:
                        loss.backward()
                except NotImplementedError:
                    raise
                except Exception as exc:  # noqa: BLE001 - DDP refused the hook's answer, or the hook raised
                    out["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:400]
                    return out
                out["events"] += [e for e in log.events if e["op"] != "barrier"]
            step[name] = [p.grad.detach().clone() for p in ddp.module.parameters()]
        out["steps"].append(step)
    return out

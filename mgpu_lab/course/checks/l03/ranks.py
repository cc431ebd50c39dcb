"""What lesson 03's checks run in a fresh process: the learner's DataParallel forward on simulated GPUs.

:func:`run_dp` hands the learner's ``data_parallel_forward`` a batch and the
device list ``[cuda:0, cuda:1, ...]`` on any machine. The batch is a tracked
:class:`..sim.devices.Placed` tensor: everything derived from it knows the
(simulated) device it is on, ``.to``/``.cuda``/``.cpu`` move it there by name
(its data stays on the CPU), and an operation that combines tensors of two
devices is recorded, as a GPU would refuse it. Inside the process ``torch.cuda``
names the GPUs (:func:`..sim.cuda.simulated_gpus`) and PyTorch's ``replicate``,
``parallel_apply``, ``scatter`` and ``gather`` are CPU stand-ins that place
replicas on the named devices (:func:`..sim.parallel.virtual_data_parallel`).
The model (:func:`probe_model`) records, for every chunk, its size, the replica
that ran it, where the chunk was and where that replica was. The evidence is
plain data that :mod:`.checkers` judges.
"""
from __future__ import annotations

import copy
import torch
from torch import nn

from ..sim.cuda import simulated_gpus
from ..sim.devices import place, Placed, PlacedModule, plain, reset, where
from ..sim.outcome import one_thread, outcome
from ..sim.parallel import virtual_data_parallel


def run_split(split_batch, calls) -> list:
    """``split_batch(batch, n)`` for every ``(batch, n)``: the chunks as a list, or what else came."""
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


# -- data_parallel_forward ----------------------------------------------------------------
def probe_model() -> PlacedModule:
    """A small MLP on cuda:0 (simulated) whose every forward is recorded (:attr:`PlacedModule.inputs`)."""
    return PlacedModule(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3), name="model", out_tag="output", device="cuda:0")


def run_dp(data_parallel_forward, n_devices: int, batch_size: int) -> dict:
    """Run the learner's forward on ``[cuda:0, ..., cuda:n-1]`` (simulated) and a CPU batch; report."""
    torch.manual_seed(0)
    devices = [torch.device("cuda", i) for i in range(n_devices)]
    model = probe_model()
    ref = copy.deepcopy(model)
    batch = torch.randn(batch_size, 5)
    reset()
    with simulated_gpus(n_devices), virtual_data_parallel(data_parallel_forward):
        out = data_parallel_forward(model, place(batch.clone(), "batch"), list(devices))
    # The log keeps the modules themselves, not their id(): a replica made and dropped inside
    # a loop can be freed and its id reused by the next one.
    calls = list(PlacedModule.inputs)  # (module, chunk's tag, chunk's device, module's device, size)
    report = {"moves": list(Placed.moves), "mixes": list(Placed.mixes),
              "chunks": [c.shape[0] for c in torch.chunk(batch, n_devices)],
              "devices": [str(d) for d in devices[: len(torch.chunk(batch, n_devices))]],
              "calls": [(size, x_on, m_on) for _, _, x_on, m_on, size in calls],
              "sizes": sorted(c[4] for c in calls), "instances": len({id(c[0]) for c in calls}),
              "original_runs": sum(c[0] is model for c in calls)}
    if not isinstance(out, torch.Tensor):
        return {**report, "type": type(out).__name__}
    on = str(where(out))
    out = plain(out)
    expected = plain(ref(batch))
    report.update({"type": "Tensor", "shape": tuple(out.shape), "where": on, "values": out.detach().clone(),
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
    one_thread()
    return [outcome(run_dp, data_parallel_forward, n, b) for n, b in scenarios]

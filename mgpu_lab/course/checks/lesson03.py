"""Checks of lesson 03 (nn.DataParallel): split_batch, data_parallel_forward.

``data_parallel_forward`` is judged with CPU "devices" (``[cpu, cpu]``...), where
every tensor already is on ``devices[0]``; so that the bugs that only break on
GPUs still show, the probe model records what happens inside: the size of every
chunk its forward sees, which module instance ran it, and whether each output
was moved (``.to``/``.cuda``/``.cpu``) to ``devices[0]`` before being gathered.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from ._core import exercise


# -- split_batch -----------------------------------------------------------------------
def run_split(split_batch, batch: torch.Tensor, n: int):
    """The learner's chunks as a list (tensors), or what else came back."""
    got = split_batch(batch, n)
    if isinstance(got, (list, tuple)) and all(isinstance(c, torch.Tensor) for c in got):
        return list(got)
    return ("not a list of tensors", type(got).__name__)


def _sizes(chunks) -> list:
    return [tuple(c.shape) for c in chunks]


SPLIT_CASES = [  # name, batch, n, hint, hidden
    ("10 samples on 3 devices: chunks of 4, 4 and 2 samples, in order", torch.arange(10), 3,
     "torch.chunk(batch, n, dim=0): chunks of ceil(B / n) samples, the last one smaller, in batch order",
     False),
    ("a (7, 3) batch on 4 devices splits the samples (dim 0): (2, 3), (2, 3), (2, 3), (1, 3)",
     torch.arange(21.0).reshape(7, 3), 4,
     "split along dim 0, the batch dimension; every chunk keeps all the features", False),
    ("3 samples on 5 devices: 3 chunks of one sample, no empty chunks", torch.arange(3), 5,
     "when the batch is smaller than n, DataParallel uses fewer devices: torch.chunk returns fewer "
     "chunks; torch.tensor_split would return empty ones", False),
    ("6 samples on 4 devices: 3 chunks of 2, as torch.chunk gives", torch.arange(12).reshape(6, 2), 4, "", True),
    ("n=1: the whole batch as one chunk", torch.arange(5), 1, "with one device the only chunk is the batch", False),
]


@exercise("03.split_batch", points=6, description="split_batch(batch, n): the chunks DataParallel's scatter "
          "gives n devices (torch.chunk along dim 0); ValueError for n < 1")
def _split(t, split_batch):
    for name, batch, n, hint, hidden in SPLIT_CASES:
        with t.case(name, hidden=hidden, hint=hint):
            got = t.call(run_split, split_batch, batch, n)
            if isinstance(got, tuple):
                t.fail("return a list of tensors", "list of tensors", got[1])
            expected = list(torch.chunk(batch, n, dim=0))
            t.equal(_sizes(got), _sizes(expected))
            if not all(torch.equal(a, b) for a, b in zip(got, expected)):
                t.fail("keep the samples in batch order: chunk i holds the next samples after chunk i-1",
                       [c.tolist() for c in expected], [c.tolist() for c in got])
    with t.case("n=0 and n=-2 raise ValueError",
                hint="check n >= 1 first: raise ValueError(f'n={n}: ...') (torch.chunk's own error is a "
                     "RuntimeError)"):
        for n in (0, -2):
            got = t.call(split_batch, torch.arange(4), n, catch=True)
            if got[0] != "raised" or got[1] != "ValueError":
                t.fail("", f"ValueError for n={n}", f"{got[1]}: {got[2]}" if got[0] == "raised" else
                       f"returned {got[1]!r}")


# -- data_parallel_forward ----------------------------------------------------------------
class Moved(torch.Tensor):
    """An output tensor that records every move (``to``/``cuda``/``cpu``): the device it went to."""

    moves: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if func in (torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu) and isinstance(out, torch.Tensor):
            Moved.moves.append(str(out.device))
        if isinstance(out, Moved):  # only the replicas' own outputs are tracked
            out = out.as_subclass(torch.Tensor)
        return out


class Probe(nn.Module):
    """A small MLP whose forward records the chunk size and the module instance that ran it."""

    calls: list = []

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))

    def forward(self, x):
        # Keep the module itself, not its id(): a replica made and dropped inside a
        # loop can be freed and its id reused by the next one.
        Probe.calls.append((int(x.shape[0]), self))
        return self.net(x).as_subclass(Moved)


def run_dp(data_parallel_forward, n_devices: int, batch_size: int) -> dict:
    """Run the learner's forward with ``n_devices`` CPU devices; report what happened inside."""
    torch.manual_seed(0)
    model = Probe()
    ref = copy.deepcopy(model)
    batch = torch.randn(batch_size, 5)
    devices = [torch.device("cpu")] * n_devices
    Probe.calls, Moved.moves = [], []
    out = data_parallel_forward(model, batch, devices)
    calls, moves = list(Probe.calls), list(Moved.moves)
    if not isinstance(out, torch.Tensor):
        return {"type": type(out).__name__}
    out = out.as_subclass(torch.Tensor)
    expected = ref(batch).as_subclass(torch.Tensor)
    report = {"type": "Tensor", "shape": tuple(out.shape), "device": str(out.device),
              "values": out.detach().clone(), "expected": expected.detach().clone(),
              "sizes": sorted(c[0] for c in calls), "chunks": [c.shape[0] for c in torch.chunk(batch, n_devices)],
              "instances": len({id(c[1]) for c in calls}), "original_runs": sum(c[1] is model for c in calls),
              "moves": moves.count(str(devices[0])), "grads": "no graph"}
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


REPLICATE_HINT = ("make the replicas with mgpu_lab.data_parallel.replicate(model, devices) (on GPUs "
                  "torch.nn.parallel.replicate): copies that stay linked to the model through autograd")


@exercise("03.data_parallel_forward", points=6, description="data_parallel_forward(model, batch, devices): "
          "split, replicate, apply each replica on its device, gather on devices[0]; equals model(batch), "
          "gradients reach the model")
def _dp_forward(t, data_parallel_forward):
    two = three = None
    with t.case("2 CPU devices, 10 samples: the output equals model(batch)",
                hint="split the batch, run replica i on chunk i, concatenate the outputs in chunk order"):
        two = t.call(run_dp, data_parallel_forward, 2, 10)
        if two["type"] != "Tensor":
            t.fail("return the gathered output tensor", "Tensor", two["type"])
        t.equal(two["shape"], tuple(two["expected"].shape))
        t.close(two["values"], two["expected"])
    with t.case("3 devices, 10 samples: the model's forward sees chunks of 4, 4 and 2 samples",
                hint="scatter first: each replica gets its own chunk of the batch (split along dim 0 like "
                     "torch.chunk), never the whole batch"):
        three = t.call(run_dp, data_parallel_forward, 3, 10)
        if three.get("type") != "Tensor":
            t.fail("return the gathered output tensor", "Tensor", three.get("type"))
        t.equal(three["sizes"], sorted(three["chunks"]))
    with t.case("every chunk runs on its own replica, not all through the original model",
                hint="the original model lives on devices[0]; on a GPU, running it on a chunk that was sent "
                     f"to cuda:1 fails; {REPLICATE_HINT}"):
        if three is None or three.get("type") != "Tensor":
            t.fail("the previous case did not finish")
        if three["instances"] < len(three["chunks"]) or three["original_runs"] > 1:
            t.fail("", f"{len(three['chunks'])} module instances, one per chunk",
                   f"{three['instances']} instance(s); the original model ran {three['original_runs']} time(s)")
    with t.case("each replica's output is moved to devices[0] before concatenating; the result is there",
                hint="gather: torch.cat([out.to(devices[0]) for out in outputs]); on GPUs torch.cat refuses "
                     "tensors that live on different devices"):
        if three is None or three.get("type") != "Tensor":
            t.fail("the previous case did not finish")
        if three["moves"] < len(three["chunks"]) or three["device"] != "cpu":
            t.fail("", f"{len(three['chunks'])} outputs moved to devices[0]",
                   f"{three['moves']} moved; result on {three['device']}")
    with t.case("gradients reach the original model's parameters, equal to those of model(batch)",
                hint=f"copy.deepcopy or .to() of the module cuts the graph: {REPLICATE_HINT}"):
        if three is None or three.get("type") != "Tensor":
            t.fail("the previous case did not finish")
        t.equal(three["grads"], "equal")
    with t.case("3 samples on 4 devices (fewer chunks than devices): equals model(batch)", hidden=True):
        few = t.call(run_dp, data_parallel_forward, 4, 3)
        if few.get("type") != "Tensor" or few["shape"] != tuple(few["expected"].shape):
            t.fail("use only as many replicas as there are chunks")
        t.close(few["values"], few["expected"])

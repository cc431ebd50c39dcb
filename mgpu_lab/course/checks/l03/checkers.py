"""Checks of lesson 03 (nn.DataParallel): split_batch, data_parallel_forward.

Each check runs the learner's code once, in one fresh process, for all its
cases (:mod:`.ranks`). ``data_parallel_forward`` is judged on simulated GPUs
(``[cuda:0, cuda:1, cuda:2]`` on any machine): the batch and everything made
from it know which device they are on, PyTorch's DataParallel pieces place
replicas on the named devices, and the probe model records, for every chunk,
its size, the replica that ran it, where the chunk was and where the replica
was; an operation given tensors of two devices is recorded as a GPU would
refuse it. So the bugs that only break on GPUs show on a CPU.
"""
from __future__ import annotations

import torch

from .._core import exercise
from ..sim.outcome import in_words
from .judges import dp, need, chunk_shapes
from .ranks import run_dps, run_split


SPLIT_CASES = [  # name, batch, n, hint, hidden
    ("10 samples on 3 devices: chunks of 4, 4 and 2 samples, in order", torch.arange(10), 3,
     "torch.chunk(batch, n, dim=0): n chunks of ceil(B / n) samples, the last one smaller, in batch order "
     "(torch.split(batch, n) makes chunks of n samples instead)", False),
    ("a (7, 3) batch on 4 devices splits the samples (dim 0): (2, 3), (2, 3), (2, 3), (1, 3)",
     torch.arange(21.0).reshape(7, 3), 4,
     "split along dim 0, the batch dimension; every chunk keeps all the features", False),
    ("3 samples on 5 devices: 3 chunks of one sample, no empty chunks", torch.arange(3), 5,
     "when the batch is smaller than n, DataParallel uses fewer devices: torch.chunk returns fewer "
     "chunks; torch.tensor_split would return empty ones", False),
    ("6 samples on 4 devices: 3 chunks of 2, as torch.chunk gives", torch.arange(12).reshape(6, 2), 4, "", True),
    ("n=1: the whole batch as one chunk", torch.arange(5), 1, "with one device the only chunk is the batch "
     "(n=1 is valid: refuse only n < 1)", False),
]


@exercise("03.split_batch", points=6, description="split_batch(batch, n): the chunks DataParallel's scatter "
          "gives n devices (torch.chunk along dim 0); ValueError for n < 1")
def _split(t, split_batch):
    """Catches: torch.tensor_split (empty chunks), torch.split(batch, n) (chunks of n samples), the last
    dimension split, chunks out of order, floor-sized slices that drop samples, n=1 refused, no
    ValueError for n < 1 (torch.chunk's own error is a RuntimeError)."""
    calls = [(batch, n) for _, batch, n, _, _ in SPLIT_CASES] + [(torch.arange(4), 0), (torch.arange(4), -2)]
    got = None
    for i, (name, batch, n, hint, hidden) in enumerate(SPLIT_CASES):
        with t.case(name, hidden=hidden, hint=hint):
            if i == 0:
                got = t.call(run_split, split_batch, calls)
            need(t, got)
            result = got[i]
            if result[0] == "raised":
                t.fail("", "a list of tensors", in_words(result, raised=""))
            if isinstance(result[1], str):
                t.fail("return a list of tensors", "list of tensors", result[1])
            expected = list(torch.chunk(batch, n, dim=0))
            t.equal(chunk_shapes(result[1]), chunk_shapes(expected))
            if not all(torch.equal(a, b) for a, b in zip(result[1], expected)):
                t.fail("keep the samples in batch order: chunk i holds the next samples after chunk i-1",
                       [c.tolist() for c in expected], [c.tolist() for c in result[1]])
    with t.case("n=0 and n=-2 raise ValueError",
                hint="check n >= 1 first: raise ValueError(f'n={n}: ...') (torch.chunk's own error is a "
                     "RuntimeError)"):
        need(t, got)
        for result, n in zip(got[len(SPLIT_CASES):], (0, -2)):
            if result[0] != "raised" or result[1] != "ValueError":
                t.fail("", f"ValueError for n={n}", in_words(result, raised=""))


# -- data_parallel_forward ----------------------------------------------------------------
REPLICATE_HINT = ("make the replicas with mgpu_lab.parallel.data_parallel.replicate(model, devices) (on GPUs "
                  "torch.nn.parallel.replicate): copies that stay linked to the model through autograd")


DP_SCENARIOS = [(3, 10), (4, 3)]  # (simulated GPUs, samples): the main case, and fewer chunks than devices


@exercise("03.data_parallel_forward", points=7, description="data_parallel_forward(model, batch, devices): "
          "split, move chunk i to devices[i], replicate, apply each replica on its device, gather on "
          "devices[0]; equals model(batch), gradients reach the model")
def _dp_forward(t, data_parallel_forward):
    """Runs on simulated ``[cuda:0, cuda:1, cuda:2]``. Catches: chunks never moved, all moved to
    ``devices[0]`` or to ``"cpu"``; the whole batch to every replica; the original model (or replicas all
    on ``devices[0]``) running every chunk; ``copy.deepcopy`` or ``no_grad`` replicas (no gradients);
    ``torch.cat`` before moving the outputs; the result gathered elsewhere than ``devices[0]``; one
    replica per device when there are fewer chunks than devices."""
    runs = None
    with t.case("3 GPUs (simulated: cuda:0, cuda:1, cuda:2), 10 samples: the output equals model(batch)",
                hint="split the batch, run replica i on chunk i, concatenate the outputs in chunk order"):
        runs = t.call(run_dps, data_parallel_forward, DP_SCENARIOS)
        three = dp(t, runs, 0)
        t.equal(three["shape"], tuple(three["expected"].shape))
        t.close(three["values"], three["expected"])
    with t.case("the model's forward sees chunks of 4, 4 and 2 samples",
                hint="scatter first: each replica gets its own chunk of the batch (split along dim 0 like "
                     "torch.chunk), never the whole batch"):
        three = dp(t, runs, 0)
        t.equal(three["sizes"], sorted(three["chunks"]))
    with t.case("chunk i is moved to devices[i]: one chunk on each of cuda:0, cuda:1, cuda:2",
                hint="move chunk i to devices[i] (chunk.to(device)) before its replica runs on it: the batch "
                     "comes from the CPU, and on GPUs a chunk left elsewhere fails with 'Expected all "
                     "tensors to be on the same device'"):
        three = dp(t, runs, 0)
        chunk_devices = sorted(x for _, x, _ in three["calls"])
        if chunk_devices != three["devices"]:
            t.fail("", f"chunks on {three['devices']}", f"chunks on {chunk_devices}")
    with t.case("every chunk runs on its own replica, placed on that chunk's device",
                hint="the original model lives on devices[0]; on a GPU, running it (or a replica made for "
                     f"devices[0]) on a chunk on cuda:1 fails; one replica per chunk: {REPLICATE_HINT}"):
        three = dp(t, runs, 0)
        if three["instances"] < len(three["chunks"]) or three["original_runs"] > 1:
            t.fail("", f"{len(three['chunks'])} module instances, one per chunk",
                   f"{three['instances']} instance(s); the original model ran {three['original_runs']} time(s)")
        wrong = [(x, m) for _, x, m in three["calls"] if x != m]
        if wrong:
            t.fail("", "each replica on its chunk's device",
                   "; ".join(f"a replica on {m} ran a chunk on {x}" for x, m in wrong))
    with t.case("each output is moved to devices[0] before torch.cat; the result is on devices[0] (cuda:0)",
                hint="gather: torch.cat([out.to(devices[0]) for out in outputs]); on GPUs torch.cat refuses "
                     "tensors that live on different devices"):
        three = dp(t, runs, 0)
        if three["mixes"]:
            op, devices = three["mixes"][0]
            t.fail("", "one device per operation", f"{op} was given tensors on {', '.join(devices)}")
        if three["where"] != "cuda:0":
            t.fail("gather the outputs on devices[0], not on the CPU or another GPU", "the result on cuda:0",
                   f"the result on {three['where']}")
    with t.case("gradients reach the original model's parameters, equal to those of model(batch)",
                hint=f"copy.deepcopy, a module's .to() or torch.no_grad() cut the graph: {REPLICATE_HINT}"):
        three = dp(t, runs, 0)
        t.equal(three["grads"], "equal")
    with t.case("3 samples on 4 GPUs (fewer chunks than devices): equals model(batch), 3 replicas", hidden=True,
                hint="use only as many replicas (and devices) as there are chunks: devices[:len(chunks)]"):
        few = dp(t, runs, 1)
        if few["shape"] != tuple(few["expected"].shape):
            t.fail("", str(tuple(few["expected"].shape)), str(few["shape"]))
        t.close(few["values"], few["expected"])

"""Checks of lesson 03 (nn.DataParallel): replicate, data_parallel_forward.

Each check runs the learner's code once, in one fresh process, for all its
cases (:mod:`.ranks`), on simulated GPUs (``[cuda:0, cuda:1, cuda:2]`` on any
machine): the check's model starts on ``cuda:0``, its parameters and buffers
know where they are and so does everything computed from them; a tensor's
``.to(device)`` is a differentiable copy by name, and an operation given tensors
of two devices is recorded, as a GPU would refuse it. So the bugs that only break
on GPUs show on a CPU.
"""
from __future__ import annotations

from .._core import exercise
from .judges import dp, grad_words, misplaced, replicas
from .ranks import run_dps, run_replicate

TORCH_REPLICATE = ("torch.nn.parallel:replicate", "torch.nn.parallel.replicate:replicate",
                   "torch.nn.parallel.replicate:_broadcast_coalesced_reshape",
                   "torch.nn.parallel._functions:Broadcast.forward",
                   "torch.nn.modules.module:Module._replicate_for_data_parallel")  # torch's per-module copy
REPLICATE_REFS = ("mgpu_lab.parallel.data_parallel:StepByStepDataParallel.replicas",
                  "mgpu_lab.course.checks.l03.ranks:reference_replicate", *TORCH_REPLICATE)
DP_REFS = ("mgpu_lab.parallel.data_parallel:StepByStepDataParallel.replicas", "mgpu_lab.parallel.data_parallel:scatter",
           "mgpu_lab.parallel.data_parallel:gather", "mgpu_lab.parallel.data_parallel:StepByStepDataParallel.forward",
           *TORCH_REPLICATE, "torch.nn.parallel:scatter", "torch.nn.parallel:gather",
           "torch.nn.parallel:data_parallel", "torch.nn.parallel:DataParallel.forward")

THREE = [f"cuda:{i}" for i in range(3)]
REPLICATE_SCENARIOS = [(3, THREE), (4, ["cuda:0", "cuda:3"])]  # (simulated GPUs, devices)


@exercise("03.replicate", points=6, references=REPLICATE_REFS,
          description="replicate(module, devices): one replica per device, each on its device, linked to the "
                      "module by autograd (a backward through all of them sums into the module's .grad)")
def _replicate(t, replicate):
    """Runs on simulated ``[cuda:0, cuda:1, cuda:2]``. Catches: the model itself returned for every device;
    parameters detached, made new ``nn.Parameter`` leaves or deep-copied (no gradient reaches the model);
    every replica on ``devices[0]``; buffers left behind; nested modules shared with the model; the model's
    own modules rewired instead of copied; device names made from indices instead of the devices given."""
    runs = None
    with t.case("3 simulated GPUs: replicate(model, [cuda:0, cuda:1, cuda:2]) gives 3 replicas that compute "
                "what the model computes",
                hint="each replica holds the model's current weights and computes the same function; one "
                     "replica per device, in the order of devices"):
        runs = t.call(run_replicate, replicate, REPLICATE_SCENARIOS)
        three = replicas(t, runs, 0)
        t.equal(three["count"], 3)
        if any("root module is the model's own" in line for line in three["shared"]):
            t.fail("your list holds the model itself: a replica is a copy of it, one per device, that computes "
                   "what it computes", "3 replicas of the model", "the model itself")
        if not all(three["close"]):
            bad = [i for i, ok in enumerate(three["close"]) if not ok]
            t.fail("", "every replica's output equal to the model's", f"replica(s) {bad} computed something else")
    with t.case("replica i's parameters and buffers are all on devices[i]",
                hint="a replica computes where its chunk is: every tensor it holds, nested layers and "
                     "buffers (as BatchNorm's running statistics) included, must be on its own device; on GPUs "
                     "a tensor left on cuda:0 fails with 'Expected all tensors to be on the same device'"):
        three = replicas(t, runs, 0)
        wrong = misplaced(three)
        if wrong:
            t.fail("", "replica i's tensors on devices[i]", "; ".join(wrong[:4]))
        if three.get("mixes"):
            op, devices = three["mixes"][0]
            t.fail("", "one device per operation in each replica", f"{op} was given tensors on {', '.join(devices)}")
    with t.case("every replica is a tree of modules of its own: none shared with the model or another replica",
                hint="a module shared with the model computes with the model's parameters on devices[0], and "
                     "whatever one replica sets in it changes the model and the other replicas too"):
        three = replicas(t, runs, 0)
        if three["shared"]:
            t.fail("", "separate module objects", "; ".join(three["shared"][:3]))
    with t.case("a backward through all 3 replicas puts the SUM of their gradients into the model's own .grad",
                hint="DataParallel's replicate is a broadcast whose backward adds the replicas' gradients "
                     "on the first device: a replica's parameters must be computed from the model's"):
        three = replicas(t, runs, 0)
        if any("root module is the model's own" in line for line in three["shared"]):
            t.fail("not judged: your replicas are the model itself (see the case above), so its .grad sums the "
                   "uses of one module on one device; the sum has to cross from copies on other devices",
                   "the sum of the replicas' gradients in the model's .grad", "no replica: the model reused")
        if three.get("grads") != "equal":
            hint, got = grad_words(three)
            t.fail(hint, "the sum of the replicas' gradients in model.parameters()' .grad", got)
    with t.case("the model is left as it was: its own parameters, on cuda:0",
                hint="replicate makes copies: the model keeps its Parameters (the optimizer holds them) and its "
                     "device; only the replicas get the copies"):
        three = replicas(t, runs, 0)
        if three["changed"]:
            t.fail("", "the model unchanged", "; ".join(three["changed"][:3]))
    with t.case("devices [cuda:0, cuda:3] of 4 GPUs: replica 1 on cuda:3, gradients summed into the model",
                hidden=True, hint="use the devices you are given, whatever their indices"):
        two = replicas(t, runs, 1)
        wrong = misplaced(two)
        if two["count"] != 2 or wrong or two.get("grads") != "equal":
            t.fail("", "2 replicas on cuda:0 and cuda:3, summed gradients",
                   f"{two['count']} replicas; {'; '.join(wrong[:2]) or 'placed right'}; gradients {two.get('grads')}")


# -- data_parallel_forward ----------------------------------------------------------------
DP_SCENARIOS = [(3, 10), (4, 3)]  # (simulated GPUs, samples): the main case, and fewer chunks than devices
# The forward is judged on its own: the name ``replicate`` in it is the check's correct one
# (:func:`.ranks.reference_replicate`), so a bug in 03.replicate costs points there only.
OWN = "the check gives your forward a correct replicate of its own, so this is your forward's doing"


@exercise("03.data_parallel_forward", points=7, references=DP_REFS,
          description="data_parallel_forward(model, batch, devices): DataParallel's forward with replicate "
                      "(the check's own, correct one); equals model(batch) on devices[0], gradients reach the model")
def _dp_forward(t, data_parallel_forward):
    """Runs on simulated ``[cuda:0, cuda:1, cuda:2]``, with the name ``replicate`` in the answer bound to the
    check's own correct one (the answer is judged apart from 03.replicate). Catches: chunks never moved, all moved to
    ``devices[0]`` or to ``"cpu"``; the whole batch to every replica; the original model (or replicas all
    on ``devices[0]``) running every chunk; ``copy.deepcopy`` or ``no_grad`` replicas (no gradients);
    ``torch.cat`` before moving the outputs; the result gathered elsewhere than ``devices[0]``; one
    replica per device when there are fewer chunks than devices."""
    runs = None
    with t.case("3 GPUs (simulated: cuda:0, cuda:1, cuda:2), 10 samples: the output equals model(batch)",
                hint="the gathered output holds every sample's output once, in batch order"):
        runs = t.call(run_dps, data_parallel_forward, DP_SCENARIOS)
        three = dp(t, runs, 0)
        t.equal(three["shape"], tuple(three["expected"].shape))
        t.close(three["values"], three["expected"])
    with t.case("the model's forward sees chunks of 4, 4 and 2 samples",
                hint="each replica gets its own share of the batch, split along dim 0 as DataParallel's scatter "
                     "does (as equal as possible, the last one smaller), never the whole batch"):
        three = dp(t, runs, 0)
        t.equal(three["sizes"], sorted(three["chunks"]))
    with t.case("chunk i is moved to devices[i]: one chunk on each of cuda:0, cuda:1, cuda:2",
                hint="the batch comes from the CPU: on GPUs a chunk left there, or sent to another GPU than "
                     "its replica's, fails with 'Expected all tensors to be on the same device'"):
        three = dp(t, runs, 0)
        chunk_devices = sorted(x for _, x, _ in three["calls"])
        if chunk_devices != three["devices"]:
            t.fail("", f"chunks on {three['devices']}", f"chunks on {chunk_devices}")
    with t.case("every chunk runs on its own replica, placed on that chunk's device",
                hint="the model lives on devices[0]; on a GPU, running it (or a replica made for devices[0]) "
                     f"on a chunk on cuda:1 fails; one replica per chunk ({OWN})"):
        three = dp(t, runs, 0)
        if three["instances"] < len(three["chunks"]) or three["original_runs"] > 1:
            t.fail("", f"{len(three['chunks'])} module instances, one per chunk",
                   f"{three['instances']} instance(s); the original model ran {three['original_runs']} time(s)")
        wrong = [(x, m) for _, x, m in three["calls"] if x != m]
        if wrong:
            t.fail("", "each replica on its chunk's device",
                   "; ".join(f"a replica on {m} ran a chunk on {x}" for x, m in wrong))
    with t.case("the outputs are brought to devices[0] before they are joined; the result is on devices[0] (cuda:0)",
                hint="on GPUs torch.cat refuses tensors that live on different devices, and DataParallel "
                     "returns its output on the first device"):
        three = dp(t, runs, 0)
        if three["instances"] < 2:
            t.fail("not judged: the batch ran through one module in one piece (see the cases above), so no outputs "
                   "were gathered from several devices", f"{len(three['chunks'])} outputs joined on devices[0]",
                   f"{three['instances']} module ran")
        if three["mixes"]:
            op, devices = three["mixes"][0]
            t.fail("", "one device per operation", f"{op} was given tensors on {', '.join(devices)}")
        if three["where"] != "cuda:0":
            t.fail("the output is gathered on devices[0], not on the CPU or another GPU", "the result on cuda:0",
                   f"the result on {three['where']}")
    with t.case("gradients reach the original model's parameters, equal to those of model(batch)",
                hint=f"a deep copy, a module's .to() or torch.no_grad() cut the graph ({OWN})"):
        three = dp(t, runs, 0)
        if three["grads"] != "equal":
            t.fail("", "the model's gradients equal to model(batch)'s", f"gradients: {three['grads']}")
    with t.case("3 samples on 4 GPUs (fewer chunks than devices): equals model(batch), 3 replicas", hidden=True,
                hint="with fewer chunks than devices, DataParallel uses only as many replicas as chunks"):
        few = dp(t, runs, 1)
        if few["shape"] != tuple(few["expected"].shape):
            t.fail("", str(tuple(few["expected"].shape)), str(few["shape"]))
        t.close(few["values"], few["expected"])
        if few["instances"] != 3:
            t.fail("", "3 replicas", f"{few['instances']} module instances ran")


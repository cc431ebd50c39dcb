"""What lesson 04's checks run inside real ranks: the probes and what they hand the learner's code.

Each probe calls the learner's function in a fresh process (``t.call``) or in
real ranks (``t.ranks``) for :mod:`.checkers`, and returns plain evidence for
the checker to judge in the kernel: which samples each rank read and in which
order, where the model and every batch were moved, the weights it ended with,
which rank called the download and what it found on return, each rank's mean.
They are module-level functions of an importable module, so a rank receives
them by name and imports this module, which holds no judging.

:func:`run_ddp_train` makes each rank a GPU rank in name on a machine without
one (:mod:`..sim.cuda`, :mod:`..sim.parallel`): ``mgpu_lab.dist.device()`` is
``cuda:LOCAL_RANK``, ``torch.cuda`` reports a GPU per local rank, and the model,
the batches and DDP's ``device_ids`` record where they were sent while their
data stays on the CPU (:mod:`..sim.devices`). So "every rank on cuda:0", "the
global rank as GPU index" and "labels left behind" show here.
"""
from __future__ import annotations

import os
import time
import torch
from contextlib import contextmanager
import torch.distributed as tdist
from torch import nn
from torch.utils.data import Dataset

from mgpu_lab import dist as mdist
from mgpu_lab.data.datasets import synthetic_classification
from mgpu_lab.data.download import simulate_nodes
from ..sim.cuda import simulated_gpus
from ..sim.devices import GpuFactories, place, Placed, PlacedModule, reset
from ..sim.outcome import outcomes
from ..sim.parallel import simulated_nccl, virtual_ddp
from ..sim.scenarios import run_scenarios


# -- shard_indices -----------------------------------------------------------------------
def shard_all(shard_indices, combos):
    """Probe: ``shard_indices(*combo)`` for each combination: ("ok", list of ints) or ("raised", type, message)."""
    return outcomes(shard_indices, combos, keep=_int_list)


def _int_list(got) -> list:
    return [int(i) for i in (got.tolist() if isinstance(got, torch.Tensor) else list(got))]


# -- ddp_train ---------------------------------------------------------------------------
class Recorded(Dataset):
    """A data set that appends every index it serves to a file and tags its samples ``inputs``/``labels``
    (untracked: a moved copy is a plain tensor; each batch the DataLoader stacks is logged). ``tracked=True``:
    what is computed from a sample keeps its tag and device, so a label left on the CPU that meets an output
    on a GPU is an operation mixing devices (``Placed.mixes``)."""

    def __init__(self, inner, log_path: str, tracked: bool = False):
        self.inner, self.log_path, self.tracked = inner, log_path, tracked

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        with open(self.log_path, "a") as f:
            f.write(f"{int(i)}\n")
        x, y = self.inner[i]
        return place(x, "inputs", tracked=self.tracked), place(y, "labels", tracked=self.tracked)


def _layers():
    torch.manual_seed(0)
    return nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3)


def check_model():
    """The model the ddp_train check trains: the same initial weights in every process."""
    return nn.Sequential(*_layers())


def placed_model():
    """:func:`check_model`'s network (same weights, same state_dict keys) that logs where it is moved."""
    return PlacedModule(*_layers(), name="model")


def check_data(n):
    """The data set the ddp_train check trains on: ``n`` samples, 6 features, 3 classes."""
    return synthetic_classification(n, features=6, classes=3, seed=3)


@contextmanager
def counted_ddp(counts: dict):
    """Every DDP built inside counts its gradient all-reduces (a communication hook: DDP's reducer calls
    collectives from C++, where no Python recorder sees them) and the backward passes through its first
    parameter (one per ``backward()``, however many forward passes it covers)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    built = DDP.__init__

    def hook(state, bucket):
        counts["allreduces"] += 1
        return default_hooks.allreduce_hook(None, bucket)

    def backward(grad):
        counts["backwards"] += 1

    def init(self, module, *args, **kwargs):
        built(self, module, *args, **kwargs)
        self.register_comm_hook(None, hook)
        first = next((p for p in module.parameters() if p.requires_grad), None)
        if first is not None:
            first.register_hook(backward)

    DDP.__init__ = init
    try:
        yield
    finally:
        DDP.__init__ = built


def run_ddp_train(ddp_train, scenarios: dict, log_dir, ranks_per_node):
    """Probe: the learner's ddp_train in this rank of a simulated node of virtual GPUs, once per scenario
    (``{name: (n, epochs, batch_size, lr, accumulate or None for the default)}``): ``{name: evidence}``."""
    node = simulate_nodes(ranks_per_node)
    out = {}
    for name, (n, epochs, batch_size, lr, accumulate) in scenarios.items():
        log = os.path.join(log_dir, f"{name}-rank{tdist.get_rank()}.log")
        reset()
        counts = {"allreduces": 0, "backwards": 0}
        kwargs = {} if accumulate is None else {"accumulate": accumulate}
        with simulated_gpus(ranks_per_node, local_rank=mdist.local_rank()), virtual_ddp(), counted_ddp(counts):
            state = ddp_train(placed_model, Recorded(check_data(n), log), epochs, batch_size, lr, **kwargs)
        out[name] = {"seen": [int(line) for line in open(log)] if os.path.exists(log) else [],
                     "moves": list(Placed.moves), "node": node, "local_rank": mdist.local_rank(),
                     "batches": {tag: Placed.batches.count(tag) for tag in ("inputs", "labels")},
                     "rank": tdist.get_rank(), "state": _plain_state(state), "type": type(state).__name__,
                     **counts}
    return out


def _plain_state(state):
    if isinstance(state, dict) and all(isinstance(v, torch.Tensor) for v in state.values()):
        return {k.removeprefix("module."): v.detach().cpu().as_subclass(torch.Tensor).clone()
                for k, v in state.items()}
    return None


# -- download_once -----------------------------------------------------------------------
PAYLOAD = bytes(range(256)) * 32


def _finished(root, path):
    """What fn does last: note in ``done.log`` that this round's call returned (the evidence that the node's
    other ranks waited for it, also when it downloads nothing)."""
    with open(os.path.join(root, "done.log"), "a") as f:
        f.write(f"{os.environ.get('MGPU_LAB_CHECK_ROUND', '?')} {mdist.rank()}\n")
    return path


def slow_fetch(root):
    """The function the check decorates: logs its calls, writes data.bin slowly, takes a while to find a
    complete file (and downloads nothing then), and notes when it returns."""
    root = os.fspath(root)
    with open(os.path.join(root, "calls.log"), "a") as f:
        f.write(f"{os.environ.get('MGPU_LAB_CHECK_ROUND', '?')} {mdist.rank()}\n")
    path = os.path.join(root, "data.bin")
    if os.path.isfile(path) and os.path.getsize(path) == len(PAYLOAD):
        time.sleep(0.3)  # checking the file: a rank that does not wait for it returns meanwhile
        return _finished(root, path)
    with open(os.path.join(root, "downloads.log"), "a") as f:
        f.write(f"{os.environ.get('MGPU_LAB_CHECK_ROUND', '?')} {mdist.rank()}\n")
    with open(path, "wb") as f:  # written in place, slowly: an early reader sees half a file
        for i in range(0, len(PAYLOAD), 1024):  # 8 chunks over about 0.3 s
            f.write(PAYLOAD[i:i + 1024])
            f.flush()
            time.sleep(0.04)
    return _finished(root, path)


def run_download_once(download_once, roots, ranks_per_node, rounds=2):
    """Probe: simulate the node layout, call the decorated slow_fetch ``rounds`` times."""
    node = simulate_nodes(ranks_per_node)
    fetch = download_once(slow_fetch)
    out = []
    for k in range(rounds):
        os.environ["MGPU_LAB_CHECK_ROUND"] = str(k)
        path = fetch(roots[node])
        ok = isinstance(path, (str, os.PathLike)) and os.path.isfile(path)
        complete = ok and open(path, "rb").read() == PAYLOAD
        done = os.path.join(roots[node], "done.log")
        waited = os.path.exists(done) and str(k) in open(done).read().split()[0::2]
        out.append({"path": os.fspath(path) if ok else repr(path), "found": ok, "complete": complete,
                    "waited": waited})
        tdist.barrier()
    return {"node": node, "local_rank": mdist.local_rank(), "rounds": out}


# -- global_mean -------------------------------------------------------------------------
def run_global_mean(global_mean, scenarios, log_dir):
    """Probe: in each scenario, this rank's (value, type name, the collectives it called) of the learner's
    global_mean, run as an NCCL rank on simulated GPUs: ``get_backend()`` is ``"nccl"``,
    ``mgpu_lab.dist.device()`` is ``cuda:rank``, a tensor made there records it, and every collective is
    recorded with the device of its tensor (``(op, device or None)``, None: an object collective)."""
    from mgpu_lab.comm.record import record

    me = tdist.get_rank()

    def one(scenario):
        sums, counts = scenario
        reset()
        with simulated_gpus(tdist.get_world_size(), local_rank=me), simulated_nccl(), GpuFactories("yours"), \
                record() as log:
            value = global_mean(sums[me], counts[me])
        calls = [(e["op"], e["device"] if e["numel"] else None) for e in log if e["op"] != "wait"]
        return (value.item() if isinstance(value, torch.Tensor) else value), type(value).__name__, calls

    return run_scenarios(log_dir, one, scenarios)


# -- train_exact -------------------------------------------------------------------------
EXACT_LR = 0.5  # the learning rate the check passes


def exact_model():
    """The check's ``model_fn`` for train_exact: the same initial weights in every process."""
    return nn.Sequential(*_layers())


def placed_exact_model(device: str):
    """:func:`exact_model`'s network on a simulated GPU: parameters and gradients report ``device``, every
    input's device is recorded, its outputs are on ``device`` (so a loss with CPU labels mixes devices)."""
    model = PlacedModule(*_layers(), name="model", out_tag="output", device=device, virtual_parameters=True)
    for p in model.parameters():  # a gradient is where its parameter is (autograd leaves it a plain CPU tensor)
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", place(p.grad, "gradient", p.device)))
    return model


def _step_log(log_dir, k):
    """The file in which this rank notes each backward pass of scenario ``k`` as it happens (read after a hang)."""
    return os.path.join(log_dir, f"exact{k}-rank{tdist.get_rank()}.log")


@contextmanager
def logged_backwards(path: str, counts: dict):
    """Every DDP built inside counts its gradient all-reduces and notes each backward pass (through its first
    parameter) in ``path`` at once, so what a rank did before a hang survives it."""
    def note(grad):
        with open(path, "a") as f:
            f.write("b\n")

    with counted_ddp(counts):
        from torch.nn.parallel import DistributedDataParallel as DDP
        built = DDP.__init__

        def init(self, module, *args, **kwargs):
            built(self, module, *args, **kwargs)
            first = next((p for p in module.parameters() if p.requires_grad), None)
            if first is not None:
                first.register_hook(note)

        DDP.__init__ = init
        try:
            yield
        finally:
            DDP.__init__ = built


def _exact_run(train_exact, scenario, path):
    """One scenario ``(n, global_batch, epochs, gpus)`` of the learner's train_exact in this rank: the state it
    returned, the counts, and with ``gpus`` (NCCL ranks on simulated GPUs) where every input and mix was."""
    n, global_batch, epochs, gpus = scenario
    counts, where, me = {"allreduces": 0, "backwards": 0}, {}, tdist.get_rank()
    reset()
    if gpus:
        with simulated_gpus(tdist.get_world_size(), local_rank=me), simulated_nccl(), virtual_ddp(), \
                GpuFactories("a tensor your code made"), logged_backwards(path, counts):
            state = train_exact(lambda: placed_exact_model(f"cuda:{me}"), Recorded(check_data(n), os.devnull, True),
                                global_batch, epochs, EXACT_LR)
        where = {"inputs": [entry[1:5] for entry in PlacedModule.inputs], "mixes": list(Placed.mixes)}
    else:
        with logged_backwards(path, counts):
            state = train_exact(exact_model, check_data(n), global_batch, epochs, EXACT_LR)
    return state, counts, where


def probe_exact(train_exact, scenarios: list, log_dir: str) -> list:
    """In a real rank, per scenario: the learner's train_exact, then a barrier (a rank still inside a
    collective of the training hangs there). Returns per scenario this rank's state_dict (None and what it
    returned when it is not one), its DDP gradient all-reduces and backward passes, and on simulated GPUs
    where the model's inputs and any operation mixing devices were."""
    from ..sim.devices import plain

    done = []

    def one(scenario):
        done.append(scenario)
        state, counts, where = _exact_run(train_exact, scenario, _step_log(log_dir, len(done) - 1))
        tdist.barrier()
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            return {"state": None, "returned": repr(state)[:100], **counts, **where}
        state = {k.removeprefix("module."): plain(v).detach().cpu().clone() for k, v in state.items()}
        return {"state": state, **counts, **where}

    return run_scenarios(log_dir, one, scenarios)


def exact_backwards(log_dir: str, k: int, world: int) -> list[int]:
    """How many backward passes each rank noted in scenario ``k`` (read where the ranks ran, after a hang)."""
    paths = [os.path.join(log_dir, f"exact{k}-rank{r}.log") for r in range(world)]
    return [len(open(p).read().split()) if os.path.exists(p) else 0 for p in paths]

"""What lesson 05's checks run in the learner's processes: building the sampler, training on uneven shards.

:func:`probe_sampler` builds the learner's sampler for every rank of many
configurations in one fresh process, re-seeding the global random generators
before each rank as separate processes would differ (and records whether the
ranks' whole plans agree); :func:`probe_sampler_ranks` and :func:`probe_uneven`
run in real ranks, the latter every scenario in one launch. Each returns plain
evidence (the lists, the weights) that :mod:`.checkers` judges in the kernel. They
are module-level functions of an importable module, so a rank receives them by
name and imports this module, which holds no judging.
"""
from __future__ import annotations

import numpy as np
import operator
import random
import torch

from ..sim.cuda import simulated_gpus
from ..sim.devices import GpuFactories, Placed, PlacedModule, place, plain, reset
from ..sim.outcome import outcome
from ..sim.parallel import simulated_nccl, virtual_ddp


# -- BalancedDistributedSampler -----------------------------------------------------
def _reseed(value: int) -> None:
    random.seed(value)
    np.random.seed(value)
    torch.manual_seed(value)


def sampler_lists(cls, cfg: dict) -> dict:
    """Build the learner's sampler for every rank of one configuration; return what it yields."""
    world = cfg["num_replicas"]
    out = {"is_sampler": [], "len": [], "epochs": [(e, []) for e in cfg["epochs"]], "plans_differ": False}
    plans = {}
    for r in range(world):
        _reseed(1000 + 17 * r)  # separate processes have separate global random states
        s = cls(cfg["costs"], world, r, shuffle=cfg["shuffle"], seed=cfg["seed"], drop_last=cfg["drop_last"])
        out["is_sampler"].append(isinstance(s, torch.utils.data.Sampler))
        out["len"].append(len(s))
        for e, lists in out["epochs"]:
            s.set_epoch(e)
            lists.append([operator.index(i) for i in s])
            if r < 2 and e == cfg["epochs"][0] and callable(getattr(s, "plan", None)):  # ranks 0 and 1 agree?
                plan = [[operator.index(i) for i in lst] for lst in s.plan()]
                out["plans_differ"] |= plans.setdefault(e, plan) != plan
    return out


def probe_sampler(cls, configs: list) -> list:
    """Every configuration's lists, or ("raised", type, message) for the ones that raise."""
    return [outcome(sampler_lists, cls, cfg) for cfg in configs]


def probe_sampler_ranks(cls, costs: list, seed: int, epochs: tuple) -> dict:
    """In a real rank: this rank's own lists, and (on rank 0) every rank's lists as rank 0 computes them."""
    import torch.distributed as tdist

    rank, world = tdist.get_rank(), tdist.get_world_size()
    _reseed(5000 + 31 * rank)
    own = cls(costs, world, rank, seed=seed)
    mine = {}
    for e in epochs:
        own.set_epoch(e)
        mine[e] = [operator.index(i) for i in own]
    seen = {}
    if rank == 0:
        for r in range(world):
            other = cls(costs, world, r, seed=seed)
            other.set_epoch(epochs[-1])
            seen[r] = [operator.index(i) for i in other]
    return {"mine": mine, "seen": seen}


# -- train_uneven ---------------------------------------------------------------------
LR = 0.1  # the learning rate the check passes


def uneven_model(seed: int):
    """The check's ``model_fn``: the same initial weights on every rank for a seed."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def uneven_shards(seed: int, lengths) -> list:
    """Every rank's data set for a seed: ``lengths[r]`` samples of 4 features and 1 target."""
    g = torch.Generator().manual_seed(1000 * seed + 7)
    return [torch.utils.data.TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g))
            for n in lengths]


def placed_uneven_model(seed: int, device: str):
    """:func:`uneven_model`'s network (same weights and state_dict keys) on a simulated GPU: its parameters
    and their gradients report ``device``, its inputs' devices are recorded, its outputs are on ``device``."""
    torch.manual_seed(seed)
    model = PlacedModule(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1), name="model",
                         out_tag="output", device=device, virtual_parameters=True)
    for p in model.parameters():  # a gradient is where its parameter is (autograd leaves it a plain CPU tensor)
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", place(p.grad, "gradient", p.device)))
    return model


def _placed_run(train_uneven, scenario) -> tuple:
    """The learner's training as an NCCL rank on simulated GPUs (``model_fn()`` on ``cuda:rank``): its state,
    and where every batch given to the model, every collective's tensor and every mixed operation were."""
    import functools
    import torch.distributed as tdist

    from mgpu_lab.comm.record import record

    lengths, epochs, batch_size, seed, _ = scenario
    me = tdist.get_rank()
    reset()
    with simulated_gpus(tdist.get_world_size(), local_rank=me), simulated_nccl(), virtual_ddp(), \
            GpuFactories("a tensor your code made on the GPU"), record() as log:
        state = train_uneven(functools.partial(placed_uneven_model, seed, f"cuda:{me}"),
                             uneven_shards(seed, lengths), epochs, batch_size, LR)
    where = {"inputs": [entry[1:4] for entry in PlacedModule.inputs], "mixes": list(Placed.mixes),
             "calls": [(e["op"], e["device"]) for e in log if e["numel"] and e["op"] != "wait"]}
    return state, where


def probe_uneven(train_uneven, scenarios: list, log_dir: str) -> list:
    """In a real rank, per scenario ``(lengths, epochs, batch_size, seed, gpus)``: the learner's training, then a
    barrier (as before a checkpoint). Returns per scenario this rank's state_dict (or what it returned); with
    ``gpus`` the run is on simulated GPUs (:func:`_placed_run`) and the evidence says where things were."""
    import functools
    import torch.distributed as tdist

    from ..sim.scenarios import run_scenarios

    def one(scenario):
        lengths, epochs, batch_size, seed, gpus = scenario
        where = {}
        if gpus:
            state, where = _placed_run(train_uneven, scenario)
        else:
            state = train_uneven(functools.partial(uneven_model, seed), uneven_shards(seed, lengths), epochs,
                                 batch_size, LR)
        tdist.barrier()  # hangs if a rank were still in a collective of the training
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            return {"state": None, "returned": repr(state)[:100], **where}
        return {"state": {k: plain(v).detach().cpu().clone() for k, v in state.items()}, **where}

    return run_scenarios(log_dir, one, scenarios)

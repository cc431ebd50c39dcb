"""What lesson 05's checks run in the learner's processes: building the sampler, the Join loop.

:func:`probe_sampler` builds the learner's sampler for every rank of many
configurations in one fresh process, re-seeding the global random generators
before each rank as separate processes would differ (and records whether the
ranks' whole plans agree); :func:`probe_sampler_ranks` and :func:`probe_join`
run in real ranks, the latter every scenario in one launch. Each returns plain
evidence (the lists, step counts, weights) that :mod:`.checkers` judges in the kernel. They
are module-level functions of an importable module, so a rank receives them by
name and imports this module, which holds no judging.
"""
from __future__ import annotations

import numpy as np
import operator
import random
import torch

from ..sim.outcome import outcome


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


# -- train_with_join ------------------------------------------------------------------
def join_model(seed: int):
    """The model of the train_with_join check: the same initial weights for a seed."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def join_batches(seed: int, rank: int, count: int) -> list:
    """Rank ``rank``'s ``count`` batches of 6 samples (4 features, 1 target) for a seed."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return [(torch.randn(6, 4, generator=g), torch.randn(6, 1, generator=g)) for _ in range(count)]


def probe_join(train_with_join, scenarios: list, log_dir: str) -> list:
    """In a real rank, per scenario ``(counts, seed)``: a DDP model, this rank's batches; the learner's
    loop, then a barrier. Returns per scenario this rank's step count and final weights."""
    import torch.distributed as tdist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ..sim.scenarios import run_scenarios

    rank = tdist.get_rank()

    def one(scenario):
        counts, seed = scenario
        model = DDP(join_model(seed))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        steps = train_with_join(model, join_batches(seed, rank, counts[rank]), optimizer)
        tdist.barrier()  # as before saving a checkpoint: hangs if a rank is still in a gradient all-reduce
        return {"steps": steps if isinstance(steps, int) else repr(steps)[:100],
                "weights": [p.detach().clone() for p in model.module.parameters()]}

    return run_scenarios(log_dir, one, scenarios)

"""Lesson 05's checks against named wrong answers made from the solutions, and correct variants.

Every mutant is the solution cell with one learner bug put in; its check must
fail and say the words in ``expect``. Every variant is a correct answer written
differently; it must get full marks. The loop whose ranks leave on their own,
which hangs until the check's timeout, is tests/course/checks/test_checks_05.py's
hang test.
"""
from __future__ import annotations

import heapq
import math

import pytest
import torch
import torch.nn.functional as F
import torch.distributed as tdist
from torch.utils.data import DataLoader, Sampler

from batching import shared_mutant_tests
from mutation import ExerciseMutants, Mutant, Variant, drop_statement, replace

pytestmark = pytest.mark.timeout(600)

# "__main__", as in a notebook: cloudpickle then ships the answers by value without searching sys.modules
NAMESPACE = {"__name__": "__main__", "torch": torch, "math": math, "heapq": heapq, "F": F, "Sampler": Sampler,
             "tdist": tdist, "DataLoader": DataLoader}
NB = "05_balanced_samplers.ipynb"
SHARED_SHUFFLE = ("perm = torch.randperm(self.num_samples, generator=g).tolist()\n"
                  "            lists = [[lst[p] for p in perm] for lst in lists]")

SAMPLER_HEAD = '''
class BalancedDistributedSampler(Sampler[int]):
    def __init__(self, costs, num_replicas, rank, shuffle=True, seed=0, drop_last=False):
        self.costs = [float(c) for c in costs]
        self.num_replicas, self.rank = num_replicas, rank
        self.shuffle, self.seed, self.drop_last, self.epoch = shuffle, seed, drop_last, 0
        n = len(self.costs)
        self.num_samples = n // num_replicas if drop_last else -(-n // num_replicas)

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return self.num_samples

    def __iter__(self):
        return iter(self.plan()[self.rank])
'''

SAMPLER_VARIANTS = [
    Variant("tensors and a scan for the lightest rank with room (no heap)", SAMPLER_HEAD + '''
    def plan(self):
        world, per, n = self.num_replicas, self.num_samples, len(self.costs)
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        idx = torch.randperm(n, generator=g) if self.shuffle else torch.arange(n)
        if n:
            idx = idx.repeat(per * world // n + 1)[: per * world]
        costs = torch.tensor(self.costs, dtype=torch.float64)
        idx = idx[torch.sort(costs[idx], descending=True, stable=True).indices].tolist()
        loads, lists = [0.0] * world, [[] for _ in range(world)]
        for i in idx:
            r = min((r for r in range(world) if len(lists[r]) < per), key=lambda r: (loads[r], r))
            lists[r].append(i)
            loads[r] += self.costs[i]
        if self.shuffle:
            perm = torch.randperm(per, generator=g).tolist()
            lists = [[lst[p] for p in perm] for lst in lists]
        return lists
'''),
    Variant("Python's random.Random(seed + epoch), itertools padding, sorted(reverse=True)", SAMPLER_HEAD + '''
    def plan(self):
        import itertools
        import random
        world, per, n = self.num_replicas, self.num_samples, len(self.costs)
        rng = random.Random(self.seed + self.epoch)  # a private generator: the same draws in every process
        order = list(range(n))
        if self.shuffle:
            rng.shuffle(order)
        order = list(itertools.islice(itertools.cycle(order), per * world)) if n else []
        order = sorted(order, key=self.costs.__getitem__, reverse=True)  # stable, also reversed
        heap, lists = [(0.0, r) for r in range(world)], [[] for _ in range(world)]
        for i in order:
            load, r = heapq.heappop(heap)
            lists[r].append(i)
            if len(lists[r]) < per:
                heapq.heappush(heap, (load + self.costs[i], r))
        if self.shuffle:
            perm = list(range(per))
            rng.shuffle(perm)
            lists = [[lst[p] for p in perm] for lst in lists]
        return lists
'''),
]

UNEVEN_VARIANTS = [
    Variant("DDP, the step count agreed once per epoch, a zero-weighted loss on a rank out of data", '''
def train_uneven(model_fn, shards, epochs, batch_size, lr):
    from torch.nn.parallel import DistributedDataParallel as DDP
    rank = tdist.get_rank()
    model = DDP(model_fn())
    device = next(model.parameters()).device
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    some = next(s[0] for s in shards if len(s))  # any sample: the shape of a batch with no weight
    for _ in range(epochs):
        batches = list(DataLoader(shards[rank], batch_size=batch_size))
        steps = torch.tensor(len(batches), device=device)
        tdist.all_reduce(steps, op=tdist.ReduceOp.MAX)
        for k in range(int(steps)):
            optimizer.zero_grad()
            x, y = batches[k] if k < len(batches) else (some[0][None], some[1][None])
            x, y = x.to(device), y.to(device)
            (F.mse_loss(model(x), y) * (1.0 if k < len(batches) else 0.0)).backward()  # DDP divides by the world
            optimizer.step()
    return model.module.state_dict()
'''),
    Variant("per-parameter all-reduces, a MAX flag, batches sliced by hand", '''
def train_uneven(model_fn, shards, epochs, batch_size, lr):
    rank, world = tdist.get_rank(), tdist.get_world_size()
    model = model_fn()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    data = shards[rank]
    for _ in range(epochs):
        start = 0
        while True:
            mine = start < len(data)
            flag = torch.full((1,), float(mine), device=next(model.parameters()).device)
            tdist.all_reduce(flag, op=tdist.ReduceOp.MAX)
            if flag.item() == 0:
                break
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
            if mine:
                xs, ys = zip(*[data[i] for i in range(start, min(start + batch_size, len(data)))])
                to = next(model.parameters()).device
                F.mse_loss(model(torch.stack(xs).to(to)), torch.stack(ys).to(to)).backward()
            for p in model.parameters():
                tdist.all_reduce(p.grad)
                p.grad.div_(world)
            opt.step()
            start += batch_size
    return model.state_dict()
'''),
]

SPECS = [
    ExerciseMutants("05.BalancedDistributedSampler", NB, ("BalancedDistributedSampler",), mutants=[
        Mutant("each rank shuffles its own positions",
               replace(SHARED_SHUFFLE, "lists = [[lst[p] for p in torch.randperm(self.num_samples, generator="
                                       "torch.Generator().manual_seed(self.seed + self.epoch + r)).tolist()] "
                                       "for r, lst in enumerate(lists)]"), "one permutation of positions"),
        Mutant("the rank in the seed", replace("manual_seed(self.seed + self.epoch)",
                                               "manual_seed(self.seed + self.epoch + self.rank)"), "plans differ"),
        Mutant("the global random state", replace("torch.randperm(n, generator=g)", "torch.randperm(n)"),
               "global random state"),
        Mutant("no padding", replace("order = (order * (total // n + 1))[:total]", "order = order[:total]"),
               "pad"),
        Mutant("the seed without the epoch", replace("manual_seed(self.seed + self.epoch)",
                                                     "manual_seed(self.seed)"), "new order"),
        Mutant("not sorted costliest first", drop_statement("order.sort("), "costliest first"),
        Mutant("no room check: unequal lengths",
               replace("if len(lists[r]) < self.num_samples:\n                heapq.heappush",
                       "if True:\n                heapq.heappush"), "every rank needs the same number"),
        Mutant("num_samples rounds down without drop_last",
               replace("n // num_replicas if drop_last else math.ceil(n / num_replicas)", "n // num_replicas"),
               "ceil(n / num_replicas)"),
        Mutant("shuffle=False still shuffles",
               (replace("if self.shuffle else list(range(n))", ""), replace("if self.shuffle:", "if True:")),
               "shuffle=False"),
        Mutant("shuffle=False still shuffles the positions, by the seed alone (the same every epoch)",
               (replace("manual_seed(self.seed + self.epoch)", "manual_seed(self.seed + (self.epoch if self.shuffle "
                                                                "else 0))"),
                replace("if self.shuffle:  #", "if True:  #")),
               ("changed with the seed", "different lists for another seed")),
    ], variants=SAMPLER_VARIANTS),
    ExerciseMutants("05.train_uneven", NB, ("train_uneven",), mutants=[
        Mutant("divided by the ranks that still have a batch", replace("flat /= world_size", "flat /= have.item()"),
               "full world size"),
        Mutant("a summed loss", replace("F.mse_loss(model(x), y)", "F.mse_loss(model(x), y, reduction='sum')"),
               "summed loss"),
        Mutant("epochs run back to back on each rank",
               replace("for epoch in range(epochs):\n        batches = iter(loader)",
                       "for epoch in range(1):\n        batches = (b for _ in range(epochs) for b in loader)"),
               "back to back"),
        Mutant("the epoch ends when the first rank runs out",
               replace("tdist.all_reduce(have)", "tdist.all_reduce(have, op=tdist.ReduceOp.MIN)"),
               "first rank runs out"),
        Mutant("a rank out of data keeps its old gradient",
               replace("optimizer.zero_grad()\n            if batch is not None:\n",
                       "if batch is not None:\n                optimizer.zero_grad()\n"), "contribute zeros"),
        Mutant("the last, shorter batch dropped",
               replace("DataLoader(shards[rank], batch_size=batch_size)",
                       "DataLoader(shards[rank], batch_size=batch_size, drop_last=True)"), "last, shorter batch"),
        Mutant("zero_grad never called", drop_statement("optimizer.zero_grad()"), "carry over"),
        Mutant("the batch not moved to the model's device",
               replace("x, y = (t.to(device) for t in batch)", "x, y = batch"), "batch was not moved"),
        Mutant("the 'anyone has data' flag made on the CPU",
               replace("torch.tensor([0 if batch is None else 1], device=device)",
                       "torch.tensor([0 if batch is None else 1])"), "made on the CPU"),
        Mutant("the library's loop under Join",
               replace("    ### BEGIN SOLUTION\n", "    ### BEGIN SOLUTION\n    from mgpu_lab.data.join import "
                       "train_with_join\n    train_with_join(torch.nn.parallel.DistributedDataParallel(model_fn()), "
                       "[], None)\n"), "mgpu_lab.data.join.train_with_join"),
    ], variants=UNEVEN_VARIANTS),
]


test_mutant_fails_naming_its_bug, test_correct_variant_passes, test_every_exercise_has_five_mutants_and_two_variants = \
    shared_mutant_tests(SPECS, "05", NAMESPACE)

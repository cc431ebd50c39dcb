"""Lesson 05's checks against named wrong answers made from the solutions, and correct variants.

Every mutant is the solution cell with one learner bug put in; its check must
fail and say the words in ``expect``. Every variant is a correct answer written
differently; it must get full marks. The loop without Join, which hangs until
the check's timeout, is tests/course/checks/test_checks_05.py's hang test.
"""
from __future__ import annotations

import heapq
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import Sampler

from mutation import ExerciseMutants, Mutant, Variant, drop_statement, mutant_tests, replace

pytestmark = pytest.mark.timeout(600)

# "__main__", as in a notebook: cloudpickle then ships the answers by value without searching sys.modules
NAMESPACE = {"__name__": "__main__", "torch": torch, "math": math, "heapq": heapq, "F": F, "Sampler": Sampler}
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
    Variant("the library's plan_balanced", SAMPLER_HEAD + '''
    def plan(self):
        from mgpu_lab.data.samplers import plan_balanced
        return plan_balanced(self.costs, self.num_replicas, seed=self.seed, epoch=self.epoch,
                             shuffle=self.shuffle, drop_last=self.drop_last).tolist()
'''),
]

JOIN_VARIANTS = [
    Variant("DDP's own model.join()", '''
def train_with_join(model, batches, optimizer):
    with model.join():
        for x, y in batches:
            optimizer.zero_grad()
            F.mse_loss(model(x), y).backward()
            optimizer.step()
    return len(batches)
'''),
    Variant("an iterator, explicit Join options, enumerate", '''
def train_with_join(model, batches, optimizer):
    from torch.distributed.algorithms.join import Join
    done = 0
    with Join([model], enable=True, throw_on_early_termination=False, divide_by_initial_world_size=True):
        for done, (x, y) in enumerate(iter(batches), start=1):
            loss = F.mse_loss(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    return done
'''),
    Variant("the library: mgpu_lab.data.uneven.train_with_join", "from mgpu_lab.data.uneven import train_with_join\n"),
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
    ], variants=SAMPLER_VARIANTS),
    ExerciseMutants("05.train_with_join", NB, ("train_with_join",), mutants=[
        Mutant("Join over the optimizer", replace("Join([model])", "Join([optimizer])"), "Join([model])"),
        Mutant("throw_on_early_termination=True",
               replace("Join([model])", "Join([model], throw_on_early_termination=True)"),
               "throw_on_early_termination"),
        Mutant("averaged over the ranks still training",
               replace("Join([model])", "Join([model], divide_by_initial_world_size=False)"),
               "divide_by_initial_world_size"),
        Mutant("steps never counted", drop_statement("steps += 1"), "number of optimizer steps"),
        Mutant("zero_grad never called", drop_statement("optimizer.zero_grad()"), "zero_grad"),
        Mutant("a summed loss", replace("F.mse_loss(model(x), y)", "F.mse_loss(model(x), y, reduction='sum')"),
               "summed loss"),
    ], variants=JOIN_VARIANTS),
]


test_mutant_fails_naming_its_bug, test_correct_variant_passes, test_every_exercise_has_five_mutants_and_two_variants = \
    mutant_tests(SPECS, "05", NAMESPACE)

"""Lesson 04's checks against named wrong answers made from the solutions, and correct variants.

Every mutant is the solution cell with one learner bug put in; its check must
fail and say the words in ``expect``. Every variant is a correct answer written
differently; it must get full marks.
"""
from __future__ import annotations

import contextlib
import math
import os
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, default_collate

from mgpu_lab import dist as mdist
from batching import shared_mutant_tests
from mutation import ExerciseMutants, Mutant, Variant, drop_statement, replace, sub

pytestmark = pytest.mark.timeout(600)

# "__main__", as in a notebook: cloudpickle then ships the answers by value without searching sys.modules
NAMESPACE = {"__name__": "__main__", "torch": torch, "math": math, "os": os, "time": time, "dist": dist,
             "contextlib": contextlib,
             "mdist": mdist, "nn": nn, "DDP": DDP, "DataLoader": DataLoader, "DistributedSampler": DistributedSampler,
             "default_collate": default_collate}
NB = "04_ddp.ipynb"
PADDING = "(indices * math.ceil(missing / len(indices)))[:missing]"
DEVICE = "device = mdist.device()"
FETCH = "path = fn(root) if mdist.local_rank() == 0 else None"
PICK = "return paths[dist.get_rank() - mdist.local_rank()]"
MEAN = "(totals[0] / totals[1]).item()"
STEP = "step = order[start:start + global_batch]"
EMPTY = "x, y = x[:0], y[:0]"
SCALED = "loss = loss_fn(ddp_model(x), y) * world / len(step)"

SHARD_VARIANTS = [
    Variant("tensors: repeat the permutation, slice with a stride", '''
def shard_indices(n, rank, world_size, shuffle=False, seed=0, epoch=0, drop_last=False):
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)) if shuffle else torch.arange(n)
    per_rank = n // world_size if drop_last else -(-n // world_size)
    order = order.repeat(-(-per_rank * world_size // n))[: per_rank * world_size]
    return order[rank::world_size]
'''),
    Variant("itertools: cycle the order", '''
def shard_indices(n, rank, world_size, shuffle=False, seed=0, epoch=0, drop_last=False):
    import itertools
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    order = torch.randperm(n, generator=g).tolist() if shuffle else list(range(n))
    per_rank = n // world_size if drop_last else math.ceil(n / world_size)
    padded = list(itertools.islice(itertools.cycle(order), per_rank * world_size))
    return [padded[i] for i in range(rank, per_rank * world_size, world_size)]
'''),
]

DDP_VARIANTS = [
    Variant("set_device, .cuda(), LOCAL_RANK from the environment, F.cross_entropy, a micro-batch counter", '''
def ddp_train(model_fn, dataset, epochs, batch_size, lr, accumulate=1):
    import torch.nn.functional as F
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        model = DDP(model_fn().cuda(), device_ids=[local_rank])
        device = torch.device("cuda")
    else:
        model, device = DDP(model_fn()), torch.device("cpu")
    sampler = DistributedSampler(dataset, num_replicas=dist.get_world_size(), rank=dist.get_rank(), seed=0)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        pending = 0
        for x, y in loader:
            pending += 1
            ends_step = pending == accumulate
            with contextlib.ExitStack() as stack:
                if not ends_step:
                    stack.enter_context(model.no_sync())
                loss = F.cross_entropy(model(x.to(device, non_blocking=True)), y.to(device, non_blocking=True))
                (loss / accumulate).backward()
            if ends_step:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                pending = 0
    return model.module.state_dict()
'''),
    Variant("gradients divided after the sync instead of the loss, require_backward_grad_sync", '''
def ddp_train(model_fn, dataset, epochs, batch_size, lr, accumulate=1):
    device = mdist.device()
    net = model_fn().to(device)
    model = DDP(net, device_ids=[device.index] if device.type == "cuda" else None)
    sampler = DistributedSampler(dataset)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.0)
    loss_fn = nn.CrossEntropyLoss()
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        batches = list(loader)
        for start in range(0, len(batches), accumulate):
            group = batches[start:start + accumulate]
            for k, (x, y) in enumerate(group):
                model.require_backward_grad_sync = k == len(group) - 1
                loss_fn(model(x.to(device)), y.to(device)).backward()
            for p in net.parameters():
                p.grad /= len(group)
            optimizer.step()
            optimizer.zero_grad()
    return net.state_dict()
'''),
]

DOWNLOAD_VARIANTS = [
    Variant("no barrier: all_gather_object waits for every rank's download", '''
def download_once(fn):
    def wrapper(root):
        local_rank = int(os.environ["LOCAL_RANK"])
        mine = fn(root) if local_rank == 0 else None
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        return everyone[dist.get_rank() - local_rank]
    return wrapper
'''),
    Variant("one process group per node, broadcast from its local rank 0", '''
def download_once(fn):
    def wrapper(root):
        per_node, world = mdist.local_world_size(), dist.get_world_size()
        node_group, _ = dist.new_subgroups_by_enumeration(
            [list(range(first, first + per_node)) for first in range(0, world, per_node)])
        box = [fn(root) if mdist.local_rank() == 0 else None]
        dist.broadcast_object_list(box, src=dist.get_rank() - mdist.local_rank(), group=node_group)
        return box[0]
    return wrapper
'''),
]

MEAN_VARIANTS = [
    Variant("two all_reduce calls, float()", '''
def global_mean(local_sum, local_count):
    total = torch.tensor(float(local_sum), dtype=torch.float64, device=mdist.device())
    count = torch.tensor(float(local_count), dtype=torch.float64, device=mdist.device())
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    dist.all_reduce(count, op=dist.ReduceOp.SUM)
    return float(total / count)
'''),
    Variant("all_gather_object of (sum, count) pairs", '''
def global_mean(local_sum, local_count):
    pairs = [None] * dist.get_world_size()
    dist.all_gather_object(pairs, (local_sum, local_count))
    return sum(s for s, _ in pairs) / sum(c for _, c in pairs)
'''),
]

EXACT_VARIANTS = [
    Variant("contiguous parts, a DataLoader over each rank's part, mean loss reweighted, no sample masked by zero", '''
def train_exact(model_fn, dataset, global_batch, epochs, lr):
    import torch.nn.functional as F
    device = mdist.device()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = model_fn().to(device)
    ddp_model = DDP(model, device_ids=[device.index]) if device.type == "cuda" else DDP(model)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr)
    for epoch in range(epochs):
        g = torch.Generator()
        g.manual_seed(epoch)
        order = torch.randperm(len(dataset), generator=g)
        for step in torch.split(order, global_batch):
            q, r = divmod(len(step), world)
            lo = rank * q + min(rank, r)
            part = step[lo:lo + q + (rank < r)].tolist()
            weight = len(part) * world / len(step)  # this rank's share of the step, times DDP's division
            x, y = next(iter(DataLoader(dataset, batch_size=len(step), sampler=part or step[:1].tolist())))
            x, y = x.to(device), y.to(device)
            loss = F.cross_entropy(ddp_model(x), y) * weight  # weight 0: a sample read, not trained on
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    return {k: v.detach().cpu() for k, v in ddp_model.module.state_dict().items()}
'''),
    Variant("per-sample losses gathered by index, the rank's samples picked with a mask, a step counter", '''
def train_exact(model_fn, dataset, global_batch, epochs, lr):
    device = mdist.device()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DDP(model_fn().to(device), device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    loss_fn = nn.CrossEntropyLoss(reduction="none")
    n = len(dataset)
    for epoch in range(epochs):
        order = torch.randperm(n, generator=torch.Generator().manual_seed(epoch)).tolist()
        steps = -(-n // global_batch)
        for k in range(steps):
            step = order[k * global_batch:(k + 1) * global_batch]
            xs, ys = zip(*(dataset[i] for i in step))  # every rank reads the whole step
            x, y = torch.stack(xs).to(device), torch.stack(ys).to(device)
            mask = (torch.arange(len(step), device=device) % world == rank).float()
            loss = (loss_fn(model(x), y) * mask).sum() * world / len(step)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return {k: v.cpu() for k, v in model.module.state_dict().items()}
'''),
]

SPECS = [
    ExerciseMutants("04.shard_indices", NB, ("shard_indices",), mutants=[
        Mutant("contiguous blocks instead of every world_size-th index",
               replace("return indices[rank:total:world_size]",
                       "return indices[rank * per_rank:(rank + 1) * per_rank]"), "contiguous"),
        Mutant("no padding", drop_statement("indices +="), "shortfall"),
        Mutant("padding repeats the list only once", replace(PADDING, "indices[:missing]"), "as often as needed"),
        Mutant("padding from the end of the list", replace(PADDING, "indices[-missing:]"), "first indices"),
        Mutant("the seed without the epoch", replace("g.manual_seed(seed + epoch)", "g.manual_seed(seed)"),
               "ignores the epoch"),
        Mutant("the global RNG instead of a seeded generator",
               replace("torch.randperm(n, generator=g)", "torch.randperm(n)"), "global random state"),
        Mutant("drop_last ignored", replace("if drop_last and n % world_size:", "if False:"), "drop_last"),
        Mutant("shuffle ignored", replace("if shuffle:", "if False:"), "not shuffled"),
    ], variants=SHARD_VARIANTS),
    ExerciseMutants("04.ddp_train", NB, ("ddp_train",), mutants=[
        Mutant("set_epoch never called", drop_statement("sampler.set_epoch"), "told the epoch"),
        Mutant("DataLoader(shuffle=True) instead of the DistributedSampler",
               replace("sampler=sampler)", "shuffle=True)"), ("whole data set", "distributedsampler does")),
        Mutant("lr scaled by the world size", replace("lr=lr)", "lr=lr * dist.get_world_size())"),
               "lr * world_size"),
        Mutant("no DDP: the ranks drift apart",
               (replace('DDP(model, device_ids=[device.index]) if device.type == "cuda" else DDP(model)', "model"),
                replace("ddp_model.no_sync()", "contextlib.nullcontext()")),
               "never averaged"),
        Mutant("labels left on the CPU", replace("x, y = x.to(device), y.to(device)", "x = x.to(device)"),
               ("labels", "never went to its gpu")),
        Mutant("every rank on cuda:0 ('cuda')",
               replace(DEVICE, 'device = torch.device("cuda" if torch.cuda.is_available() else "cpu")'),
               "cuda:0"),
        Mutant("the global rank as GPU index",
               replace(DEVICE, 'device = torch.device("cuda", dist.get_rank()) '
                               'if torch.cuda.is_available() else torch.device("cpu")'), "global rank"),
        Mutant("DDP(device_ids=[global rank])", replace("device_ids=[device.index]", "device_ids=[dist.get_rank()]"),
               "device_ids"),
        Mutant("zero_grad never called", drop_statement("optimizer.zero_grad()"), "never zeroed"),
        Mutant("batch_size taken as the global batch",
               replace("batch_size=batch_size,", "batch_size=max(1, batch_size // dist.get_world_size()),"),
               "per rank"),
        Mutant("an optimizer step after every micro-batch", replace("            if last:\n", "            if True:\n"),
               "step after every micro-batch"),
        Mutant("the micro-batches' mean losses summed (not divided by accumulate)",
               replace(" / accumulate).backward()", ").backward()"), "lr x accumulate"),
        Mutant("every micro-batch all-reduced (no no_sync)",
               replace("contextlib.nullcontext() if last else ddp_model.no_sync()", "contextlib.nullcontext()"),
               ("after every micro-batch's backward", "no_sync")),
        Mutant("the forward outside no_sync (only the backward inside): every micro-batch all-reduced",
               replace("            with contextlib.nullcontext() if last else ddp_model.no_sync():  # all-reduce once "
                       "per step\n                (loss_fn(ddp_model(x), y) / accumulate).backward()",
                       "            loss = loss_fn(ddp_model(x), y) / accumulate\n"
                       "            with contextlib.nullcontext() if last else ddp_model.no_sync():\n"
                       "                loss.backward()"),
               ("after every micro-batch's backward", "forward and backward passes both")),
        Mutant("no_sync on every micro-batch: nothing ever all-reduced",
               replace("contextlib.nullcontext() if last else ddp_model.no_sync()", "ddp_model.no_sync()"),
               "never all-reduced"),
        Mutant("one big batch per step: one backward for all micro-batches",
               (replace("batch_size=batch_size, sampler", "batch_size=batch_size * accumulate, sampler"),
                replace("last = (i + 1) % accumulate == 0 or i + 1 == len(loader)", "last = True"),
                replace(" / accumulate).backward()", ").backward()")), "backward passes"),
    ], variants=DDP_VARIANTS),
    ExerciseMutants("04.download_once", NB, ("download_once",), mutants=[
        Mutant("every rank downloads", replace(FETCH, "path = fn(root)"), "every rank called fn"),
        Mutant("global rank 0 downloads for every node",
               replace("mdist.local_rank() == 0 else None", "dist.get_rank() == 0 else None"), "local rank"),
        Mutant("ranks per node hard-coded (rank % 2)",
               replace("mdist.local_rank() == 0 else None", "dist.get_rank() % 2 == 0 else None"),
               "not its node's local rank 0"),
        Mutant("no barrier: the others poll for the file",
               replace(FETCH, "if mdist.local_rank() == 0:\n            return fn(root)\n"
                              "        while not os.path.exists(os.path.join(root, 'data.bin')):\n"
                              "            time.sleep(0.005)\n        return os.path.join(root, 'data.bin')"),
               "before the file was complete"),
        Mutant("the others call fn again after the barrier", replace(PICK, "return path or fn(root)"),
               "only local rank 0 should"),
        Mutant("node 0's path on every node", replace(PICK, "return paths[0]"), "node 0's path"),
        Mutant("the path only on local rank 0", replace(PICK, "return path"), "every rank must return the path"),
        Mutant("the second call answers from memory (fn not called again)",
               (replace("    def wrapper(root):\n        " + FETCH,
                        "    seen = {}\n\n    def wrapper(root):\n        if root in seen:\n            return seen[root]\n"
                        "        " + FETCH),
                replace(PICK, "seen[root] = paths[dist.get_rank() - mdist.local_rank()]\n        return seen[root]")),
               ("did not call fn at all", "fn called by ranks [[], []]")),
    ], variants=DOWNLOAD_VARIANTS),
    ExerciseMutants("04.global_mean", NB, ("global_mean",), mutants=[
        Mutant("the mean of the ranks' means",
               (replace("[float(local_sum), float(local_count)]", "[local_sum / local_count, 1.0]"),
                replace(MEAN, "(totals[0] / dist.get_world_size()).item()")), "averaged the ranks' means"),
        Mutant("only the sum all-reduced", replace(MEAN, "(totals[0] / local_count).item()"),
               "this rank's own count"),
        Mutant("reduce to rank 0 instead of all_reduce",
               replace("dist.all_reduce(totals)", "dist.reduce(totals, dst=0)"), "reduce to rank 0"),
        Mutant("op MAX instead of SUM",
               replace("dist.all_reduce(totals)", "dist.all_reduce(totals, op=dist.ReduceOp.MAX)"), "op max"),
        Mutant("no division by the count", replace(MEAN, "totals[0].item()"), "total sum"),
        Mutant("a tensor instead of a float", replace(MEAN, "totals[0] / totals[1]"), "float"),
        Mutant("the collective's tensor left on the CPU (NCCL refuses it)",
               replace('device = mdist.device() if dist.get_backend() == "nccl" else torch.device("cpu")',
                       'device = torch.device("cpu")'), ("nccl refuses", "given a tensor on cpu")),
        Mutant("sums in float32", replace("dtype=torch.float64", "dtype=torch.float32"),
               ("a float32 holds", "8388608.0")),
    ], variants=MEAN_VARIANTS),
    # the mutant "a rank without samples skips the step" hangs until the check's timeout: it is
    # tests/course/checks/test_checks_04.py's hang test, with the timeout shortened
    ExerciseMutants("04.train_exact", NB, ("train_exact",), mutants=[
        Mutant("DDP's plain average of the ranks' mean losses",
               (replace('nn.CrossEntropyLoss(reduction="sum")', "nn.CrossEntropyLoss()"),
                replace(" * world / len(step)", "")), "plain average of the ranks' mean losses"),
        Mutant("the last, smaller batch dropped",
               replace(STEP, STEP + "\n            if len(step) < global_batch:\n                break"),
               "drops the last"),
        Mutant("the last batch padded from the start of the order",
               replace(STEP, "step = (order[start:] + order)[:global_batch]"), "padded to the full global batch"),
        Mutant("DistributedSampler's padded shards, global_batch // world_size per rank, mean loss",
               sub(r"^    for epoch in range\(epochs\):\n(.*\n)*?            loss = .*$",
                   "    sampler = DistributedSampler(dataset)\n"
                   "    loader = DataLoader(dataset, batch_size=max(1, global_batch // world), sampler=sampler)\n"
                   "    for epoch in range(epochs):\n        sampler.set_epoch(epoch)\n        for x, y in loader:\n"
                   "            x, y = x.to(device), y.to(device)\n"
                   "            loss = nn.functional.cross_entropy(ddp_model(x), y)"),
               "distributedsampler's shards"),
        Mutant("a rank without samples trains on the sample it only read",
               drop_statement("x[:0]"), "only read"),
        Mutant("the loss divided by the global batch only (DDP's average divides again)",
               replace(" * world / len(step)", " / len(step)"), "lr / 3"),
        Mutant("no DDP: gradients never cross the ranks",
               replace('DDP(model, device_ids=[device.index]) if device.type == "cuda" else DDP(model)', "model"),
               "never crossed the ranks"),
        Mutant("the permutation from the global random state",
               replace("torch.randperm(len(dataset), generator=torch.Generator().manual_seed(epoch))",
                       "torch.randperm(len(dataset))"), "generator seeded with the epoch"),
        Mutant("the empty batch made on the CPU (a GPU refuses it)",
               replace(EMPTY, "x, y = torch.zeros(0, *x.shape[1:]), torch.zeros(0, dtype=torch.long)"),
               ("a gpu refuses it", "on cpu")),
        Mutant("the labels left on the CPU", replace("x, y = x.to(device), y.to(device)", "x = x.to(device)"),
               ("here: the labels", "cpu")),
    ], variants=EXACT_VARIANTS),
]


# Every mutant and variant of an exercise is judged by its real checker, through one warm launch per round of
# calls (tests/mutants/batching.py) instead of one launch per answer: the same verdicts.
test_mutant_fails_naming_its_bug, test_correct_variant_passes, test_every_exercise_has_five_mutants_and_two_variants = \
    shared_mutant_tests(SPECS, "04", NAMESPACE)

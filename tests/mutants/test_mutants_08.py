"""Lesson 08's checks against named learner bugs made from the solutions, and correct variants.

Every mutant is the solution cell of ``solutions/08_sharding.ipynb`` with one
bug put in by an edit; its check must fail and say the words in ``expect``.
Every variant is a correct answer written differently; it must get full marks.
"""
from __future__ import annotations

import functools

import pytest

from mutation import ExerciseMutants, Mutant, Variant, drop_statement, mutant_tests, prelude, replace

pytestmark = pytest.mark.timeout(600)
NB = "08_sharding.ipynb"

# -- sharded_sgd_step --------------------------------------------------------------------------
SGD = ExerciseMutants("08.sharded_sgd_step", NB, ("sharded_sgd_step",), mutants=[
    Mutant("the sum of the gradients, not their mean", replace("lr * grad_shard / world", "lr * grad_shard"), "sum"),
    Mutant("no padding", replace("F.pad(grad, (0, pad))", "grad"), "padded for the collectives"),
    Mutant("a strided shard instead of a block", replace("F.pad(param, (0, pad))[rank * s:(rank + 1) * s]",
                                                         "F.pad(param, (0, pad))[rank::world]"), "contiguous block"),
    Mutant("DDP's all-reduce instead of a reduce-scatter", replace(
        "dist.reduce_scatter_single(grad_shard, F.pad(grad, (0, pad)))",
        "summed = F.pad(grad, (0, pad)).clone()\n    dist.all_reduce(summed)\n"
        "    grad_shard = summed[rank * s:(rank + 1) * s]"), "no all-reduce"),
    Mutant("padding left in the result", replace("return full[:n]", "return full"), "cut the padding off"),
    Mutant("a buffer on the default device (fails on GPUs)", replace(
        "torch.empty(s, dtype=grad.dtype, device=grad.device)", "torch.empty(s, dtype=grad.dtype)"),
        ("default device", "meta")),
    Mutant("a float32 buffer for any dtype", replace("torch.empty(s * world, dtype=param.dtype, device=param.device)",
                                                     "torch.empty(s * world, device=param.device)"), "dtype"),
    Mutant("the gradient all-gathered, the whole parameter updated everywhere", (
        replace("updated = mine - lr * grad_shard / world", "updated = grad_shard / world"),
        replace("return full[:n]", "return param - lr * full[:n]")), "all-gathered the gradient"),
], variants=[
    Variant("op=AVG, torch.cat padding, list collectives", '''
import math


def sharded_sgd_step(param, grad, lr):
    world, rank = dist.get_world_size(), dist.get_rank()
    n = param.numel()
    s = math.ceil(n / world)
    padded = torch.cat([grad, grad.new_zeros(s * world - n)])
    mean = grad.new_empty(s)
    dist.reduce_scatter(mean, list(padded.chunk(world)), op=dist.ReduceOp.AVG)
    mine = torch.cat([param, param.new_zeros(s * world - n)])[rank * s:(rank + 1) * s] - lr * mean
    pieces = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(pieces, mine)
    return torch.cat(pieces)[:n]
'''),
    Variant("the deprecated tensor names, an in-place update", '''
import warnings


def sharded_sgd_step(param, grad, lr):
    world, rank = dist.get_world_size(), dist.get_rank()
    n = param.numel()
    s = (n + world - 1) // world
    flat_grad = torch.zeros(s * world, dtype=grad.dtype, device=grad.device)
    flat_grad[:n] = grad
    flat_param = torch.zeros_like(flat_grad)
    flat_param[:n] = param
    shard = torch.empty_like(flat_grad[:s])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        dist.reduce_scatter_tensor(shard, flat_grad)
        shard.div_(world).mul_(-lr).add_(flat_param[rank * s:(rank + 1) * s])
        dist.all_gather_into_tensor(flat_param, shard)
    return flat_param[:n]
'''),
])

# -- ShardedAdam -------------------------------------------------------------------------------
GREEDY = '''        for p in sorted(every, key=lambda p: -p.numel()):  # largest first; the same order on every rank
            rank = load.index(min(load))
            self.owner[p] = rank
            load[rank] += p.numel()
'''
L2 = 'grad = p.grad if group["weight_decay"] == 0 else p.grad + group["weight_decay"] * p'
ADAM = ExerciseMutants("08.ShardedAdam", NB, ("ShardedAdam",), mutants=[
    Mutant("the updated parameters never shared", drop_statement("dist.broadcast(p, src=self.owner[p])"),
           "shares each updated parameter"),
    Mutant("AdamW's decoupled weight decay", replace(L2, 'p.mul_(1 - group["lr"] * group["weight_decay"])\n'
                                                     '                grad = p.grad'), "adamw"),
    Mutant("weight_decay ignored", replace(L2, "grad = p.grad"), "setting given to the constructor"),
    Mutant("every rank steps every parameter: plain Adam", replace("if p.grad is None or self.owner[p] != me:",
                                                                   "if p.grad is None:"), "plain adam"),
    Mutant("owners dealt by position, not balanced by elements", replace(
        GREEDY, "        for i, p in enumerate(every):\n            self.owner[p] = i % len(load)\n"),
        "near 1/world_size of the elements"),
    Mutant("no bias correction", (replace(' / (1 - beta2 ** state["step"]) ** 0.5', ""),
                                  replace(' / (1 - beta1 ** state["step"])', "")), "parameters right there"),
    Mutant("the gradients all-reduced again in the step", replace(
        "        me = dist.get_rank()\n",
        "        me = dist.get_rank()\n        for group in self.param_groups:\n            for p in group['params']:\n"
        "                dist.all_reduce(p.grad)\n                p.grad /= dist.get_world_size()\n"), "all-reduces"),
    Mutant("zero_grad clears only the parameters this rank owns (stale gradients elsewhere)", replace(
        "    @torch.no_grad()\n    def step(self, closure=None):\n",
        "    def zero_grad(self, set_to_none=True):\n        for group in self.param_groups:\n"
        "            for p in group['params']:\n                if self.owner[p] == dist.get_rank():\n"
        "                    p.grad = None\n\n    @torch.no_grad()\n    def step(self, closure=None):\n"),
        ("zero_grad left gradients", "gradients left after zero_grad")),
    Mutant("the parameters split in halves (right on 2 ranks only)", replace(
        GREEDY, "        for i, p in enumerate(every):\n            self.owner[p] = 2 * i // len(every)\n"),
        "near 1/world_size of the elements"),
    Mutant("the constructor's settings for every group", replace(
        'beta1, beta2 = group["betas"]',
        'group = {**group, **self.defaults}\n            beta1, beta2 = group["betas"]'),
        "each parameter group's settings"),
    Mutant("the parameter groups and owners kept on the class (a second optimizer takes them over)", (
        replace("        self.owner = {}\n",
                "        ShardedAdam.owner = {}\n        ShardedAdam.groups = self.param_groups\n"),
        replace("for group in self.param_groups:", "for group in ShardedAdam.groups:", count=2)),
        "belongs to the instance, not to the class"),
], variants=[
    Variant("a torch.optim.Adam over the owned parameters, owners cut in contiguous runs of elements", '''
class ShardedAdam(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        world, me = dist.get_world_size(), dist.get_rank()
        every = [p for group in self.param_groups for p in group["params"]]
        total, seen, self.owner = sum(p.numel() for p in every), 0, {}
        for p in every:
            self.owner[p] = min(world - 1, (seen + p.numel() // 2) * world // total)
            seen += p.numel()
        mine = [{**g, "params": [p for p in g["params"] if self.owner[p] == me]} for g in self.param_groups]
        self.local = torch.optim.Adam([g for g in mine if g["params"]], lr=lr)
        self.state = self.local.state

    def step(self, closure=None):
        self.local.step()
        with torch.no_grad():
            for p in self.owner:
                dist.broadcast(p, src=self.owner[p])
'''),
    Variant("async broadcasts, lerp for the first moment, per-group owners", '''
import math


class ShardedAdam(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.where = {}
        sizes = [0] * dist.get_world_size()
        for group in self.param_groups:
            for p in group["params"]:
                r = min(range(len(sizes)), key=lambda k: (sizes[k], k))
                self.where[id(p)] = r
                sizes[r] += p.numel()

    def step(self, closure=None):
        me = dist.get_rank()
        with torch.no_grad():
            for group in self.param_groups:
                b1, b2 = group["betas"]
                for p in group["params"]:
                    if self.where[id(p)] != me or p.grad is None:
                        continue
                    g = p.grad.add(p, alpha=group["weight_decay"]) if group["weight_decay"] else p.grad
                    st = self.state[p]
                    if "exp_avg" not in st:
                        st.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                    st["step"] += 1
                    st["exp_avg"].lerp_(g, 1 - b1)
                    st["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
                    step_size = group["lr"] / (1 - b1 ** st["step"])
                    denom = st["exp_avg_sq"].sqrt().div_(math.sqrt(1 - b2 ** st["step"])).add_(group["eps"])
                    p.addcdiv_(st["exp_avg"], denom, value=-step_size)
            works = [dist.broadcast(p, src=self.where[id(p)], async_op=True)
                     for group in self.param_groups for p in group["params"]]
            for work in works:
                work.wait()
'''),
])

# -- build_sharded -----------------------------------------------------------------------------
INIT = '''    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(drawn)
        names = {id(layer): name for name, layer in twin.named_modules()}
        for layer in made:  # the order model_fn made them, not the order the model lists them
'''
BUILD = ExerciseMutants("08.build_sharded", NB, ("build_sharded",), mutants=[
    Mutant("built on the CPU, then sharded", replace('with torch.device("meta"):', 'with torch.device("cpu"):', count=0),
           "model_fn() ran"),
    Mutant("materialised and never initialised", replace("    with torch.random.fork_rng(devices=[]):\n",
                                                         "    return model\n    if True:\n"), "to_empty"),
    Mutant("a random initialisation of each rank's shards", replace(
        INIT, '''    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(drawn)
        model.apply(lambda m: m.reset_parameters() if isinstance(m, nn.Linear) else None)
        for layer in []:
'''), "draws other numbers"),
    Mutant("the whole twin materialised at once", (
        replace("    sharded = dict(model.named_modules())\n",
                '    sharded = dict(model.named_modules())\n    twin.to_empty(device="cpu")\n'),
        replace('            layer.to_empty(device="meta", recurse=False)  # freed before the next layer\n', "")),
        "held the whole model"),
    Mutant("only the root sharded", drop_statement("fully_shard(block"), "whole model"),
    Mutant("fully_shard's default mesh", replace(", mesh=mesh)", ")", count=0), "mesh passed in"),
    Mutant("layers drawn in reverse order", replace("for layer in made:", "for layer in reversed(made):"),
           "in the order model_fn() made them"),
    Mutant("layers drawn in the order the model registers them, not the order model_fn makes them", replace(
        "for layer in made:", "for layer in [m for m in twin.modules() if any(m is x for x in made)]:"),
        ("registers it last", "need not be the order the model lists them")),
], variants=[
    Variant("a block at a time, each rank copying its chunk into its local shard", '''
def build_sharded(model_fn, mesh):
    with torch.device("meta"):
        model = model_fn()
    state = torch.random.get_rng_state()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device=mesh.device_type)
    world, rank = dist.get_world_size(), dist.get_rank()
    order, original = [], nn.Linear.reset_parameters

    def noting(layer):  # on meta, each Linear's constructor calls it: the order model_fn makes them
        order.append(layer)
        original(layer)

    nn.Linear.reset_parameters = noting
    try:
        with torch.device("meta"):
            plan = model_fn()
    finally:
        nn.Linear.reset_parameters = original
    torch.random.set_rng_state(state)
    names = {id(m): n for n, m in plan.named_modules()}
    for layer in order:
        prefix = names[id(layer)]
        layer.to_empty(device="cpu")
        layer.reset_parameters()
        for key, full in layer.named_parameters():
            target = model.get_parameter(f"{prefix}.{key}")
            pieces = full.detach().chunk(world)
            with torch.no_grad():
                if rank < len(pieces):
                    target.to_local().copy_(pieces[rank])
        layer.to_empty(device="meta")
    return model
'''),
    Variant("each layer's full weights handed to set_model_state_dict", '''
def build_sharded(model_fn, mesh):
    made = []  # each Linear when its weight is registered, in its constructor: the order model_fn makes them
    handle = nn.modules.module.register_module_parameter_registration_hook(
        lambda module, key, param: made.append(module) if key == "weight" else None)
    try:
        with torch.device("meta"):
            model, plan = model_fn(), model_fn()
    finally:
        handle.remove()
    made = made[len(made) // 2:]  # the second call's: plan's layers
    seeded = torch.get_rng_state()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device=mesh.device_type)
    options = StateDictOptions(full_state_dict=True, strict=False)
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(seeded)
        names = {id(m): n for n, m in plan.named_modules()}
        for name, layer in ((names[id(m)], m) for m in made):
            if isinstance(layer, nn.Linear):
                layer.to_empty(device="cpu", recurse=False)
                layer.reset_parameters()
                set_model_state_dict(model, {f"{name}.{k}": v.detach() for k, v in layer.named_parameters()},
                                     options=options)
                layer.to_empty(device="meta", recurse=False)
    return model
'''),
])

# -- load_full_into_sharded --------------------------------------------------------------------
LOAD_ALL = '    full = torch.load(path, map_location="cpu", weights_only=True) if dist.get_rank() == 0 else {}\n'
LOAD = ExerciseMutants("08.load_full_into_sharded", NB, ("load_full_into_sharded",), mutants=[
    Mutant("every rank reads the file", replace(" if dist.get_rank() == 0 else {}", ""), "other ranks read the file"),
    Mutant("every rank reads the file and takes its part, no broadcast", (
        replace(" if dist.get_rank() == 0 else {}", ""), replace(", broadcast_from_rank0=True", "")),
        "other ranks read the file"),
    Mutant("rank 0 sends the whole state as one object", (
        replace(LOAD_ALL, LOAD_ALL + "    box = [full]\n    dist.broadcast_object_list(box, src=0)\n"
                                     "    full = box[0]\n"),
        replace(", broadcast_from_rank0=True", "")), "whole state"),
    Mutant("the other ranks load an empty dict, no broadcast", replace(", broadcast_from_rank0=True", ""),
           ("raised", "state_dict is empty", "rank = dist.get_rank()=1")),
    Mutant("the full tensors taken as shards", replace("full_state_dict=True, ", ""), "raised"),
], variants=[
    Variant("a broadcast per parameter, each rank copying its chunk", '''
def load_full_into_sharded(model, path):
    world, rank = dist.get_world_size(), dist.get_rank()
    full = torch.load(path, weights_only=True) if rank == 0 else None
    with torch.no_grad():
        for name, p in model.named_parameters():
            buffer = full[name] if rank == 0 else torch.empty(p.shape, dtype=p.dtype)
            dist.broadcast(buffer, src=0)
            pieces = buffer.chunk(world)
            if rank < len(pieces):
                p.to_local().copy_(pieces[rank])
            del buffer
'''),
    Variant("mmap on rank 0, the state dict as a keyword", '''
def load_full_into_sharded(model, path):
    options = StateDictOptions(broadcast_from_rank0=True, full_state_dict=True)
    state = {}
    if dist.get_rank() == 0:
        state = torch.load(path, mmap=True, weights_only=True)
    set_model_state_dict(model, model_state_dict=state, options=options)
'''),
])

SPECS = [SGD, ADAM, BUILD, LOAD]


@functools.cache
def namespace() -> dict:
    """The notebook's first cell (its imports), as every solution cell sees it."""
    ns: dict = {}
    exec(compile(prelude(NB), "<prelude 08>", "exec"), ns)
    return ns


test_mutant_fails_naming_its_bug, test_correct_variant_passes, test_every_exercise_has_five_mutants_and_two_variants = \
    mutant_tests(SPECS, "08", namespace)

"""Lesson 08's checks against named learner bugs made from the solutions, and correct variants.

Every mutant is the solution cell of ``solutions/08_sharding.ipynb`` with one
bug put in by an edit; its check must fail and say the words in ``expect``.
Every variant is a correct answer written differently; it must get full marks.
"""
from __future__ import annotations

import functools

import pytest

from batching import shared_mutant_tests
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


# -- MiniFSDP ----------------------------------------------------------------------------------
GATHER = "            dist.all_gather_single(full, shard.detach().to(dtype))\n"
MINI = ExerciseMutants("08.MiniFSDP", NB, ("MiniFSDP",), mutants=[
    Mutant("DDP's all-reduce of the full gradients", replace(
        "dist.reduce_scatter_single(mine, flat)", "dist.all_reduce(flat)\n                    mine.copy_(flat.chunk(world)[rank])"),
        "no all-reduce"),
    Mutant("the sum of the ranks' gradients, not their mean", replace("return (mine / world,", "return (mine,"),
           "averaged over the ranks"),
    Mutant("each rank's own gradient, never combined", replace(
        "dist.reduce_scatter_single(mine, flat)", "mine.copy_(flat.chunk(world)[rank])"), "averaged over the ranks"),
    Mutant("the module's full weights kept alive", replace("del unit._parameters[name]", "pass"),
           "full weights of the module it was given"),
    Mutant("every gathered unit kept (never freed)", (
        replace("        def gather(k, dtype):", "        kept = []\n\n        def gather(k, dtype):"),
        replace(GATHER, GATHER + "            kept.append(full)\n")), "still alive"),
    Mutant("forward's full weights kept for backward", (
        replace("return run(k, original, gather(k, dtype), inputs)",
                "ctx.full = gather(k, dtype)\n                    return run(k, original, ctx.full, inputs)"),
        replace("gather(k, compute_dtype or shard.dtype).items()", "ctx.full.items()")), "autograd keeps them"),
    Mutant("weights gathered in fp32, cast after (twice the bytes)", replace(
        "full = torch.empty(shard.numel() * world, dtype=dtype, device=shard.device)\n" + GATHER,
        "full = torch.empty(shard.numel() * world, dtype=shard.dtype, device=shard.device)\n"
        "            dist.all_gather_single(full, shard.detach())\n            full = full.to(dtype)\n"),
        "half the bytes"),
    Mutant("a buffer on the default device (fails on GPUs)", replace(
        "torch.empty(shard.numel() * world, dtype=dtype, device=shard.device)",
        "torch.empty(shard.numel() * world, dtype=dtype)"), ("default device", "meta")),
    Mutant("torch's own FSDP2 called on the module", replace(
        "        self.gather = gather\n",
        "        self.gather = gather\n        torch.distributed.fsdp.fully_shard(module)\n"),
        "your code calls torch.distributed.fsdp.fully_shard"),
], variants=[
    Variant("a unit per block, a shard per parameter, list collectives", '''
class MiniFSDP(nn.Module):
    def __init__(self, module, compute_dtype=None):
        super().__init__()
        self.world, self.rank, self.dtype = dist.get_world_size(), dist.get_rank(), compute_dtype
        self._inner = [module]
        self.pieces = nn.ParameterList()
        self.units = []  # (unit module, [(owner module, attribute, full name, shape, piece index)])
        roots = [m for m in module.children()]
        if list(module.parameters(recurse=False)):
            roots.append(module)
        todo = list(module.children())
        names = {id(m): n for n, m in module.named_modules()}
        while todo:
            unit = todo.pop(0)
            if isinstance(unit, (nn.ModuleList, nn.ModuleDict)):
                todo = list(unit.children()) + todo
                continue
            entries = []
            for m in list(unit.modules()):
                for attr, p in list(m.named_parameters(recurse=False)):
                    per = (p.numel() + self.world - 1) // self.world
                    padded = torch.zeros(per * self.world, dtype=p.dtype, device=p.device)
                    padded[:p.numel()] = p.detach().reshape(-1)
                    self.pieces.append(nn.Parameter(padded[self.rank * per:(self.rank + 1) * per].clone()))
                    entries.append((m, attr, f"{names[id(m)]}.{attr}", p.shape, len(self.pieces) - 1))
                    delattr(m, attr)
            if entries:
                self.units.append((unit, entries))
                unit.forward = self._wrap(len(self.units) - 1, unit.forward)

    def _full(self, u, dtype):
        out = []
        for m, attr, name, shape, i in self.units[u][1]:
            piece = self.pieces[i].detach().to(dtype)
            parts = [torch.empty_like(piece) for _ in range(self.world)]
            dist.all_gather(parts, piece)
            out.append(torch.cat(parts)[:shape.numel()].view(shape))
        return out

    def _call(self, u, fn, weights, xs):
        entries = self.units[u][1]
        for (m, attr, *_), w in zip(entries, weights):
            object.__setattr__(m, attr, w)
        try:
            return fn(*xs)
        finally:
            for m, attr, *_ in entries:
                object.__delattr__(m, attr)

    def _wrap(self, u, fn):
        me = self

        class Unit(torch.autograd.Function):
            @staticmethod
            def forward(ctx, *args):
                xs = args[len(me.units[u][1]):]
                ctx.save_for_backward(*xs)
                dtype = me.dtype or torch.float32
                low = [x.to(dtype) if x.is_floating_point() else x for x in xs]
                return me._call(u, fn, me._full(u, dtype), low)

            @staticmethod
            def backward(ctx, grad):
                xs = [x.detach().requires_grad_(x.requires_grad) for x in ctx.saved_tensors]
                dtype = me.dtype or torch.float32
                weights = [w.requires_grad_() for w in me._full(u, dtype)]
                with torch.enable_grad():
                    out = me._call(u, fn, weights, [x.to(dtype) if x.is_floating_point() else x for x in xs])
                    needs = [x for x in xs if x.requires_grad]
                    got = torch.autograd.grad(out, weights + needs, grad.to(out.dtype))
                pieces = []
                for (m, attr, name, shape, i), g in zip(me.units[u][1], got):
                    target = me.pieces[i]
                    flat = torch.zeros(target.numel() * me.world, dtype=target.dtype, device=target.device)
                    flat[:g.numel()] = g.reshape(-1).to(target.dtype)
                    summed = torch.empty_like(target)
                    dist.reduce_scatter(summed, list(flat.chunk(me.world)))
                    pieces.append(summed / me.world)
                rest = iter(got[len(weights):])
                return (*pieces, *[next(rest) if x.requires_grad else None for x in xs])

        return lambda *xs: Unit.apply(*[self.pieces[e[4]] for e in self.units[u][1]], *xs)

    def forward(self, *args, **kwargs):
        return self._inner[0](*args, **kwargs)

    def finish_gradient_synchronization(self):
        return None

    def gather_full_params(self):
        with torch.no_grad():
            return {e[2].lstrip("."): w.float().clone() for u in range(len(self.units))
                    for e, w in zip(self.units[u][1], self._full(u, torch.float32))}
'''),
    Variant("FSDP's way: storage freed and refilled by module hooks, async reduce-scatters finished later", '''
class MiniFSDP(nn.Module):
    def __init__(self, module, compute_dtype=None):
        super().__init__()
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.dtype, self.pending, self.owned = compute_dtype, [], []
        object.__setattr__(self, "inner", module)
        self.shards = nn.ParameterList()
        for prefix, layer in list(module.named_modules()):
            mine = list(layer.named_parameters(recurse=False))
            for key, p in mine:
                s = -(-p.numel() // self.world)
                flat = torch.zeros(s * self.world, dtype=p.dtype, device=p.device)
                flat[:p.numel()] = p.detach().flatten()
                shard = nn.Parameter(flat[self.rank * s:(self.rank + 1) * s].clone())
                self.shards.append(shard)
                full = torch.empty(p.shape, dtype=compute_dtype or p.dtype, device=p.device, requires_grad=True)
                full.untyped_storage().resize_(0)  # no memory until the layer computes
                del layer._parameters[key]
                setattr(layer, key, full)
                full.register_post_accumulate_grad_hook(lambda t, shard=shard: self._scatter(t, shard))
                self.owned.append((f"{prefix}.{key}".lstrip("."), layer, key, shard))
            if mine:
                layer.register_forward_pre_hook(self._before)
                layer.register_forward_hook(lambda m, args, out: self._free(m))
                layer.register_full_backward_pre_hook(lambda m, grad: self._fill(m))

    def _fill(self, layer):
        for name, owner, key, shard in self.owned:
            if owner is layer:
                full = getattr(layer, key)
                dtype = full.dtype
                full.untyped_storage().resize_(shard.numel() * self.world * full.element_size())
                into = torch.empty(shard.numel() * self.world, dtype=dtype, device=shard.device)
                dist.all_gather_single(into, shard.detach().to(dtype))
                full.data.copy_(into[:full.numel()].view(full.shape))

    def _before(self, layer, args):
        self._fill(layer)
        if self.dtype is None:
            return None
        return tuple(a.to(self.dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args)

    def _free(self, layer):
        for name, owner, key, shard in self.owned:
            if owner is layer:
                getattr(layer, key).untyped_storage().resize_(0)

    def _scatter(self, full, shard):
        flat = torch.zeros(shard.numel() * self.world, dtype=shard.dtype, device=shard.device)
        flat[:full.numel()] = full.grad.flatten().to(shard.dtype)
        full.grad = None
        full.untyped_storage().resize_(0)  # its backward is done: the layer's input gradient used it already
        out = torch.empty_like(shard)
        self.finish_gradient_synchronization()  # one reduce-scatter in flight at a time: its buffers are a layer's
        self.pending.append((dist.reduce_scatter_single(out, flat, async_op=True), out, shard))

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs)

    def finish_gradient_synchronization(self):
        for work, out, shard in self.pending:
            work.wait()
            shard.grad = out / self.world if shard.grad is None else shard.grad + out / self.world
        self.pending.clear()

    def gather_full_params(self):
        out = {}
        for name, layer, key, shard in self.owned:
            full = torch.empty(shard.numel() * self.world, dtype=shard.dtype, device=shard.device)
            dist.all_gather_single(full, shard.detach())
            out[name] = full[:getattr(layer, key).numel()].view(getattr(layer, key).shape).clone()
        return out
'''),
])

SPECS = [SGD, ADAM, BUILD, LOAD]


@functools.cache
def namespace() -> dict:
    """The notebook's first cell (its imports), as every solution cell sees it."""
    ns: dict = {}
    exec(compile(prelude(NB), "<prelude 08>", "exec"), ns)
    return ns


# every exercise's answers judged together too (the first test of an exercise judges them all): the four exercises
# before MiniFSDP in 38 s instead of 52 s, 63 core-seconds instead of 85 (idle 2-core machine, 2026-11-29)
test_mutant_fails_naming_its_bug, test_correct_variant_passes, _ = shared_mutant_tests(SPECS, "08", namespace)
_, _, test_every_exercise_has_five_mutants_and_two_variants = mutant_tests(SPECS + [MINI], "08", namespace)
# MiniFSDP's answers are judged together (tests/mutants/batching.py): one launch of 2 ranks and one of 3 ranks for
# all of them, instead of two per answer; the verdicts are check()'s
test_minifsdp_mutant_fails_naming_its_bug, test_minifsdp_variant_passes, _ = shared_mutant_tests([MINI], "08", namespace)
# the first of them judges all eleven answers (about 90 s on an idle 2-core machine, 9 minutes at a load of 20)
test_minifsdp_mutant_fails_naming_its_bug = pytest.mark.timeout(1500)(test_minifsdp_mutant_fails_naming_its_bug)
test_minifsdp_variant_passes = pytest.mark.timeout(1500)(test_minifsdp_variant_passes)

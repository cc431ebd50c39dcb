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

# -- zero_memory -------------------------------------------------------------------------------
ZERO = ExerciseMutants("08.zero_memory", NB, ("zero_memory",), mutants=[
    Mutant("shard rounded down", replace("-(-n_params // world_size)", "n_params // world_size"), "rounds down"),
    Mutant("shard as a float", replace("-(-n_params // world_size)", "n_params / world_size"), "return an int"),
    Mutant("stage 1 shards the gradients too",
           replace("grads = n_params if stage < 2", "grads = n_params if stage < 1"), "stage 1"),
    Mutant("stage 3 keeps the parameters whole", replace("params = n_params if stage < 3 else shard",
                                                         "params = n_params"), "stage 3"),
    Mutant("optimizer state fixed at 8 bytes", replace("optim * optim_bytes", "optim * 8"), "optim_bytes"),
    Mutant("any stage accepted", drop_statement("ZeRO has stages"), ("valueerror", "stage")),
    Mutant("sizes not checked", drop_statement("must be positive"), ("valueerror", "n_params")),
], variants=[
    Variant("math.ceil and a table of what each stage shards", '''
import math


def zero_memory(n_params, world_size, stage, param_bytes=4, grad_bytes=4, optim_bytes=8):
    sharded = {0: (False, False, False), 1: (False, False, True), 2: (False, True, True), 3: (True, True, True)}
    if stage not in sharded:
        raise ValueError(f"no ZeRO stage {stage}")
    if min(n_params, world_size, param_bytes, grad_bytes, optim_bytes) < 1:
        raise ValueError("sizes must be positive")
    shard = math.ceil(n_params / world_size)
    return sum((shard if s else n_params) * b for s, b in zip(sharded[stage], (param_bytes, grad_bytes, optim_bytes)))
'''),
    Variant("an if/elif per stage, divmod for the shard", '''
def zero_memory(n_params, world_size, stage, param_bytes=4, grad_bytes=4, optim_bytes=8):
    for value in (n_params, world_size, param_bytes, grad_bytes, optim_bytes):
        if value <= 0:
            raise ValueError(f"{value} is not positive")
    q, r = divmod(n_params, world_size)
    shard = q + (r > 0)
    if stage == 0:
        return n_params * (param_bytes + grad_bytes + optim_bytes)
    elif stage == 1:
        return n_params * (param_bytes + grad_bytes) + shard * optim_bytes
    elif stage == 2:
        return n_params * param_bytes + shard * (grad_bytes + optim_bytes)
    elif stage == 3:
        return shard * (param_bytes + grad_bytes + optim_bytes)
    raise ValueError(f"stage {stage} is not 0, 1, 2 or 3")
'''),
])

# -- sharded_sgd_step --------------------------------------------------------------------------
SGD = ExerciseMutants("08.sharded_sgd_step", NB, ("sharded_sgd_step",), mutants=[
    Mutant("the sum of the gradients, not their mean", replace("lr * grad_shard / world", "lr * grad_shard"), "sum"),
    Mutant("no padding", replace("F.pad(grad, (0, pad))", "grad"), "pad to a multiple"),
    Mutant("a strided shard instead of a block", replace("F.pad(param, (0, pad))[rank * s:(rank + 1) * s]",
                                                         "F.pad(param, (0, pad))[rank::world]"), "contiguous block"),
    Mutant("DDP's all-reduce instead of a reduce-scatter", replace(
        "dist.reduce_scatter_single(grad_shard, F.pad(grad, (0, pad)))",
        "summed = F.pad(grad, (0, pad)).clone()\n    dist.all_reduce(summed)\n"
        "    grad_shard = summed[rank * s:(rank + 1) * s]"), "no all-reduce"),
    Mutant("padding left in the result", replace("return full[:n]", "return full"), "cut the padding off"),
    Mutant("a buffer on the default device (fails on GPUs)", replace(
        "torch.empty(s, dtype=grad.dtype, device=grad.device)", "torch.empty(s, dtype=grad.dtype)"),
        ("device=grad.device", "meta")),
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

# -- shard_model -------------------------------------------------------------------------------
SHARD = ExerciseMutants("08.shard_model", NB, ("shard_model",), mutants=[
    Mutant("only the root", drop_statement("fully_shard(block"), "whole model"),
    Mutant("the root left unsharded", drop_statement("fully_shard(model"), ("plain", "fully_shard(model, mesh=mesh)")),
    Mutant("no mesh passed: fully_shard's default mesh", replace(", mesh=mesh)", ")", count=0), "mesh passed in"),
    Mutant("the root before the blocks", replace(
        "    for block in model.blocks:\n        fully_shard(block, mesh=mesh)\n    fully_shard(model, mesh=mesh)\n",
        "    fully_shard(model, mesh=mesh)\n    for block in model.blocks:\n        fully_shard(block, mesh=mesh)\n"),
        "bottom-up"),
    Mutant("every child, the ModuleList included", replace("for block in model.blocks:",
                                                            "for block in model.children():"), "modulelist"),
    Mutant("only the first block", replace("for block in model.blocks:", "for block in model.blocks[:1]:"),
           "blocks.1"),
    Mutant("nothing returned", drop_statement("return model"), ("return model", "nonetype")),
    Mutant("a bfloat16 policy on the root", replace(
        "fully_shard(model, mesh=mesh)",
        "fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))"),
        "bfloat16"),
], variants=[
    Variant("indices, reshard_after_forward=True, fully_shard's own return value", '''
def shard_model(model, mesh):
    for i in range(len(model.blocks)):
        fully_shard(model.blocks[i], mesh=mesh, reshard_after_forward=True)
    return fully_shard(model, mesh=mesh)
'''),
    Variant("the blocks kept unsharded from forward to backward (ZeRO-2's traffic)", '''
from torch.distributed.fsdp import fully_shard as shard


def shard_model(model, mesh):
    [shard(block, mesh=mesh, reshard_after_forward=False) for block in model.blocks]
    shard(model, mesh=mesh)
    return model
'''),
])

# -- dcp_checkpoint ----------------------------------------------------------------------------
DCP = ExerciseMutants("08.dcp_checkpoint", NB, ("save_checkpoint", "load_checkpoint"), mutants=[
    Mutant("the full state gathered on every rank before saving", replace(
        "    model_state, optim_state = get_state_dict(model, optimizer)\n    dcp.save",
        "    model_state, optim_state = get_state_dict(model, optimizer, "
        "options=StateDictOptions(full_state_dict=True))\n    dcp.save"), "full_state_dict"),
    Mutant("the model saved without the optimizer", replace('dcp.save({"model": model_state, "optim": optim_state}',
                                                            'dcp.save({"model": model_state}'), "optimizer"),
    Mutant("torch.save on rank 0", replace(
        '    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)',
        '    if dist.get_rank() == 0:\n        os.makedirs(path, exist_ok=True)\n'
        '        torch.save({"model": model_state, "optim": optim_state}, os.path.join(path, "ckpt.pt"))\n'
        '    dist.barrier()'), ".metadata"),
    Mutant("a checkpoint directory per rank", replace(
        "checkpoint_id=path)", 'checkpoint_id=os.path.join(path, f"rank{dist.get_rank()}"))', count=0),
        "rank1"),  # dcp.save then fails, or writes rank0/ ... rank3/ (which of the two depends on timing)
    Mutant("the optimizer's own state_dict(): empty before its first step", replace(
        "    model_state, optim_state = get_state_dict(model, optimizer)\n    state =",
        "    model_state, optim_state = get_state_dict(model, optimizer)[0], optimizer.state_dict()\n    state ="),
        ("missing key", "optim.state.0")),
], variants=[
    Variant("a Stateful app state, as in PyTorch's DCP recipe", '''
from torch.distributed.checkpoint.stateful import Stateful


class AppState(Stateful):
    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self):
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optim": optim_state}

    def load_state_dict(self, state):
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def save_checkpoint(model, optimizer, path):
    dcp.save({"app": AppState(model, optimizer)}, checkpoint_id=path)


def load_checkpoint(model, optimizer, path):
    dcp.load({"app": AppState(model, optimizer)}, checkpoint_id=path)
'''),
    Variant("model and optimizer state dicts apart, explicit file-system writer and reader", '''
from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict, set_optimizer_state_dict)


def save_checkpoint(model, optimizer, path):
    state = {"m": get_model_state_dict(model), "o": get_optimizer_state_dict(model, optimizer)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path))


def load_checkpoint(model, optimizer, path):
    state = {"m": get_model_state_dict(model), "o": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, storage_reader=dcp.FileSystemReader(path))
    set_model_state_dict(model, state["m"])
    set_optimizer_state_dict(model, optimizer, state["o"])
'''),
])

SPECS = [ZERO, SGD, SHARD, DCP]


@functools.cache
def namespace() -> dict:
    """The notebook's first cell (its imports), as every solution cell sees it."""
    ns: dict = {}
    exec(compile(prelude(NB), "<prelude 08>", "exec"), ns)
    return ns


test_mutant_fails_naming_its_bug, test_correct_variant_passes, test_every_exercise_has_five_mutants_and_two_variants = \
    mutant_tests(SPECS, "08", namespace)

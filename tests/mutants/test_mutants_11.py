"""Lesson 11's named mutants (learner bugs put into the solution's source) and correct variants."""
from __future__ import annotations

import functools

import pytest

from mutation import ExerciseMutants, Mutant, Variant, mutant_tests, prelude, replace, solution_cell

pytestmark = pytest.mark.timeout(600)
NOTEBOOK = "11_tensor_parallel.ipynb"

COPY_BACKWARD = "        grad = grad.clone()\n        dist.all_reduce(grad)\n        return grad\n"
MLP_BODY = ("    h = F.gelu(F.linear(CopyToTP.apply(x), w1_shard, b1_shard))\n"
            "    return ReduceFromTP.apply(F.linear(h, w2_shard)) + b2\n")
REDUCE_BACKWARD = "    def backward(ctx, grad):\n        ### BEGIN SOLUTION\n        return grad\n"
MLP = ExerciseMutants("11.tp_mlp", NOTEBOOK, ("tp_mlp", "CopyToTP", "ReduceFromTP"), mutants=[
    Mutant("ReduceFromTP all-reduces in backward too (the wrong conjugate)",
           replace(REDUCE_BACKWARD, REDUCE_BACKWARD.replace("return grad", "grad = grad.clone()\n"
                                                            "        dist.all_reduce(grad)\n        return grad")),
           expect=("wrong conjugate", "2 times")),
    Mutant("CopyToTP's backward does not all-reduce", replace(COPY_BACKWARD, "        return grad\n"),
           expect=("own gradient", "x's gradient holds only this rank's slice")),
    Mutant("CopyToTP's backward averages over the ranks",
           replace(COPY_BACKWARD, COPY_BACKWARD.replace("return grad", "return grad / dist.get_world_size()")),
           expect="averaged"),
    Mutant("GELU applied after the reduction",
           replace(MLP_BODY, "    h = F.linear(CopyToTP.apply(x), w1_shard, b1_shard)\n"
                             "    return F.gelu(ReduceFromTP.apply(F.linear(h, w2_shard))) + b2\n"),
           expect="gelu was applied after the sum"),
    Mutant("fc2's bias added on every rank before the reduce",
           replace("ReduceFromTP.apply(F.linear(h, w2_shard)) + b2", "ReduceFromTP.apply(F.linear(h, w2_shard, b2))"),
           expect="added on every rank before the sum"),
    Mutant("x enters the TP region without CopyToTP",
           replace("F.linear(CopyToTP.apply(x), w1_shard, b1_shard)", "F.linear(x, w1_shard, b1_shard)"),
           expect=("x's gradient holds only this rank's slice", "no collective in backward")),
    Mutant("ReduceFromTP's forward forgets to sum",
           replace("        total = partial.clone()\n        dist.all_reduce(total)\n",
                   "        total = partial.clone()\n"),
           expect=("own partial sum", "no collective forward")),
    Mutant("tp_mlp built from DTensors (torch's own TP: the same outputs, gradients and collectives, no conjugates "
           "of its own)",
           replace(MLP_BODY, "    mesh = init_device_mesh('cpu', (dist.get_world_size(),))\n"
                             "    w1 = DTensor.from_local(w1_shard, mesh, [Shard(0)])\n"
                             "    b1 = DTensor.from_local(b1_shard, mesh, [Shard(0)])\n"
                             "    w2 = DTensor.from_local(w2_shard, mesh, [Shard(1)])\n"
                             "    h = F.gelu(F.linear(DTensor.from_local(x, mesh, [Replicate()]), w1, b1))\n"
                             "    return F.linear(h, w2).redistribute(mesh, [Replicate()]).to_local() + b2\n"),
           expect="dtensor.from_local"),
], variants=[
    Variant("explicit group and op, matmuls instead of F.linear", '''
class CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad_output):
        summed = grad_output.contiguous().clone()
        dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=dist.group.WORLD)
        return summed


class ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        out = x.contiguous().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=dist.group.WORLD)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output.clone()


def tp_mlp(x, w1_shard, b1_shard, w2_shard, b2):
    inside = CopyToTP.apply(x)
    hidden = torch.nn.functional.gelu(inside @ w1_shard.T + b1_shard)
    return b2 + ReduceFromTP.apply(hidden @ w2_shard.T)
'''),
    Variant("Functions that take the group, addmm for fc1", '''
class CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group=None):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        total = grad.clone()
        dist.all_reduce(total, group=ctx.group)
        return total, None


class ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, partial, group=None):
        out = partial.detach().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def tp_mlp(x, w1_shard, b1_shard, w2_shard, b2):
    pre = torch.addmm(b1_shard, CopyToTP.apply(x).reshape(-1, x.shape[-1]), w1_shard.t())
    out = ReduceFromTP.apply(F.gelu(pre) @ w2_shard.t()) + b2
    return out.reshape(*x.shape[:-1], -1)
'''),
])

GATHER_FORWARD = ("            parts = [torch.empty_like(part) for _ in range(dist.get_world_size())]\n"
                  "            dist.all_gather(parts, part.contiguous())\n"
                  "            return torch.cat(parts, dim=1)\n")
SCATTER_FORWARD = ("            pieces = [p.contiguous() for p in partial.chunk(dist.get_world_size(), dim=1)]\n"
                   "            mine = torch.empty_like(pieces[0])\n            dist.reduce_scatter(mine, pieces)\n"
                   "            return mine\n")
GATHER_BACKWARD = SCATTER_FORWARD.replace("partial.chunk", "grad.chunk")
NORM_WEIGHTS = "    weight, bias = CopyToTP.apply(norm.weight), CopyToTP.apply(norm.bias)"
SP_BODY = ("    h = F.layer_norm(x_shard, norm.normalized_shape, weight, bias, norm.eps)\n"
           "    h = F.gelu(F.linear(GatherSequence.apply(h), w1_shard, b1_shard))\n")
SP = ExerciseMutants("11.sp_mlp", NOTEBOOK, ("sp_mlp",), mutants=[
    Mutant("norm's gradients left partial (each rank's norm saw only its slice)",
           replace(NORM_WEIGHTS, "    weight, bias = norm.weight, norm.bias"),
           expect="norm.weight's gradient holds this rank's slice of the sequence's contribution only"),
    Mutant("an all-reduce where a reduce-scatter belongs",
           replace(SCATTER_FORWARD, "            total = partial.clone()\n            dist.all_reduce(total)\n"
                                    "            return total.chunk(dist.get_world_size(), dim=1)[dist.get_rank()]"
                                    ".contiguous()\n"),
           expect="an all-reduce in forward"),
    Mutant("the sequence gathered along the wrong dimension (the batch's)",
           replace(GATHER_FORWARD, GATHER_FORWARD.replace("dim=1", "dim=0")),
           expect="the shapes do not line up"),
    Mutant("the bias added on every rank before the reduce-scatter",
           replace("ScatterSequence.apply(F.linear(h, w2_shard)) + CopyToTP.apply(b2)",
                   "ScatterSequence.apply(F.linear(h, w2_shard, b2))"),
           expect="b2 counts tp times"),
    Mutant("b2's gradient left partial", replace("+ CopyToTP.apply(b2)", "+ b2"),
           expect="b2's gradient holds this rank's slice"),
    Mutant("the gather's buffers made without device= (CPU tensors on a GPU rank)",
           replace("parts = [torch.empty_like(part) for", "parts = [torch.empty(part.shape) for"),
           expect="lands on torch's default device"),
    Mutant("the norm applied to the whole gathered sequence",
           replace(SP_BODY, "    h = F.layer_norm(GatherSequence.apply(x_shard), norm.normalized_shape, weight, bias, "
                            "norm.eps)\n    h = F.gelu(F.linear(h, w1_shard, b1_shard))\n"),
           expect="the norm ran on the whole gathered sequence"),
    Mutant("the gather's backward keeps its own slice of the gradient, unsummed",
           replace(GATHER_BACKWARD, "            return grad.chunk(dist.get_world_size(), dim=1)[dist.get_rank()]"
                                    ".contiguous()\n"),
           expect=("x_shard's gradient", "brings the gathered sequence's gradient back")),
], variants=[
    Variant("into-tensor collectives on a sequence-first layout; norm's and b2's gradients summed in one all-reduce",
            """
class SeqGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, part):
        local = part.transpose(0, 1).contiguous()
        out = local.new_empty((local.shape[0] * dist.get_world_size(), *local.shape[1:]))
        dist.all_gather_into_tensor(out, local)
        return out.transpose(0, 1)

    @staticmethod
    def backward(ctx, grad):
        whole = grad.transpose(0, 1).contiguous()
        out = whole.new_empty((whole.shape[0] // dist.get_world_size(), *whole.shape[1:]))
        dist.reduce_scatter_tensor(out, whole)
        return out.transpose(0, 1)


class SeqScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, partial):
        return SeqGather.backward(ctx, partial)

    @staticmethod
    def backward(ctx, grad):
        return SeqGather.forward(ctx, grad)


class SharedGrads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, *params):
        ctx.shapes = [p.shape for p in params]
        return tuple(p.view_as(p) for p in params)

    @staticmethod
    def backward(ctx, *grads):
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        parts = flat.split([s.numel() for s in ctx.shapes])
        return tuple(p.view(s) for p, s in zip(parts, ctx.shapes))


def sp_mlp(x_shard, norm, w1_shard, b1_shard, w2_shard, b2):
    weight, bias, out_bias = SharedGrads.apply(norm.weight, norm.bias, b2)
    normed = F.layer_norm(x_shard, x_shard.shape[-1:], weight, bias, norm.eps)
    hidden = F.gelu(SeqGather.apply(normed) @ w1_shard.t() + b1_shard)
    return SeqScatter.apply(hidden @ w2_shard.t()) + out_bias + x_shard
"""),
    Variant("explicit group, the norm's parameters summed by hooks on per-call views", """
class ToWhole(torch.autograd.Function):
    @staticmethod
    def forward(ctx, part, group):
        ctx.group = group
        parts = [torch.zeros_like(part) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, part.contiguous(), group=group)
        return torch.cat(parts, dim=-2)

    @staticmethod
    def backward(ctx, grad):
        pieces = list(grad.contiguous().chunk(dist.get_world_size(ctx.group), dim=-2))
        out = torch.zeros_like(pieces[0])
        dist.reduce_scatter(out, [p.contiguous() for p in pieces], op=dist.ReduceOp.SUM, group=ctx.group)
        return out, None


class ToSlice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, partial, group):
        ctx.group = group
        pieces = [p.contiguous() for p in partial.chunk(dist.get_world_size(group), dim=-2)]
        out = torch.zeros_like(pieces[0])
        dist.reduce_scatter(out, pieces, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        parts = [torch.zeros_like(grad) for _ in range(dist.get_world_size(ctx.group))]
        dist.all_gather(parts, grad.contiguous(), group=ctx.group)
        return torch.cat(parts, dim=-2), None


def _summed(t):
    view = t.view_as(t)
    view.register_hook(lambda g: _all_reduced(g))
    return view


def _all_reduced(g):
    g = g.clone()
    dist.all_reduce(g, group=dist.group.WORLD)
    return g


def sp_mlp(x_shard, norm, w1_shard, b1_shard, w2_shard, b2):
    group = dist.group.WORLD
    h = F.layer_norm(x_shard, norm.normalized_shape, _summed(norm.weight), _summed(norm.bias), norm.eps)
    h = torch.addmm(b1_shard, ToWhole.apply(h, group).flatten(0, 1), w1_shard.t())
    out = F.gelu(h) @ w2_shard.t()
    return x_shard + _summed(b2) + ToSlice.apply(out.view(x_shard.shape[0], -1, out.shape[-1]), group)
"""),
])

PREPARE = ('        "attn": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),)),\n')
PREPARE_MLP = PREPARE.replace('"attn"', '"mlp"')
PLAN = ExerciseMutants("11.tp_plan", NOTEBOOK, ("tp_plan",), mutants=[
    Mutant("no PrepareModuleInput: wq, wk and wv each all-reduce the gradient of attention's input",
           (replace(PREPARE, ""), replace(PREPARE_MLP, "")), expect="once per projection"),
    Mutant("wo column-parallel (split along the wrong dimension)",
           replace('"attn.wo": RowwiseParallel(output_layouts=between)', '"attn.wo": ColwiseParallel()'),
           expect="split along the wrong dimension"),
    Mutant("fc1 row-parallel and fc2 column-parallel (swapped)",
           (replace('"mlp.fc1": ColwiseParallel()', '"mlp.fc1": RowwiseParallel()'),
            replace('"mlp.fc2": RowwiseParallel(output_layouts=between)', '"mlp.fc2": ColwiseParallel()')),
           expect=("mlp.fc1 is given rowwiseparallel", "wrong dimension")),
    Mutant("SP without SequenceParallel on the norms",
           replace('        plan["norm1"] = SequenceParallel()\n        plan["norm2"] = SequenceParallel()\n',
                   "        pass\n"),
           expect=("norm1's weights differ", "summed over the tp ranks")),
    Mutant("SP declared nowhere: the activations between the parts taken as replicated",
           replace("between = Shard(1) if sequence_parallel else Replicate()", "between = Replicate()"),
           expect="no all-reduce"),
    Mutant("with SP no PrepareModuleInput: wq, wk, wv and fc1 each gather the sequence",
           (replace(PREPARE, "        **({} if sequence_parallel else {" + PREPARE.strip()[:-1] + "}),\n"),
            replace(PREPARE_MLP, "        **({} if sequence_parallel else {" + PREPARE_MLP.strip()[:-1] + "}),\n")),
           expect="4 all-gathers of the sequence in forward, not 2"),
    Mutant("attention left out of the plan (only the MLP split)",
           replace('        "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),\n'
                   '        "attn.wo": RowwiseParallel(output_layouts=between),\n', ""),
           expect=("leaves attn.wq", "whole on every rank")),
], variants=[
    Variant("built in a loop, single placements, SequenceParallel(sequence_dim=1)", '''
def tp_plan(block, sequence_parallel):
    outside = Shard(1) if sequence_parallel else Replicate()
    plan = {}
    for part, first, last in (("attn", ("wq", "wk", "wv"), "wo"), ("mlp", ("fc1",), "fc2")):
        plan[part] = PrepareModuleInput(input_layouts=outside, desired_input_layouts=Replicate())
        for name in first:
            plan[f"{part}.{name}"] = ColwiseParallel(input_layouts=Replicate())
        plan[f"{part}.{last}"] = RowwiseParallel(output_layouts=outside, use_local_output=True)
    for norm in ("norm1", "norm2"):
        if sequence_parallel:
            plan[norm] = SequenceParallel(sequence_dim=1)
    return plan
'''),
    Variant("two literal dicts", '''
def tp_plan(block, sequence_parallel):
    if not sequence_parallel:
        return {
            "attn": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)),
            "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)),
            "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel(),
        }
    return {
        "norm1": SequenceParallel(), "norm2": SequenceParallel(),
        "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
        "attn.wo": RowwiseParallel(output_layouts=Shard(1)),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel(output_layouts=Shard(1)),
    }
'''),
])

TP_LOOP = ("    for b in model.blocks:\n"
           "        parallelize_module(b, mesh[\"tp\"], tp_plan(b, sequence_parallel=True))\n")
FSDP_LOOP = "    for b in model.blocks:\n        fully_shard(b, mesh=mesh[\"dp\"])\n"
TWO_D = ExerciseMutants("11.parallelize_2d", NOTEBOOK, ("parallelize_2d",), mutants=[
    Mutant("FSDP applied before TP", replace(TP_LOOP + FSDP_LOOP, FSDP_LOOP + TP_LOOP),
           expect="fsdp was applied before tp"),
    Mutant("mesh dimensions swapped: TP over \"dp\", FSDP over \"tp\"",
           (replace('parallelize_module(b, mesh["tp"]', 'parallelize_module(b, mesh["dp"]'),
            replace('mesh=mesh["dp"]', 'mesh=mesh["tp"]', count=2)),
           expect='tp runs over mesh["tp"]'),
    Mutant("only the root is an FSDP unit", replace(FSDP_LOOP, ""), expect="each block is gathered on its own"),
    Mutant("TP without sequence parallelism in the 2D model",
           replace("tp_plan(b, sequence_parallel=True)", "tp_plan(b, sequence_parallel=False)"),
           expect="the norms' weights are on \"dp\" only"),
    Mutant("TP only, no FSDP", (replace(FSDP_LOOP, ""), replace('    fully_shard(model, mesh=mesh["dp"])\n', "")),
           expect="both are needed"),
    Mutant("returns nothing", replace("    return model\n", ""), expect="not the model"),
], variants=[
    Variant("block by block: TP then FSDP for each, then the root", '''
def parallelize_2d(model, mesh):
    tp_mesh, dp_mesh = mesh["tp"], mesh["dp"]
    for b in model.blocks:
        parallelize_module(b, tp_mesh, tp_plan(b, True))
        fully_shard(b, mesh=dp_mesh, reshard_after_forward=True)
    fully_shard(model, mesh=dp_mesh)
    return model
'''),
    Variant("its own plan written inline, returning what the root fully_shard returns", '''
def parallelize_2d(model, mesh):
    seq = Shard(1)
    for b in model.blocks:
        parallelize_module(b, mesh["tp"], {
            "norm1": SequenceParallel(), "norm2": SequenceParallel(),
            "attn": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            "mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            **{f"attn.{n}": ColwiseParallel() for n in ("wq", "wk", "wv")}, "mlp.fc1": ColwiseParallel(),
            "attn.wo": RowwiseParallel(output_layouts=seq), "mlp.fc2": RowwiseParallel(output_layouts=seq)})
    for b in model.blocks:
        fully_shard(b, mesh=mesh["dp"])
    return fully_shard(model, mesh=mesh["dp"])
'''),
])

BYTES = ExerciseMutants("11.tp_bytes", NOTEBOOK, ("tp_bytes",), mutants=[
    Mutant("forward only", replace("(8 if sequence_parallel else 4)", "(4 if sequence_parallel else 2)"),
           expect="forward only"),
    Mutant("elements, not bytes", replace("batch * seq * hidden * 4", "batch * seq * hidden"),
           expect="elements, not bytes"),
    Mutant("SP counted like the all-reduces it replaces", replace("(8 if sequence_parallel else 4)", "4"),
           expect="without sequence parallelism"),
    Mutant("every collective counted by this rank's slice",
           replace("return (8 if sequence_parallel else 4) * activation",
                   "return (8 if sequence_parallel else 4) * activation // tp"),
           expect="not by this rank's slice"),
    Mutant("one rank still communicates", replace("    if tp == 1:\n        return 0\n", ""),
           expect="tp=1 hands nothing"),
], variants=[
    Variant("collectives counted one by one", '''
def tp_bytes(batch, seq, hidden, tp, sequence_parallel):
    if tp < 2:
        return 0
    per_direction = 2 * (2 if sequence_parallel else 1)   # attention and MLP; SP: all-gather + reduce-scatter
    return 2 * per_direction * batch * seq * hidden * torch.tensor(0.0).element_size()
'''),
    Variant("a sum over the block's collectives", '''
def tp_bytes(batch, seq, hidden, tp, sequence_parallel):
    kinds = ["all_gather", "reduce_scatter"] if sequence_parallel else ["all_reduce"]
    calls = [(part, kind, way) for part in ("attn", "mlp") for kind in kinds for way in ("forward", "backward")]
    return sum(batch * seq * hidden * 4 for _ in calls) * (tp > 1)
'''),
])

SPECS = [MLP, SP, PLAN, TWO_D, BYTES]


@functools.cache
def namespace() -> dict:
    """The notebook's first cell (its imports), its CopyToTP, which sp_mlp uses, and its tp_plan, which
    parallelize_2d uses."""
    ns: dict = {}
    exec(compile(prelude(NOTEBOOK), "<prelude 11>", "exec"), ns)
    exec(compile(solution_cell(NOTEBOOK, "class CopyToTP"), "<tp_mlp 11>", "exec"), ns)
    exec(compile(solution_cell(NOTEBOOK, "def tp_plan"), "<tp_plan 11>", "exec"), ns)
    return ns


# mutants right in one case's evidence and wrong in another's: the right case passes (each case judges evidence of
# its own), at no extra launch
RIGHT_IN = {"only the root is an FSDP unit": "4 ranks as (dp=2, tp=2)",
            "norm's gradients left partial (each rank's norm saw only its slice)": "forward:",
            "the norm applied to the whole gathered sequence": "forward:"}


def the_right_case_passes(mutant, result):
    if mutant.name in RIGHT_IN:
        passed = [c.passed for c in result.cases if c.name.startswith(RIGHT_IN[mutant.name])]
        assert passed == [True], f"{mutant.name}: the case {RIGHT_IN[mutant.name]!r} should pass:\n{result}"


test_mutant_fails_naming_its_bug, test_correct_variant_passes, test_every_exercise_has_five_mutants_and_two_variants = \
    mutant_tests(SPECS, "11", namespace, after=the_right_case_passes)

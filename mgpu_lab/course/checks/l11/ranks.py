"""What lesson 11's checks run inside real ranks; they return plain evidence, judged in :mod:`.judges`.

- :func:`run_tp_mlp`: the learner's ``CopyToTP`` and ``ReduceFromTP`` on their own, then
  ``tp_mlp`` on several shapes, each with every collective recorded forward and backward,
  beside the unsplit MLP computed in the same rank before the learner's code runs;
- :func:`run_sp_mlp`: the learner's ``sp_mlp`` on each rank's slice of the sequence, forward
  and backward, every collective recorded, the layer norms' saved inputs read off the autograd
  graph, beside the unsplit block (and the gradients each rank's slice alone gives);
- :func:`run_plan`: the learner's plan applied to lesson 11's block with ``parallelize_module``
  over every rank, without and with sequence parallelism: output, one SGD step, each
  direction's collectives, the activation bytes the norms saved, each weight's share;
- :func:`run_2d`: the learner's ``parallelize_2d`` on a (2, 2) mesh: the order of its
  ``parallelize_module`` and ``fully_shard`` calls and their meshes, every parameter's
  placements, one step's collectives with their groups, the weights after 3 steps;
- :func:`measure_tp_bytes`: the bytes the recorder sees for the block of several shapes
  (the lesson's reference plan, in the checker's own use); :func:`call_tp_bytes` the
  learner's ``tp_bytes`` on the same shapes.
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as tdist
import torch.nn.functional as F

from mgpu_lab.comm.record import record
from mgpu_lab.tensor_parallel.block import Block, Stack, batch, make_mesh_2d
from mgpu_lab.tensor_parallel.measure import activation_bytes
from .. import _references
from ..sim.scenarios import run_scenarios

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "reduce")
MLP_SHAPES = {2: [((4, 8), 8, 16), ((2, 3, 8), 8, 24)], 4: [((5, 6), 6, 32)]}  # (x's shape, d, hidden)
PLAN_SHAPE = dict(n=2, seq=8, dim=16, heads=4, hidden=32)
STEPS_2D = 3


def _ops(log) -> list:
    return [(e["op"], e["numel"], e.get("ranks")) for e in log if e["op"] in COLLECTIVES]


def _error(exc) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:400]


# -- tp_mlp ---------------------------------------------------------------------------------
def _copy_probe(copy_cls) -> dict:
    rank, world = tdist.get_rank(), tdist.get_world_size()
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1)).requires_grad_()
    base = torch.randn(3, 4, generator=torch.Generator().manual_seed(2))
    with record() as fwd:
        y = copy_cls.apply(x)
    with record() as bwd:
        y.backward(base * (rank + 1))  # a different gradient on every rank
    return {"y": y.detach().clone(), "x": x.detach().clone(), "grad": None if x.grad is None else x.grad.clone(),
            "want": base * (world * (world + 1) / 2), "own": base * (rank + 1), "fwd": _ops(fwd), "bwd": _ops(bwd)}


def _reduce_probe(reduce_cls) -> dict:
    rank, world = tdist.get_rank(), tdist.get_world_size()
    base = torch.randn(3, 4, generator=torch.Generator().manual_seed(3))
    x = (base * (rank + 1)).requires_grad_()
    g = torch.randn(3, 4, generator=torch.Generator().manual_seed(4))  # the same on every rank, as after a reduce
    with record() as fwd:
        y = reduce_cls.apply(x)
    y_value = y.detach().clone()
    with record() as bwd:
        y.backward(g)
    return {"y": y_value, "want": base * (world * (world + 1) / 2), "own": base * (rank + 1),
            "grad": None if x.grad is None else x.grad.clone(), "g": g, "fwd": _ops(fwd), "bwd": _ops(bwd)}


def _full_mlp(shape, d: int, hidden: int) -> dict:
    g = torch.Generator().manual_seed(hidden * 100 + d)
    w = {"w1": torch.randn(hidden, d, generator=g) / d ** 0.5, "b1": torch.randn(hidden, generator=g),
         "w2": torch.randn(d, hidden, generator=g) / hidden ** 0.5, "b2": torch.randn(d, generator=g)}
    w["x"], w["g"] = torch.randn(*shape, generator=g), torch.randn(*shape[:-1], d, generator=g)
    return w


def _mlp_probe(tp_mlp, shape, d: int, hidden: int) -> dict:
    rank, world = tdist.get_rank(), tdist.get_world_size()
    w = _full_mlp(shape, d, hidden)
    ref = {k: w[k].clone().requires_grad_() for k in ("x", "w1", "b1", "w2", "b2")}
    want = F.linear(F.gelu(F.linear(ref["x"], ref["w1"], ref["b1"])), ref["w2"], ref["b2"])
    want.backward(w["g"])
    cut = {"w1": lambda t: t.chunk(world)[rank], "b1": lambda t: t.chunk(world)[rank],
           "w2": lambda t: t.chunk(world, dim=1)[rank], "x": lambda t: t, "b2": lambda t: t}
    mine = {k: cut[k](w[k]).clone().requires_grad_() for k in cut}
    want_grads = {k: cut[k](ref[k].grad).clone() for k in cut}
    wrong = {  # outputs of known wrong answers, for the hints
        "bias on every rank": want.detach() + (world - 1) * w["b2"],
        "GELU after the sum": F.gelu(F.linear(F.linear(w["x"], w["w1"], w["b1"]), w["w2"])) + w["b2"],
        "no sum over ranks": F.linear(F.gelu(F.linear(w["x"], mine["w1"].detach(), mine["b1"].detach())),
                                      mine["w2"].detach()) + w["b2"]}
    with record() as fwd:
        out = tp_mlp(mine["x"], mine["w1"], mine["b1"], mine["w2"], mine["b2"])
    entry = {"shape": list(shape), "d": d, "hidden": hidden, "want": want.detach(), "wrong": wrong,
             "fwd": _ops(fwd), "bwd": [], "grads": {}, "want_grads": want_grads}
    if not isinstance(out, torch.Tensor):
        entry["out"] = type(out).__name__
        return entry
    entry["out"] = out.detach().clone()
    if out.requires_grad:
        with record() as bwd:
            out.backward(w["g"])
        entry["bwd"] = _ops(bwd)
    entry["grads"] = {k: None if t.grad is None else t.grad.clone() for k, t in mine.items()}
    return entry


def run_tp_mlp(answer, scenarios, log_dir) -> list:
    """Probe: ``answer`` is ``(tp_mlp, CopyToTP, ReduceFromTP)``; per scenario ``("copy",)``, ``("reduce",)`` or
    ``("mlp", shape, d, hidden)`` its evidence."""
    tp_mlp, copy_cls, reduce_cls = answer

    def one(scenario):
        if scenario[0] == "copy":
            return _copy_probe(copy_cls)
        if scenario[0] == "reduce":
            return _reduce_probe(reduce_cls)
        return _mlp_probe(tp_mlp, *scenario[1:])

    return run_scenarios(log_dir, one, scenarios)


# -- tp_plan --------------------------------------------------------------------------------
def _describe_plan(plan) -> dict:
    if not isinstance(plan, dict):
        return {"type": type(plan).__name__}
    out = {}
    for name, style in plan.items():
        layouts = {k: str(v) for k, v in vars(style).items() if "layout" in k} if hasattr(style, "__dict__") else {}
        out[str(name)] = {"style": type(style).__name__, **layouts}
    return out


def _shares(block) -> dict:
    """Per parameter: the fraction of it this rank holds."""
    out = {}
    for name, p in block.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        out[name] = local.numel() / p.numel()
    return out


def _plan_probe(tp_plan, sp: bool) -> dict:
    rank, world = tdist.get_rank(), tdist.get_world_size()
    s = PLAN_SHAPE
    ref = Block(s["dim"], s["heads"], s["hidden"])
    block = copy.deepcopy(ref)
    x, y = batch(s["n"], s["seq"], s["dim"], seed=5)
    cut = (lambda t: t.chunk(world, dim=1)[rank]) if sp else (lambda t: t)
    want_saved = activation_bytes(ref, x)
    want = ref(x)
    ((want - y).square().sum() / y.numel()).backward()
    torch.optim.SGD(ref.parameters(), lr=0.5).step()
    plan = tp_plan(block, sp)
    entry = {"plan": _describe_plan(plan), "want_saved": {k: want_saved.get(k, 0) for k in ("norm1", "norm2")}}
    try:  # every rank runs the same plan: a plan that fails, fails on every rank, and the next scenario can run
        _plan_run(block, plan, x, y, want, cut, entry)
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001 - judged with the plan: which style made it fail
        entry["error"] = _error(exc)
        return entry
    refs = dict(ref.named_parameters())
    entry["weights"] = {n: float(((p.full_tensor() if hasattr(p, "full_tensor") else p) - refs[n]).abs().max())
                        for n, p in block.named_parameters()}
    return entry


def _plan_run(block, plan, x, y, want, cut, entry: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (tdist.get_world_size(),), mesh_dim_names=("tp",))
    parallelize_module(block, mesh, plan)
    entry["shares"] = _shares(block)
    saved = activation_bytes(block, cut(x))
    entry["saved"] = {k: saved.get(k, 0) for k in ("norm1", "norm2")}
    with record() as fwd:
        out = block(cut(x))
    out_local = out.to_local() if hasattr(out, "to_local") else out
    entry["out_diff"] = float((out_local - cut(want)).abs().max()) if out_local.shape == cut(want).shape else \
        f"shape {list(out_local.shape)}, expected {list(cut(want).shape)}"
    opt = torch.optim.SGD(block.parameters(), lr=0.5)
    with record() as bwd:
        ((out_local - cut(y)).square().sum() / y.numel()).backward()
    with record() as step:
        opt.step()
    entry.update(fwd=_ops(fwd), bwd=_ops(bwd), step=_ops(step), activation=x.numel())


def run_plan(tp_plan, scenarios, log_dir) -> list:
    """Probe: per scenario ``sequence_parallel`` (a bool), the plan applied to the block over every rank."""
    return run_scenarios(log_dir, lambda sp: _plan_probe(tp_plan, sp), scenarios)


# -- parallelize_2d -------------------------------------------------------------------------
def _spy_calls(fn, model, calls: list):
    """Wrap ``parallelize_module`` and ``fully_shard`` wherever ``fn`` can reach them: note each outermost call's
    kind, the module's name in ``model`` and the mesh's dimension names."""
    import threading

    import torch.distributed.fsdp as fsdp_mod
    import torch.distributed.tensor.parallel as tp_mod
    from torch.distributed.tensor.parallel import api as tp_api

    originals = {"parallelize_module": tp_api.parallelize_module, "fully_shard": fsdp_mod.fully_shard}
    names = {id(m): n for n, m in model.named_modules()}
    inside = threading.local()

    def spy(kind):
        def wrapper(module, *args, **kwargs):
            if getattr(inside, "depth", 0) == 0:  # parallelize_module calls itself for every entry of a plan
                mesh = kwargs.get("device_mesh", kwargs.get("mesh", args[0] if args else None))
                calls.append((kind, names.get(id(module), "?"), tuple(getattr(mesh, "mesh_dim_names", None) or ())))
            inside.depth = getattr(inside, "depth", 0) + 1
            try:
                return originals[kind](module, *args, **kwargs)
            finally:
                inside.depth -= 1
        return wrapper

    stand_ins = {k: spy(k) for k in originals}
    patched = []
    for holder in (tp_api.__dict__, tp_mod.__dict__, fsdp_mod.__dict__, getattr(fn, "__globals__", {})):
        for key, value in list(holder.items()):
            for kind, original in originals.items():
                if value is original:
                    patched.append((holder, key, value))
                    holder[key] = stand_ins[kind]
    return patched


def run_2d(parallelize_2d, scenarios, log_dir) -> list:
    """Probe: one scenario, the learner's ``parallelize_2d`` on a (2, 2) mesh and ``STEPS_2D`` SGD steps."""
    return run_scenarios(log_dir, lambda _: _probe_2d(parallelize_2d), scenarios)


def _probe_2d(parallelize_2d) -> dict:
    mesh = make_mesh_2d(2, 2)
    ref = Stack(2, 16, 4, 32)
    model = copy.deepcopy(ref)
    calls: list = []
    patched = _spy_calls(parallelize_2d, model, calls)
    entry = {"calls": calls, "groups": {n: sorted(mesh[n].mesh.flatten().tolist()) for n in ("dp", "tp")}}
    try:
        model = parallelize_2d(model, mesh)
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001 - judged: the order of the calls says why
        entry["error"] = _error(exc)
        return entry
    finally:
        for holder, key, value in reversed(patched):
            holder[key] = value
    if not isinstance(model, torch.nn.Module):
        entry["error"] = f"parallelize_2d returned {type(model).__name__}, not the model"
        return entry
    entry["params"] = {n: (tuple(getattr(getattr(p, "device_mesh", None), "mesh_dim_names", None) or ()),
                           [repr(pl) for pl in getattr(p, "placements", ())]) for n, p in model.named_parameters()}
    d, t = mesh.get_coordinate()
    x, y = batch(4, 8, 16, seed=6)
    xs, ys = (v.chunk(2)[d].chunk(2, dim=1)[t] for v in (x, y))
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.2), torch.optim.SGD(ref.parameters(), lr=0.2)
    for step in range(STEPS_2D):
        opt.zero_grad()
        with record() as log:
            out = model(xs)
            out = out.to_local() if hasattr(out, "to_local") else out
            ((out - ys).square().sum() * 2 / x.numel()).backward()  # the 2 DP groups' mean is the whole mean
        if step == 0:
            entry["events"] = [(e["op"], e["numel"], e["ranks"]) for e in log if e["op"] in COLLECTIVES]
        opt.step()
        ref_opt.zero_grad()
        (ref(x) - y).square().mean().backward()
        ref_opt.step()
    refs = dict(ref.named_parameters())
    entry["weights"] = {n: float(((p.full_tensor() if hasattr(p, "full_tensor") else p) - refs[n]).abs().max())
                        for n, p in model.named_parameters()}
    return entry


# -- tp_bytes -------------------------------------------------------------------------------
def measure_tp_bytes(shapes) -> list:
    """In 4 ranks: bytes the recorder sees per block, forward plus backward, for each ``(batch, seq, hidden, tp,
    sp)`` (tp of 1, 2 or 4: the "tp" dimension of a (4 / tp, tp) mesh), with the lesson's reference plan."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from mgpu_lab.tensor_parallel.plans import block_plan

    out = []
    for n, seq, hidden, tp, sp in shapes:
        mesh = init_device_mesh("cpu", (4 // tp, tp), mesh_dim_names=("dp", "tp"))
        block = Block(hidden, 4, 2 * hidden)
        with _references.allowed():
            parallelize_module(block, mesh["tp"], block_plan(block, sp))
        x = torch.randn(n, seq, hidden)
        with record() as log:
            block(x.chunk(tp, dim=1)[mesh["tp"].get_local_rank()] if sp else x).sum().backward()
        out.append(sum(e["bytes"] for e in log if e["op"] in COLLECTIVES))
    return out


def call_tp_bytes(tp_bytes, shapes) -> list:
    """In a fresh process: the learner's ``tp_bytes`` on each shape, as outcomes."""
    from ..sim.outcome import outcome

    return [outcome(tp_bytes, *shape) for shape in shapes]


# -- sp_mlp ---------------------------------------------------------------------------------
# (batch, seq, d, d_ff, meta) per world size: seq divides by the ranks; d_ff by them too; the last 2-rank call runs
# with torch's default device set to meta, so a tensor made without device= is not on the input's device (on a
# GPU rank it would be a CPU tensor)
SP_SHAPES = {2: [(2, 8, 6, 16, False), (3, 4, 8, 8, False), (1, 6, 4, 12, True)], 4: [(2, 8, 6, 16, False)]}
SP_PARAMS = ("w1", "b1", "w2", "b2", "norm.weight", "norm.bias")


def _sp_whole(batch: int, seq: int, d: int, d_ff: int) -> dict:
    """The unsplit block's inputs, the same in every rank: x, the norm's and the MLP's weights, the output's
    gradient (none of the weights ones or zeros, so that a gradient that misses a term shows)."""
    g = torch.Generator().manual_seed(1000 * seq + 10 * d + d_ff)
    return {"x": torch.randn(batch, seq, d, generator=g), "norm.weight": 1 + 0.3 * torch.randn(d, generator=g),
            "norm.bias": 0.3 * torch.randn(d, generator=g), "w1": torch.randn(d_ff, d, generator=g) / d ** 0.5,
            "b1": torch.randn(d_ff, generator=g), "w2": torch.randn(d, d_ff, generator=g) / d_ff ** 0.5,
            "b2": torch.randn(d, generator=g), "g": torch.randn(batch, seq, d, generator=g)}


def _sp_reference(w: dict, g: torch.Tensor) -> tuple:
    """One process: the block's output on the whole sequence and the gradients of ``g`` (plain autograd)."""
    leaves = {k: w[k].clone().requires_grad_() for k in ("x", *SP_PARAMS)}
    normed = F.layer_norm(leaves["x"], leaves["x"].shape[-1:], leaves["norm.weight"], leaves["norm.bias"])
    out = leaves["x"] + F.linear(F.gelu(F.linear(normed, leaves["w1"], leaves["b1"])), leaves["w2"], leaves["b2"])
    out.backward(g)
    return out.detach(), {k: v.grad for k, v in leaves.items()}


def _layer_norm_inputs(out) -> list:
    """The shapes of the inputs every layer norm in ``out``'s autograd graph saved for backward."""
    seen, stack, shapes = set(), [getattr(out, "grad_fn", None)], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if "LayerNorm" in type(node).__name__ and hasattr(node, "_saved_input"):
            shapes.append(list(node._saved_input.shape))
        stack.extend(n for n, _ in node.next_functions)
    return shapes


def _sp_expected(shape, rank: int, world: int) -> dict:
    """What a right answer gives in this rank, and what known wrong ones give."""
    batch, seq, d, d_ff, _ = shape
    w = _sp_whole(batch, seq, d, d_ff)
    want, grads = _sp_reference(w, w["g"])
    mask = torch.zeros_like(w["g"])
    mask.chunk(world, dim=1)[rank].fill_(1)  # this rank's slice's gradient only: what its own norm saw
    _, own = _sp_reference(w, w["g"] * mask)
    cut = {"w1": lambda t: t.chunk(world)[rank], "b1": lambda t: t.chunk(world)[rank],
           "w2": lambda t: t.chunk(world, dim=1)[rank], "x": lambda t: t.chunk(world, dim=1)[rank]}
    keep = lambda k, t: cut.get(k, lambda v: v)(t)  # noqa: E731
    wrong = {"bias on every rank": want.chunk(world, dim=1)[rank] + (world - 1) * w["b2"],
             "whole sequence": want, "no residual": (want - w["x"]).chunk(world, dim=1)[rank]}
    return {"w": w, "want": want.chunk(world, dim=1)[rank],
            "want_grads": {k: keep(k, v) for k, v in grads.items()},
            "own": {k: own[k] for k in ("norm.weight", "norm.bias", "b2")}, "wrong": wrong}


def _sp_call(sp_mlp, mine: dict, norm, g_slice, meta: bool, entry: dict) -> None:
    """The learner's ``sp_mlp`` forward and backward, each recorded (torch's default device meta if ``meta``)."""
    with record(sp_mlp) as fwd:
        if meta:
            torch.set_default_device("meta")
        try:
            out = sp_mlp(mine["x"], norm, mine["w1"], mine["b1"], mine["w2"], mine["b2"])
        finally:
            torch.set_default_device(None)
    entry["fwd"] = [(e["op"], e["numel"], e["device"]) for e in fwd if e["op"] in COLLECTIVES]
    if not isinstance(out, torch.Tensor):
        entry["out"] = type(out).__name__
        return
    entry["out"], entry["norm_inputs"] = out.detach().clone(), _layer_norm_inputs(out)
    if out.requires_grad and out.shape == g_slice.shape:
        with record(sp_mlp) as bwd:
            if meta:
                torch.set_default_device("meta")
            try:
                out.backward(g_slice)
            finally:
                torch.set_default_device(None)
        entry["bwd"] = [(e["op"], e["numel"], e["device"]) for e in bwd if e["op"] in COLLECTIVES]


def _sp_probe(sp_mlp, shape) -> dict:
    rank, world = tdist.get_rank(), tdist.get_world_size()
    e = _sp_expected(shape, rank, world)
    w = e.pop("w")
    batch, seq, d, d_ff, meta = shape
    norm = torch.nn.LayerNorm(d)
    with torch.no_grad():
        norm.weight.copy_(w["norm.weight"])
        norm.bias.copy_(w["norm.bias"])
    mine = {"x": w["x"].chunk(world, dim=1)[rank], "w1": w["w1"].chunk(world)[rank],
            "b1": w["b1"].chunk(world)[rank], "w2": w["w2"].chunk(world, dim=1)[rank], "b2": w["b2"]}
    mine = {k: v.clone().requires_grad_() for k, v in mine.items()}
    entry = {"shape": list(shape[:4]), "meta": meta, "world": world, "fwd": [], "bwd": [], "grads": {},
             "norm_inputs": [], "error": "", "out": None, **e}
    try:
        _sp_call(sp_mlp, mine, norm, w["g"].chunk(world, dim=1)[rank], meta, entry)
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001 - judged: every rank runs the same code, and fails at the same place
        entry["error"] = _error(exc)
    params = {**{k: mine[k] for k in ("x", "w1", "b1", "w2", "b2")}, "norm.weight": norm.weight,
              "norm.bias": norm.bias}
    entry["grads"] = {k: None if p.grad is None else p.grad.detach().clone() for k, p in params.items()}
    return entry


def run_sp_mlp(sp_mlp, scenarios, log_dir) -> list:
    """Probe: per scenario ``(batch, seq, d, d_ff, meta)``, the learner's ``sp_mlp`` on this rank's slice of the
    sequence, forward and backward, every collective recorded, beside the unsplit block computed first."""
    return run_scenarios(log_dir, lambda shape: _sp_probe(sp_mlp, shape), scenarios)

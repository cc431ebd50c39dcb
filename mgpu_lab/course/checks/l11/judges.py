"""Lesson 11's verdicts: the evidence of :mod:`.ranks`, in the words of each case."""
from __future__ import annotations

import torch

TOL = 1e-5
LINEARS = {"attn.wq": "ColwiseParallel", "attn.wk": "ColwiseParallel", "attn.wv": "ColwiseParallel",
           "attn.wo": "RowwiseParallel", "mlp.fc1": "ColwiseParallel", "mlp.fc2": "RowwiseParallel"}


def _close(a, b, tol: float = TOL) -> bool:
    return isinstance(a, torch.Tensor) and a.shape == b.shape and bool(torch.allclose(a, b, atol=tol, rtol=1e-4))


def _diff(a, b) -> str:
    if not isinstance(a, torch.Tensor):
        return f"{a} (not a tensor)"
    if a.shape != b.shape:
        return f"shape {list(a.shape)}, expected {list(b.shape)}"
    return f"max difference {float((a - b).abs().max()):.3g}"


def _count(ops, op: str) -> int:
    return sum(1 for o in ops if o[0] == op)


def _in_words(ops) -> str:
    if not ops:
        return "no collective"
    return ", ".join(f"{op} of {numel} elements" for op, numel, *_ in ops)


# -- tp_mlp ---------------------------------------------------------------------------------
def copy_case(t, runs) -> None:
    for rank, e in enumerate(runs.get(t, 0)):
        if e["fwd"]:
            t.fail("CopyToTP's forward communicated: every rank already holds the whole x, so its forward is the "
                   "identity", "no collective forward", f"rank {rank}: {_in_words(e['fwd'])}")
        if not torch.equal(e["y"], e["x"]):
            t.fail("CopyToTP's forward must return its input's values unchanged", "y equal to x",
                   f"rank {rank}: {_diff(e['y'], e['x'])}")
        if e["grad"] is None or not _close(e["grad"], e["want"]):
            if e["grad"] is not None and _close(e["grad"], e["own"]):
                hint = ("backward handed on this rank's own gradient: each TP rank used x for its own slice, so "
                        "x's gradient is the sum of every rank's contribution: the backward sums over the ranks")
            elif e["grad"] is not None and _close(e["grad"] * len(runs.per_rank), e["want"]):
                hint = "backward averaged over the ranks: x's gradient is the sum of the ranks' contributions"
            else:
                hint = "backward must give every rank the sum over the ranks of the gradients they received"
            t.fail(hint, "the sum of all ranks' gradients", f"rank {rank}: {_diff(e['grad'], e['want'])}")
        if _count(e["bwd"], "all_reduce") != 1:
            t.fail("the sum over ranks is one all-reduce", "1 all_reduce in backward",
                   f"rank {rank}: {_in_words(e['bwd'])}")


def reduce_case(t, runs) -> None:
    world = len(runs.per_rank)
    for rank, e in enumerate(runs.get(t, 1)):
        if not _close(e["y"], e["want"]):
            hint = ("forward returned this rank's own partial sum: the row-parallel layer's outputs must be summed "
                    "over the ranks" if _close(e["y"], e["own"]) else "forward must return the sum over the ranks")
            t.fail(hint, "the sum over the ranks", f"rank {rank}: {_diff(e['y'], e['want'])}")
        if _count(e["fwd"], "all_reduce") != 1:
            t.fail("the sum over ranks is one all-reduce", "1 all_reduce forward",
                   f"rank {rank}: {_in_words(e['fwd'])}")
        if e["grad"] is not None and _close(e["grad"], e["g"] * world):
            t.fail(f"backward all-reduced the gradient: the wrong conjugate. After the forward sum every rank holds "
                   f"the same whole output, so its gradient is already whole on every rank: summing it again "
                   f"multiplies it by {world}", "the incoming gradient itself", f"rank {rank}: {world} times it")
        if e["grad"] is None or not _close(e["grad"], e["g"]):
            t.fail("backward must hand on the incoming gradient unchanged", "the incoming gradient",
                   f"rank {rank}: {_diff(e['grad'], e['g'])}")
        if e["bwd"]:
            t.fail("ReduceFromTP's backward communicated: the gradient of the summed output is the same on every "
                   "rank, nothing to exchange", "no collective in backward", f"rank {rank}: {_in_words(e['bwd'])}")


def _mlp_entries(t, runs, picks) -> list:
    return [(rank, runs_k) for k in picks for rank, runs_k in enumerate(runs.get(t, k))]


def mlp_output(t, runs, picks) -> None:
    for rank, e in _mlp_entries(t, runs, picks):
        where = f"rank {rank}, x of shape {e['shape']}, hidden {e['hidden']}"
        if not isinstance(e["out"], torch.Tensor):
            t.fail("tp_mlp returns the output tensor", "a Tensor", f"{where}: {e['out']}")
        if _close(e["out"], e["want"]):
            continue
        known = {"bias on every rank": "the output's bias counts tp times: fc2's bias was added on every rank before "
                                       "the sum; the bias belongs to the whole output, added once, after the sum",
                 "GELU after the sum": "GELU was applied after the sum over ranks, i.e. after fc2: GELU sits between "
                                       "fc1 and fc2, on each rank's slice of the hidden activation, which it can "
                                       "act on element by element",
                 "no sum over ranks": "the output is this rank's partial sum only: the row-parallel fc2 gives each "
                                      "rank a part of the output, and the parts are summed over the ranks"}
        hint = next((words for name, words in known.items() if _close(e["out"], e["wrong"][name])),
                    "the output must equal the unsplit MLP's, fc2(gelu(fc1(x))), on every rank")
        t.fail(hint, "the unsplit MLP's output", f"{where}: {_diff(e['out'], e['want'])}")


def mlp_grads(t, runs, picks) -> None:
    world = len(runs.per_rank)
    for rank, e in _mlp_entries(t, runs, picks):
        where = f"rank {rank}, x of shape {e['shape']}"
        for name in ("x", "w1", "b1", "w2", "b2"):
            got, want = e["grads"].get(name), e["want_grads"][name]
            if got is not None and _close(got, want):
                continue
            label = {"x": "x", "w1": "w1_shard", "b1": "b1_shard", "w2": "w2_shard", "b2": "b2"}[name]
            if got is not None and _close(got, want * world):
                hint = (f"{label}'s gradient is {world} times the unsplit MLP's: the output's gradient was summed "
                        "over the ranks in backward, though every rank already held all of it (ReduceFromTP's "
                        "backward is the identity)")
            elif name == "x" and got is not None:
                hint = ("x's gradient holds only this rank's slice's contribution: each rank used x for its own "
                        "columns of fc1, so x's gradient is the sum over the ranks (CopyToTP's backward)")
            else:
                hint = f"{label}'s gradient must equal the unsplit MLP's (its slice for a shard)"
            t.fail(hint, f"the unsplit MLP's gradient of {label}", f"{where}: {_diff(got, want)}")


def mlp_collectives(t, runs, picks) -> None:
    for rank, e in _mlp_entries(t, runs, picks):
        where = f"rank {rank}, x of shape {e['shape']}"
        size = e["want"].numel()
        if _count(e["fwd"], "all_reduce") != 1 or len(e["fwd"]) != 1:
            hint = ("no collective forward: the partial outputs of the row-parallel layer must be summed"
                    if not e["fwd"] else "exactly one all-reduce forward: the output of fc2's partial sums")
            t.fail(hint, f"1 all_reduce of {size} elements forward", f"{where}: {_in_words(e['fwd'])}")
        if e["fwd"][0][1] != size:
            t.fail("the all-reduce sums the output (batch x d), not the hidden activation", f"{size} elements",
                   f"{where}: {_in_words(e['fwd'])}")
        if _count(e["bwd"], "all_reduce") != 1 or len(e["bwd"]) != 1:
            hint = ("no collective in backward: x's gradient must be summed over the ranks" if not e["bwd"] else
                    "two collectives in backward: only x's gradient needs summing; the output's gradient is "
                    "already whole on every rank" if len(e["bwd"]) == 2 else "exactly one all-reduce in backward")
            t.fail(hint, f"1 all_reduce of {e['grads']['x'].numel() if e['grads'].get('x') is not None else size} "
                   "elements in backward", f"{where}: {_in_words(e['bwd'])}")


# -- tp_plan --------------------------------------------------------------------------------
def _plan_hint(e) -> str:
    plan = e["plan"]
    if "type" in plan and len(plan) == 1:
        return f"tp_plan returns a dict of submodule name -> ParallelStyle, not a {plan['type']}"
    for name, style in LINEARS.items():
        got = plan.get(name, {}).get("style")
        if got and got != style:
            how = "by columns (its output features)" if style == "ColwiseParallel" else "by rows (its input features)"
            return (f"{name} is given {got}: it is split along the wrong dimension; {name} must be split {how} so "
                    "that the heads (or the hidden units) of one rank meet only their own weights")
    missing = [n for n in LINEARS if n not in plan]
    if missing:
        return f"the plan leaves {', '.join(missing)} whole on every rank: every linear layer of attn and mlp is split"
    return ""


def plan_ran(t, e, rank: int) -> None:
    """Fail with the plan's likely fault when the block did not run under it."""
    if "error" in e:
        t.fail(_plan_hint(e) or "the block must run under the plan", "the block runs",
               f"rank {rank}: {e['error']}")


def plan_split(t, e, rank: int) -> None:
    plan_ran(t, e, rank)
    unsplit = [n for n in LINEARS if e["shares"].get(f"{n}.weight", 1.0) >= 1.0]
    if unsplit:
        t.fail(_plan_hint(e) or "every linear layer of attn and mlp is split over the TP ranks",
               "each rank holds 1/tp of every linear layer's weight", f"rank {rank}: {', '.join(unsplit)} whole")


def plan_output(t, runs, k: int) -> None:
    for rank, e in enumerate(runs.get(t, k)):
        plan_split(t, e, rank)
        if isinstance(e["out_diff"], str) or e["out_diff"] > TOL:
            hint = _plan_hint(e) or "the output must equal one process's"
            if isinstance(e["out_diff"], str) and k == 1:
                hint = ("the block returned the whole sequence, not this rank's slice: with sequence parallelism "
                        "the row-parallel layers hand back a slice of the sequence (reduce-scatter), not the whole "
                        "activation (all-reduce)")
            got = e["out_diff"] if isinstance(e["out_diff"], str) else f"max difference {e['out_diff']:.3g}"
            t.fail(hint, "one process's output", f"rank {rank}: {got}")


def plan_weights(t, runs, k: int) -> None:
    for rank, e in enumerate(runs.get(t, k)):
        plan_split(t, e, rank)
        wrong = {n: d for n, d in e["weights"].items() if d > TOL}
        if wrong:
            name = next(iter(wrong))
            hint = "after the step every weight equals one process's"
            if name.startswith("norm") and k == 1:
                hint = (f"{name.split('.')[0]}'s weights differ: with sequence parallelism each rank's norm sees "
                        "only its slice of the sequence, so its replicated weights' gradients must be summed over "
                        "the TP ranks before the step; a norm left out of the plan keeps a plain tensor with this "
                        "rank's part of the gradient only")
            t.fail(hint, "one process's weights after one SGD step",
                   f"rank {rank}: {name} differs by {wrong[name]:.3g}" + (f" ({len(wrong)} differ)" if len(wrong) > 1
                                                                          else ""))


def _sp_hint(ops, direction: str) -> str:
    """What a sequence-parallel block's collectives say about the plan, naming what this one did."""
    n = {op: _count(ops, op) for op in ("all_reduce", "all_gather", "reduce_scatter")}
    way = "forward" if direction == "fwd" else "backward"
    if n["all_reduce"]:
        return (f"{n['all_reduce']} all-reduce(s) in {way}: with sequence parallelism there is none; each becomes a "
                "reduce-scatter (back to this rank's slice of the sequence) and an all-gather (the whole sequence "
                "for the next column-parallel layers)")
    gather = "all_gather" if direction == "fwd" else "reduce_scatter"  # backward runs the conjugate
    if n[gather] > 2:
        words = ("all-gathers of the sequence" if direction == "fwd" else
                 "reduce-scatters of the input gradients")
        return (f"{n[gather]} {words} in {way}, not 2: the column-parallel layers each took the norm's slice "
                "and gathered it themselves (wq, wk and wv three times, where one gather would do for the three); "
                "gathered once where attention (and the MLP) take their input, the projections share one whole "
                "sequence, and in backward autograd adds their gradients before one reduce-scatter")
    return (f"{way}: {n['all_gather']} all-gather(s) and {n['reduce_scatter']} reduce-scatter(s), not 2 and 2: "
            "with sequence parallelism each sub-layer gathers the whole sequence once before its column-parallel "
            "layers and hands back this rank's slice by a reduce-scatter after its row-parallel one")


def plan_collectives(t, runs, k: int, direction: str) -> None:
    for rank, e in enumerate(runs.get(t, k)):
        plan_ran(t, e, rank)
        ops, size = e[direction], e["activation"]
        if k == 0:
            want = [("all_reduce", size)] * 2
            hint = ("two all-reduces of the activation: one ends attention (wo's partial sums), one the MLP "
                    "(fc2's)" if direction == "fwd" else
                    "the gradient of attention's input must be all-reduced once, not once per projection: wq, wk "
                    "and wv each turned the same input into a DTensor of their own, so each summed its gradient "
                    "over the ranks; when attn hands them one DTensor, autograd adds their gradients first and one "
                    "all-reduce follows (the same for the MLP)")
        else:
            want = sorted([("all_gather", size), ("reduce_scatter", size)] * 2)
            hint = _sp_hint(ops, direction)
        got = sorted((op, n) for op, n, _ in ops) if k == 1 else [(op, n) for op, n, _ in ops]
        if got != want:
            t.fail(hint, _in_words(want), f"rank {rank}: {_in_words(ops)}")


def plan_saved(t, runs) -> None:
    plan_output(t, runs, 1)
    for rank, e in enumerate(runs.get(t, 1)):
        plan_ran(t, e, rank)
        world = len(runs.per_rank)
        for name in ("norm1", "norm2"):
            if e["saved"][name] * world != e["want_saved"][name]:
                t.fail("with sequence parallelism each norm keeps the activations of this rank's slice of the "
                       "sequence only", f"{name}: {e['want_saved'][name] // world} bytes (1/{world} of one "
                       f"process's {e['want_saved'][name]})", f"rank {rank}: {e['saved'][name]} bytes")


# -- parallelize_2d -------------------------------------------------------------------------
def _ran_2d(t, runs) -> list:
    entries = runs.get(t, 0)
    for rank, e in enumerate(entries):
        if "error" in e:
            hint = ""
            if "Cannot distribute a DTensor with device mesh" in e["error"]:
                hint = ("FSDP was applied before TP: fully_shard made the parameters DTensors of the \"dp\" mesh, "
                        "and parallelize_module cannot split those over \"tp\"; FSDP shards what TP left")
            t.fail(hint, "parallelize_2d returns the model", f"rank {rank}: {e['error']}")
    return entries


def twod_params(t, runs) -> None:
    for rank, e in enumerate(_ran_2d(t, runs)):
        for name, (dims, placements) in e["params"].items():
            if dims != ("dp", "tp"):
                hint = ("TP never split this parameter: after TP over \"tp\" and FSDP over \"dp\" it lives on both"
                        if dims == ("dp",) else "every parameter is a DTensor on the 2D mesh")
                if dims == ("dp",) and ".norm" in name:
                    hint = ("the norms' weights are on \"dp\" only: TP without sequence parallelism leaves them plain "
                            "tensors; with it (the model's activations are slices of the sequence) they are "
                            "replicated over \"tp\"")
                t.fail(hint, "a DTensor on (\"dp\", \"tp\")", f"rank {rank}: {name} on {dims or 'no mesh'}")
            linear = any(name.startswith(f"blocks.{b}.{n}.weight") for b in (0, 1) for n in LINEARS)
            if linear and "Shard" not in placements[-1]:
                t.fail("the linear layers are split over \"tp\"", "Shard on \"tp\"",
                       f"rank {rank}: {name} has {placements}")


def _fsdp_before_tp(calls) -> tuple | None:
    """The first TP call on a module that an earlier fully_shard had already taken (itself or a module around it)."""
    sharded = []
    for kind, name, _ in calls:
        if kind == "fully_shard":
            sharded.append(name)
        elif any(name == s or s == "" or name.startswith(s + ".") for s in sharded):
            return name, next(s for s in sharded if name == s or s == "" or name.startswith(s + "."))
    return None


def twod_order(t, runs) -> None:
    for rank, e in enumerate(runs.get(t, 0)):
        calls = e["calls"]
        kinds = {k for k, *_ in calls}
        early = _fsdp_before_tp(calls)
        if early or "Cannot distribute a DTensor with device mesh" in e.get("error", ""):
            got = (f"fully_shard({early[1] or 'the model'}) before parallelize_module({early[0]})" if early
                   else e["error"])
            t.fail("FSDP was applied before TP: FSDP shards what TP left, so a module is split by TP before "
                   "fully_shard takes it (or a module around it)", "TP first", f"rank {rank}: {got}")
        wrong = [(k, m) for k, _, m in calls if (k == "parallelize_module") != (m == ("tp",))]
        if wrong:
            t.fail("TP runs over mesh[\"tp\"] (neighbouring ranks, the fast links) and FSDP over mesh[\"dp\"]",
                   "parallelize_module over (\"tp\",), fully_shard over (\"dp\",)",
                   f"rank {rank}: {wrong[0][0]} over {wrong[0][1] or 'no mesh'}")
        if not {"fully_shard", "parallelize_module"} <= kinds:
            t.fail("both are needed: TP inside each block, FSDP over the DP groups", "both called",
                   f"rank {rank}: {sorted(kinds) or 'neither'}")


def twod_weights(t, runs, steps: int) -> None:
    for rank, e in enumerate(_ran_2d(t, runs)):
        wrong = {n: d for n, d in e["weights"].items() if d > 1e-5}
        if wrong:
            name = next(iter(wrong))
            t.fail("the 4 ranks together train like one process on the whole batch", f"one process's weights "
                   f"after {steps} steps", f"rank {rank}: {name} differs by {wrong[name]:.3g} ({len(wrong)} differ)")


def twod_groups(t, runs) -> None:
    for rank, e in enumerate(_ran_2d(t, runs)):
        tp, dp = e["groups"]["tp"], e["groups"]["dp"]
        where = {"tp": [o for o in e["events"] if o[2] == tp], "dp": [o for o in e["events"] if o[2] == dp]}
        other = [o for o in e["events"] if o[2] not in (tp, dp)]
        if other:
            t.fail("every collective runs inside a TP group or a DP group", f"groups {tp} or {dp}",
                   f"rank {rank}: {other[0][0]} over ranks {other[0][2]}")
        if not where["tp"] or _count(where["tp"], "all_gather") < 4:
            t.fail("TP's all-gathers and reduce-scatters of activations run over the TP group (2 blocks, 2 each way)",
                   f"all-gathers over {tp}", f"rank {rank}: over {tp}: {_in_words(where['tp'])}")
        if not _count(where["dp"], "reduce_scatter"):
            t.fail("FSDP reduce-scatters the gradients over the DP group", f"reduce-scatters over {dp}",
                   f"rank {rank}: over {dp}: {_in_words(where['dp'])}")


def twod_units(t, runs) -> None:
    for rank, e in enumerate(_ran_2d(t, runs)):
        dp = e["groups"]["dp"]
        gathers = [o for o in e["events"] if o[2] == dp and o[0] == "all_gather"]
        if len(gathers) < 4:
            t.fail("each block is gathered on its own, forward and again backward, so only one block's whole "
                   "weights are live at a time: one fully_shard per block, then the root",
                   f"4 all-gathers over {dp} (2 blocks x forward and backward)",
                   f"rank {rank}: {len(gathers)} ({_in_words(gathers)})")


# -- tp_bytes -------------------------------------------------------------------------------
_BYTES_HINTS = (  # (does the answer fit this known mistake on (shape, value, want), what to say)
    (lambda shape, v, w: w > 0 and v * 2 == w and not shape[4],
     "half the recorder's count: forward only? backward moves as much as forward (the gradients of attention's "
     "and the MLP's inputs)"),
    (lambda shape, v, w: w > 0 and v * 4 == w,
     "a quarter of the recorder's count: elements, not bytes? fp32 has 4 bytes an element"),
    (lambda shape, v, w: w > 0 and v * shape[3] == w,
     "1/tp of the recorder's count: each collective is counted by the whole activation it works on (an "
     "all-gather's output, a reduce-scatter's input), not by this rank's slice"),
    (lambda shape, v, w: shape[4] and v == 16 * shape[0] * shape[1] * shape[2],
     "that is the count without sequence parallelism: with it each all-reduce becomes an all-gather plus a "
     "reduce-scatter, both of the whole activation"),
    (lambda shape, v, w: w == 0, "one rank alone has no one to talk to: tp=1 hands nothing to collectives"),
)


def bytes_case(t, shapes, answers, measured, picks) -> None:
    calls = []
    for k in picks:
        shape, got, want = shapes[k], answers[k], measured[k]
        call = "tp_bytes(batch={}, seq={}, hidden={}, tp={}, sequence_parallel={})".format(*shape)
        if got[0] != "ok":
            t.fail("", f"{want} (the recorder's count)", f"{call} raised {got[1]}: {got[2]}")
        if not isinstance(got[1], int) or isinstance(got[1], bool):
            t.fail("tp_bytes returns an int, a number of bytes", f"{want}", f"{call} returned {got[1]!r}")
        calls.append((shape, got[1], want, call))
    wrong = [c for c in calls if c[1] != c[2]]
    if wrong:
        hint = next((words for fits, words in _BYTES_HINTS if all(fits(s, v, w) for s, v, w, _ in wrong)),
                    "count the collectives of a block, forward and backward, each by the activation tensor it works "
                    "on, 4 bytes an element")
        shape, value, want, call = wrong[0]
        t.fail(hint, f"{want} (the recorder's count)", f"{call} returned {value}")


# -- sp_mlp ---------------------------------------------------------------------------------
SP_LABELS = {"x": "x_shard", "w1": "w1_shard", "b1": "b1_shard", "w2": "w2_shard", "b2": "b2",
             "norm.weight": "norm.weight", "norm.bias": "norm.bias"}
ON_DEVICE = ("a tensor made without naming its device lands on torch's default device: on a GPU rank, the CPU, "
             "where NCCL refuses it (here the default device was meta); make every buffer on the device of the "
             "tensor it holds")


def _sp_ran(t, rank: int, e: dict) -> None:
    """Fail with what went wrong when the learner's sp_mlp raised in this rank."""
    if not e["error"]:
        return
    hint = ""
    if "meta" in e["error"]:
        hint = ON_DEVICE
    elif "size" in e["error"] or "shape" in e["error"]:
        hint = ("the shapes do not line up: x_shard is [batch, seq / tp, d], a slice of the sequence (dim 1); "
                "the whole sequence is the ranks' slices in rank order along that dimension")
    t.fail(hint, "sp_mlp runs forward and backward", f"rank {rank}, x of shape {e['shape'][:3]}: {e['error']}")


def _sp_where(rank: int, e: dict) -> str:
    b, s, d, d_ff = e["shape"]
    return f"rank {rank} of {e['world']}, sequence [{b}, {s}, {d}], hidden {d_ff}"


def sp_output(t, runs, picks) -> None:
    for rank, e in _mlp_entries(t, runs, picks):
        _sp_ran(t, rank, e)
        where, out = _sp_where(rank, e), e["out"]
        if not isinstance(out, torch.Tensor):
            t.fail("sp_mlp returns a Tensor: this rank's slice of the block's output", "a Tensor", f"{where}: {out}")
        if _close(out, e["want"]):
            continue
        known = {"whole sequence": "it returned the whole sequence: each rank returns the block's output for its own "
                                   "slice of the sequence only, the slice x_shard holds",
                 "bias on every rank": "b2 counts tp times: it was added on every rank before the partial sums "
                                       "were added up; a bias belongs to the summed output, once",
                 "no residual": "the residual is missing: the block returns x + the MLP's output"}
        hint = next((words for name, words in known.items() if _close(out, e["wrong"][name])),
                    "the output must be this rank's slice of x + fc2(gelu(fc1(norm(x)))) over the whole sequence")
        t.fail(hint, "the unsplit block's output for this slice", f"{where}: {_diff(out, e['want'])}")


def _sp_grad_hint(name: str, got, e: dict) -> str:
    label, world = SP_LABELS[name], e["world"]
    if got is None:
        return (f"no gradient reached {label}: autograd must see every operation between it and the output (a "
                "collective autograd cannot see passes no gradient through it)")
    if name in e["own"] and _close(got, e["own"][name]):
        return (f"{label}'s gradient holds this rank's slice of the sequence's contribution only: this rank's "
                f"{'norm' if name.startswith('norm') else 'b2'} saw only its slice of the sequence, and the "
                "whole sequence's gradient, the same on every rank (the copies of a replicated weight must stay "
                "equal), is the sum over the slices")
    if _close(got, e["want_grads"][name] * world):
        return (f"{label}'s gradient is {world} times the unsplit block's: it was summed over the ranks where "
                "every rank already held all of it")
    if name == "x":
        return ("x_shard's gradient must equal the unsplit block's for this slice: x_shard reaches the output "
                "through the residual, and through the norm into every rank's slice of fc1")
    return f"{label}'s gradient must equal the unsplit block's (its slice for a shard)"


def sp_grads(t, runs, picks, names) -> None:
    for rank, e in _mlp_entries(t, runs, picks):
        _sp_ran(t, rank, e)
        for name in names:
            got, want = e["grads"].get(name), e["want_grads"][name]
            if got is None or not _close(got, want):
                t.fail(_sp_grad_hint(name, got, e), f"the unsplit block's gradient of {SP_LABELS[name]}",
                       f"{_sp_where(rank, e)}: {_diff(got, want)}")


def _sp_whole(e: dict) -> int:
    b, s, d, _ = e["shape"]
    return b * s * d


def sp_forward(t, runs, picks) -> None:
    for rank, e in _mlp_entries(t, runs, picks):
        _sp_ran(t, rank, e)
        size, ops = _sp_whole(e), e["fwd"]
        want = [("all_gather", size), ("reduce_scatter", size)]
        if sorted((op, n) for op, n, _ in ops) == want:
            continue
        if _count(ops, "all_reduce"):
            hint = ("an all-reduce in forward: it hands every rank the whole sum, where each rank needs only the "
                    "sum for its own slice of the sequence; with sequence parallelism no activation is all-reduced")
        elif not ops:
            hint = "no collective in forward: fc1's input is the whole sequence, and each rank holds a slice of it"
        else:
            hint = ("forward: the activations cross ranks in exactly two collectives, with the bytes of an "
                    f"all-gather and a reduce-scatter of the whole sequence [batch, seq, d] ({size} elements)")
        t.fail(hint, _in_words(want), f"{_sp_where(rank, e)}: {_in_words(ops)}")


def sp_backward(t, runs, picks) -> None:
    for rank, e in _mlp_entries(t, runs, picks):
        _sp_ran(t, rank, e)
        size, d = _sp_whole(e), e["shape"][2]
        ops = [o for o in e["bwd"] if not (o[0] == "all_reduce" and o[1] <= 3 * d)]  # the weights' gradients: free
        want = [("all_gather", size), ("reduce_scatter", size)]
        if sorted((op, n) for op, n, _ in ops) == want:
            continue
        if _count(ops, "all_reduce"):
            hint = ("an all-reduce of an activation's gradient in backward: each collective of forward has its "
                    "conjugate in backward, and neither of them is an all-reduce")
        elif not ops:
            hint = ("no collective of the activations' gradients in backward: the gradients of a gathered "
                    "sequence and of a scattered one cross the ranks too")
        elif _count(ops, "all_gather") and not _count(ops, "reduce_scatter"):
            hint = ("in backward no collective brings the gathered sequence's gradient back to the slices: every "
                    "rank's slice of fc1 contributed to the gradient of every token, and each rank needs the sum for "
                    "its own tokens")
        elif _count(ops, "reduce_scatter") and not _count(ops, "all_gather"):
            hint = ("in backward the output's gradient never crossed the ranks: every rank's slice of fc2 worked on "
                    "every token, so it needs the output's gradient for every token, not its own slice's only")
        else:
            hint = ("backward: the activations' gradients cross ranks in exactly two collectives, the conjugates "
                    f"of forward's, each of the whole sequence's size ({size} elements); all-reduces of the "
                    "replicated weights' gradients aside")
        t.fail(hint, _in_words(want) + " (and all-reduces of weights' gradients)",
               f"{_sp_where(rank, e)}: {_in_words(e['bwd'])}")


def sp_norm_slice(t, runs, picks) -> None:
    sp_output(t, runs, picks)  # a norm on a slice is no evidence of sequence parallelism in a block that is wrong
    for rank, e in _mlp_entries(t, runs, picks):
        b, s, d, _ = e["shape"]
        mine = [b, s // e["world"], d]
        if not e["norm_inputs"]:
            t.fail("no layer norm in the autograd graph of the output: the block normalises with norm, the "
                   "nn.LayerNorm passed in", f"a layer norm of {mine}", f"{_sp_where(rank, e)}: none")
        if any(shape != mine for shape in e["norm_inputs"]):
            hint = ("the norm ran on the whole gathered sequence: every rank normalised, and saved for backward, all "
                    "the tokens, the work and memory that sequence parallelism exists to split"
                    if any(shape[1:2] == [s] for shape in e["norm_inputs"]) else
                    "the norm works on this rank's slice of the sequence only")
            t.fail(hint, f"the norm's saved input {mine} (1/{e['world']} of one process's)",
                   f"{_sp_where(rank, e)}: {e['norm_inputs']}")


def sp_device(t, runs, k: int) -> None:
    for rank, e in enumerate(runs.get(t, k)):
        elsewhere = [o for o in e["fwd"] + e["bwd"] if o[2] and o[2] != "cpu"]
        if e["error"] or elsewhere:
            t.fail(ON_DEVICE, "every tensor it communicates on the input's device (cpu)",
                   f"{_sp_where(rank, e)}: " + (e["error"] or f"{elsewhere[0][0]} of a tensor on {elsewhere[0][2]}"))
        if not e["fwd"] or not e["bwd"]:
            t.fail("not judged: the call communicated nothing forward or backward", "collectives",
                   f"{_sp_where(rank, e)}: {_in_words(e['fwd'] + e['bwd'])}")
        if not isinstance(e["out"], torch.Tensor) or e["out"].device.type != "cpu" or not _close(e["out"], e["want"]):
            t.fail("the output must be right, on the input's device", "the unsplit block's output on cpu",
                   f"{_sp_where(rank, e)}: {_diff(e['out'], e['want'])}")

"""How lesson 08's checks judge the evidence of :mod:`.ranks` (plain data), in the kernel.

Each ``judge_*`` function fails the current case (``t.fail``) with what was
expected, what came, and, where the evidence allows, the bug it points to:
the sum of the gradients instead of their mean, a gradient all-gathered instead
of an updated shard, the whole model all-gathered at once, a checkpoint that
was gathered to one rank before it was written.
"""
from __future__ import annotations

import torch

from mgpu_lab.sharding import zero
from ..sim.outcome import in_words


def zero_groups(n_measured):
    m = ((n_measured, 4, s) for s in range(4))
    sweep = [((n, w, s), {}) for n in (1, 2, 7, 64, 1001) for w in (1, 3, 8) for s in range(4)]
    sweep += [((n, w, s, p, g, o), {}) for n, w in ((999, 7), (5, 8)) for s in range(4) for p, g, o in ((2, 2, 12),
                                                                                                        (1, 3, 5))]
    return [
        ("stage 0 (DDP): 1000 parameters on 4 ranks hold 1000 x (4 + 4 + 8) = 16000 bytes each",
         [((1000, 4, 0), {})], "stage 0 shards nothing: n_params x (param_bytes + grad_bytes + optim_bytes)"),
        ("stage 1 shards the optimizer state: 1000 x (4 + 4) + 250 x 8", [((1000, 4, 1), {})],
         "stage 1: parameters and gradients whole, the optimizer state in shards of ceil(n_params / world_size)"),
        ("stage 2 shards the gradients too: 1000 x 4 + 250 x (4 + 8)", [((1000, 4, 2), {})],
         "stage 2: the parameters whole, gradients and optimizer state in shards"),
        ("stage 3 shards the parameters too: 250 x (4 + 4 + 8)", [((1000, 4, 3), {})],
         "stage 3 (FSDP) shards all three: shard x (param_bytes + grad_bytes + optim_bytes)"),
        ("shards round up: 10 parameters on 4 ranks make shards of 3 (stages 0-3)",
         [((10, 4, s), {}) for s in range(4)], "a shard is ceil(n_params / world_size) elements"),
        ("mixed precision: 2-byte parameters and gradients, 12 bytes of optimizer state (fp32 master + Adam)",
         [((10**6, 8, s, 2, 2, 12), {}) for s in range(4)] + [((10, 4, 1), {"param_bytes": 2, "grad_bytes": 2,
                                                                          "optim_bytes": 12})],
         "use param_bytes, grad_bytes and optim_bytes as given, each for its own kind of tensor"),
        ("ValueError for a stage outside 0..3 and for sizes that are not positive", None, ""),
        (f"equals what 4 real ranks hold after 2 Adam steps of a {n_measured}-parameter model: DDP, ZeRO-1 and "
         "ZeRO-2 by hand, FSDP2 (up to their padding)", [(args, {}) for args in m], "measured"),
        (f"{len(sweep)} more combinations of sizes, world sizes, stages and byte counts", sweep, "hidden"),
    ]


SGD_LR = 0.5


# (elements, dtype, run under torch.device("meta")): the cases of the sharded_sgd_step probe
SGD_CASES = [(12, "float32", False), (10, "float32", False), (2, "float32", False), (10, "float64", False),
             (10, "float32", True)]


def _show(call) -> str:
    args, kwargs = call
    return "zero_memory(" + ", ".join([repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]) + ")"


def judge_values(t, calls, got, hint):
    """zero_memory's value for each call equals the formula's, as an int; names a shard rounded down."""
    for call, res in zip(calls, got):
        expected = zero.zero_memory(*call[0], **call[1])
        if res[0] != "ok":
            t.fail(f"{_show(call)} raised {res[1]}: {res[2]}; {hint}", expected, f"raised {res[1]}")
        if res[2] != "int":
            t.fail(f"{_show(call)} returned a {res[2]}: return an int (bytes are whole; use // or math.ceil, "
                   f"not /)", f"{expected} (int)", f"{res[1]!r} ({res[2]})")
        if res[1] != expected:
            n, world = call[0][0], call[0][1]
            floor = n // world
            if n % world and res[1] == _with_shard(call, floor):
                hint = (f"a shard of {n} parameters on {world} ranks is ceil({n} / {world}) = "
                        f"{-(-n // world)} elements: n_params // world_size rounds down and loses the remainder")
            t.fail(f"{_show(call)}: {hint}", expected, res[1])


def _with_shard(call, shard) -> int:
    (n, world, stage, *rest), kw = call
    b = dict(zip(("param_bytes", "grad_bytes", "optim_bytes"), rest), **kw)
    p, g, o = b.get("param_bytes", 4), b.get("grad_bytes", 4), b.get("optim_bytes", 8)
    return (n if stage < 3 else shard) * p + (n if stage < 2 else shard) * g + (n if stage < 1 else shard) * o


def judge_raises(t, calls, got):
    """Every call raised ValueError."""
    for call, res in zip(calls, got):
        if res[0] != "raised" or res[1] != "ValueError":
            t.fail("check stage first (0, 1, 2 or 3) and every size (n_params, world_size, the byte counts) "
                   "for > 0; raise ValueError naming the value", f"{_show(call)} raises ValueError",
                   in_words(res))


def judge_measured(t, calls, got, held):
    """zero_memory for stages 0-3 matches the bytes real ranks held (``held``), up to each scheme's padding."""
    names = ("DDP (stage 0)", "ZeRO-1", "ZeRO-2", "FSDP2 (stage 3)")
    for stage, (call, res) in enumerate(zip(calls, got)):
        if res[0] != "ok":
            t.fail(f"{_show(call)} raised {res[1]}: {res[2]}")
        pad = 0 if stage == 0 else 16 * (held["fsdp_padding"] if stage == 3 else held["flat_padding"])
        if not isinstance(res[1], (int, float)) or abs(res[1] - held[f"stage{stage}"]) > pad:
            t.fail(f"under {names[stage]} each of 4 real ranks holds {held[f'stage{stage}']} bytes of parameters, "
                   f"gradients and Adam state (padding: up to {pad} bytes)", held[f"stage{stage}"], res[1])


def _expected(results, k):
    param = results[0][k]["param"].double()
    grads = torch.stack([r[k]["grad"].double() for r in results])
    return param, grads


def judge_result(t, results, k):
    """Case ``k``: every rank returned ``param - lr * mean(grads)``; names the sum, the own gradient, the padding."""
    n = SGD_CASES[k][0]
    param, grads = _expected(results, k)
    want = param - SGD_LR * grads.mean(0)
    for r, res in enumerate(results):
        e = res[k]
        if e["status"] != "ok":
            t.fail("", "the new parameter", f"rank {r} raised {e['error']}")
        got = e["result"]
        if not isinstance(got, torch.Tensor):
            # a result on 'meta' is the device case's own bug: its hint says so
            t.fail("" if got == "a meta tensor" else "return the new full parameter as a tensor", "a tensor", got)
        if got.numel() != n:
            t.fail(f"return the whole parameter, {n} elements: all-gather every rank's shard, then cut the "
                   "padding off (full[:n])", f"{n} elements", f"{got.numel()} elements on rank {r}")
        got = got.double().flatten()
        if not torch.allclose(got, want, atol=1e-5):
            guesses = [(param - SGD_LR * grads.sum(0), "you used the sum of the gradients: reduce-scatter adds "
                        "them; divide by world_size (or use op=dist.ReduceOp.AVG)"),
                       (param - SGD_LR * grads[r], "you used this rank's own gradient: reduce the gradients over "
                        "the ranks first")]
            hint = next((h for g, h in guesses if torch.allclose(got, g, atol=1e-5)), "")
            t.fail(hint, [round(v, 4) for v in want.tolist()], [round(v, 4) for v in got.tolist()])


def judge_collectives(t, results, k):
    """Case ``k`` issued one reduce-scatter and one all-gather of the padded size on every rank, no all-reduce."""
    n, world = SGD_CASES[k][0], len(results)
    padded = -(-n // world) * world
    for r, res in enumerate(results):
        log = res[k]["collectives"]
        ops = [(c["op"], c["numel"]) for c in log if c["op"] != "wait"]  # a functional collective's wait
        if any(op == "all_reduce" for op, _ in ops):
            t.fail("no all-reduce: that is DDP (every rank then holds the whole averaged gradient); "
                   "reduce-scatter the gradient so each rank gets the sum of its own block only",
                   f"[('reduce_scatter', {padded}), ('all_gather', {padded})]", ops)
        if sorted(ops) != [("all_gather", padded), ("reduce_scatter", padded)]:
            t.fail("one reduce-scatter of the padded gradient, then one all-gather of the updated shards "
                   "(torch.distributed's collectives)", f"[('reduce_scatter', {padded}), ('all_gather', {padded})]",
                   f"rank {r}: {ops}")


def judge_own_shard(t, results, k):
    """Case ``k``: rank r all-gathered its own updated block; names a gathered gradient or a strided shard."""
    n, world = SGD_CASES[k][0], len(results)
    shard = -(-n // world)
    param, grads = _expected(results, k)
    pad = shard * world - n
    full = torch.cat([param - SGD_LR * grads.mean(0), torch.zeros(pad, dtype=torch.float64)])
    grad_mean = torch.cat([grads.mean(0), torch.zeros(pad, dtype=torch.float64)])
    for r, res in enumerate(results):
        sent = next((c.get("input") for c in res[k]["collectives"] if c["op"] == "all_gather"), None)
        block = full[r * shard:(r + 1) * shard]
        if sent is None or sent.numel() != shard:
            t.fail("all-gather one shard per rank", f"rank {r} sends {shard} elements",
                   "nothing" if sent is None else f"{sent.numel()} elements")
        sent = sent.double().flatten()
        if not torch.allclose(sent, block, atol=1e-5):
            if torch.allclose(sent, grad_mean[r * shard:(r + 1) * shard], atol=1e-5) or torch.allclose(
                    sent, world * grad_mean[r * shard:(r + 1) * shard], atol=1e-4):
                hint = ("you all-gathered the gradient shard and then updated the whole parameter on every "
                        "rank: update only your shard, then all-gather the updated parameters")
            else:
                hint = (f"rank r owns the contiguous block [r * shard, (r + 1) * shard) of the padded parameter "
                        f"(shard = ceil(n / world_size) = {shard}); update exactly that block and all-gather it")
            t.fail(hint, f"rank {r} sends {[round(v, 4) for v in block.tolist()]}",
                   [round(v, 4) for v in sent.tolist()])


def need(t, ev):
    if ev is None:
        t.fail("the first case did not finish")


def judge_gathers(t, calls, op, sizes):
    """One ``op`` per block and one for the root's own parameters; none of the whole model."""
    mine = [n for o, n in calls if o == op]
    name = op.replace("_", "-")
    want = f"{sizes['blocks']} {name}s of {sizes['block']} elements (one per block), 1 of {sizes['root']} (the root)"
    if not mine:
        t.fail(f"no {name} was issued: the parameters are not sharded", want, calls)
    if max(mine) >= sizes["total"]:
        t.fail("", want, f"{len(mine)} {name}(s) of {mine} elements: the whole model "
               f"({sizes['total']} elements with FSDP's padding) at once")
    if sorted(mine) != sorted([sizes["block"]] * sizes["blocks"] + [sizes["root"]]):
        t.fail("", want, mine)


def judge_dcp(t, what, saved, loaded2=None):
    """Judge one aspect of the checkpoint probes' evidence (rank 0's, plus every rank's file list)."""
    ev = saved[0]
    if "save_error" in ev:
        t.fail("" if what == "files" else "saving did not work", "save_checkpoint returns after saving",
               f"it raised {ev['save_error']}")
    if what == "files":
        files = ev["files"]
        want = [".metadata"] + [f"__{r}_0.distcp" for r in range(4)]
        if ev["layout"] is None:
            t.fail("no .metadata in path: that is not a DCP checkpoint. Every rank calls dcp.save(state, "
                   "checkpoint_id=path) with the same path (not torch.save on one rank, not a path per rank)",
                   want, files)
        if sorted(f for f in files if f in want) != sorted(want):
            t.fail("", want, files)
        return
    if what in ("sharded", "optim") and ev["layout"] is None:
        t.fail("there is no DCP checkpoint in path to read (no .metadata)")
    if what == "sharded":
        tensors = ev["layout"]["tensors"]
        whole = sorted(k for k, v in tensors.items() if v["shape"] and v["shape"][0] >= 4
                       and (v["chunks"] != 4 or len(v["files"]) != 4))
        if whole:
            info = tensors[whole[0]]
            t.fail("", "4 slices in 4 files", f"{whole[0]}: {info['chunks']} slice(s) in {info['files']} "
                   f"({len(whole)} such tensors)")
        return
    if what == "optim":
        names = list(ev["layout"]["tensors"])
        for kind in ("exp_avg", "exp_avg_sq"):
            found = [k for k in names if k.endswith("." + kind)]
            if len(found) != 8:  # 8 parameters: inp, 2 blocks, head; weight and bias each
                t.fail("", f"8 tensors named ...{kind}", f"{len(found)}")
        return
    state = ev.get("loaded") if what == "load4" else (loaded2[0]["loaded"] if loaded2 else None)
    if what == "load4" and "load_error" in ev:
        if ev["load_error"].startswith("not run"):
            t.fail(ev["load_error"])
        t.fail("", "load_checkpoint returns after loading", f"it raised {ev['load_error']}")
    _same_state(t, ev["saved"], state)


def _same_state(t, saved, loaded):
    if set(loaded) != set(saved):
        t.fail("", sorted(saved)[:4], f"{len(loaded)} tensors, missing {sorted(set(saved) - set(loaded))[:4]}")
    bad = sorted(k for k in saved if saved[k].shape != loaded[k].shape or not torch.equal(saved[k], loaded[k]))
    if bad:
        kind = "optimizer state" if all(k.startswith("optim.") for k in bad) else "tensors"
        t.fail(f"the {kind} differ after loading" + (": a fresh optimizer has no state until get_state_dict(model, "
               "optimizer) creates it; load into that and put it back with set_state_dict" if kind != "tensors"
               else ""), "every tensor equal", f"{len(bad)} differ, e.g. {bad[:3]}")

"""How lesson 08's checks judge the evidence of :mod:`.ranks` (plain data), in the kernel.

Each ``judge_*`` function fails the current case (``t.fail``) with what was
expected, what came, and, where the evidence allows, the bug it points to:
the sum of the gradients instead of their mean, a gradient all-gathered instead
of an updated shard, decoupled weight decay, parameters never shared, the whole
model held or all-gathered at once, a full state on a rank that should not hold it.
"""
from __future__ import annotations

import torch



SGD_LR = 0.5


# (elements, dtype, run under torch.device("meta")): the cases of the sharded_sgd_step probe
SGD_CASES = [(12, "float32", False), (10, "float32", False), (2, "float32", False), (10, "float64", False),
             (10, "float32", True)]


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
            t.fail(f"the result has {got.numel()} elements, the parameter {n}: "
                   + ("the padding is still in it: cut the padding off" if got.numel() > n else
                      "some ranks' parts are missing"), f"{n} elements", f"{got.numel()} elements on rank {r}")
        got = got.double().flatten()
        if not torch.allclose(got, want, atol=1e-5):
            guesses = [(param - SGD_LR * grads.sum(0), "your step used the sum of the ranks' gradients, which "
                        "is what a reduce-scatter gives by default; SGD after data parallelism steps by their mean"),
                       (param - SGD_LR * grads[r], "your step used this rank's own gradient: the ranks' gradients "
                        "must be combined before any rank updates its part")]
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
            t.fail("your step all-reduces, so every rank holds the whole summed gradient (DDP's way, no memory "
                   "saved); in ZeRO each rank receives the sum of its own block only, no all-reduce",
                   f"[('reduce_scatter', {padded}), ('all_gather', {padded})]", ops)
        if sorted(ops) != [("all_gather", padded), ("reduce_scatter", padded)]:
            t.fail("ZeRO's step moves the gradient once (each rank receiving the sum of its block) and the "
                   "updated parameter once (every rank receiving every block), each of the padded size",
                   f"[('reduce_scatter', {padded}), ('all_gather', {padded})]", f"rank {r}: {ops}")


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
            t.fail("each rank contributes one shard to the all-gather", f"rank {r} sends {shard} elements",
                   "nothing" if sent is None else f"{sent.numel()} elements")
        sent = sent.double().flatten()
        if not torch.allclose(sent, block, atol=1e-5):
            if torch.allclose(sent, grad_mean[r * shard:(r + 1) * shard], atol=1e-5) or torch.allclose(
                    sent, world * grad_mean[r * shard:(r + 1) * shard], atol=1e-4):
                hint = ("you all-gathered the gradient and then updated the whole parameter on every rank: each "
                        "rank updates only its own shard, and the updated parameters are what is gathered")
            else:
                hint = (f"rank r owns a contiguous block of the padded parameter, {shard} elements (the same "
                        "block whose summed gradient it received), not every world_size-th element; it sent "
                        "something else")
            t.fail(hint, f"rank {r} sends {[round(v, 4) for v in block.tolist()]}",
                   [round(v, 4) for v in sent.tolist()])


def need(t, *evs):
    if any(ev is None for ev in evs):
        t.fail("the first case did not finish")




# -- ShardedAdam ---------------------------------------------------------------------------
def _worst(got, want) -> float:
    return max((g.double() - w.double()).abs().max().item() for g, w in zip(got, want))


STALE_HINT = ("zero_grad left gradients in place (on parameters this rank does not own): DDP's next backward adds "
              "to them and its all-reduce spreads the stale sum to their owners; zero_grad clears every parameter's "
              "gradient, as torch.optim's does")


def judge_adam(t, ranks, k, tol: float = 1e-6, hint: str = ""):
    """Config ``k``: every rank's weights equal DDP + Adam's; names AdamW's decay, stale gradients left by
    zero_grad and parameters never shared; ``hint`` when none of these is recognised."""
    for r, ev in enumerate(ranks):
        entry = ev["configs"][k]
        if "error" in entry:
            t.fail("", "5 steps", f"rank {r} raised {entry['error']}")
        if not entry["optimizer"]:
            t.fail("ShardedAdam is a torch.optim.Optimizer (DDP's training loop calls zero_grad and step on it)",
                   "a torch.optim.Optimizer", "another class")
        worst = _worst(entry["weights"], entry["adam"])
        if worst <= tol:
            continue
        if _worst(entry["weights"], entry["adamw"]) <= tol:
            t.fail("your weight decay is AdamW's (decoupled: the weights shrink apart from the gradient); "
                   "torch.optim.Adam's weight_decay is L2: it adds weight_decay x the parameter to the gradient, "
                   "so the moments see it", f"max difference <= {tol}", f"{worst:.3g} (AdamW's weights)")
        moved = [i for i, (w, a0) in enumerate(zip(entry["weights"], ranks[0]["configs"][k]["adam"]))
                 if (w.double() - a0.double()).abs().max().item() <= tol]
        stale = sorted({i for e in ranks for i in e["configs"][k].get("stale", [])})
        said = f"{worst:.3g} on rank {r}; parameters right there: {moved} of {len(entry['weights'])}"
        if stale:
            t.fail(STALE_HINT, f"max difference <= {tol} on every rank",
                   f"{said}; gradients left after zero_grad: parameters {stale}")
        t.fail(hint or "each owner applies torch.optim.Adam's update to its parameters (moments, bias correction, "
               "L2 weight decay) and every rank receives the updated values after the step",
               f"max difference <= {tol} on every rank", said)


def judge_pair(t, ranks, tol: float = 1e-6):
    """Two ShardedAdams alive at once, the second over two parameter groups: each equals torch.optim.Adam's."""
    for r, ev in enumerate(ranks):
        pair = ev["pair"]
        if "error" in pair:
            t.fail("two optimizers alive at once, one with two parameter groups, must both train: each keeps "
                   "what it needs on itself and reads each group's settings from its group",
                   "5 steps of each", f"rank {r} raised {pair['error']}")
        first = _worst(pair["first"], pair["adam_first"])
        second = _worst(pair["second"], pair["adam_second"])
        alone = _worst(pair["second_alone"], pair["adam_second"])
        if first > tol:
            t.fail("the first ShardedAdam no longer trains right once a second one exists: what an optimizer "
                   "keeps (its parameters, their owners, its state) belongs to the instance, not to the class, "
                   "so that two of them never share it", f"max difference <= {tol}",
                   f"the first optimizer's weights differ by {first:.3g} on rank {r}")
        if second > tol:
            hint = ("each parameter group's settings (here lr, betas and weight_decay) apply to that group's "
                    "parameters, as in torch.optim.Adam: an optimizer reads them from the group it steps, "
                    "falling back to the constructor's for what a group leaves out" if alone > tol else
                    "the second ShardedAdam is right alone but not beside the first: two optimizers must not "
                    "share what each keeps")
            t.fail(hint, f"max difference <= {tol}", f"the grouped optimizer's weights differ by {second:.3g} "
                   f"on rank {r}" + (" (and by as much with no other optimizer alive)" if alone > tol else ""))


def judge_replicas(t, ranks):
    """After the steps every rank holds the same weights; names parameters their owner never shared."""
    entries = [ev["configs"][0] for ev in ranks]
    if any("error" in e for e in entries):
        t.fail("", "5 steps", "a rank raised (see the first case)")
    if not any(e["moved"] for e in entries):
        t.fail("no weight changed in 5 steps: there is nothing to keep equal", "trained weights", "the initial ones")
    base = entries[0]["weights"]
    for r, e in enumerate(entries[1:], 1):
        odd = [i for i, (a, b) in enumerate(zip(base, e["weights"])) if not torch.equal(a, b)]
        if odd:
            stale = [i for i in odd if any(torch.equal(e["weights"][i], x["adam"][i]) for x in entries)]
            t.fail("the ranks' copies differ: a rank updates the parameters it owns, and the others keep their "
                   "old values unless the owner shares each updated parameter with every rank after the step",
                   "the same weights on every rank", f"rank 0 and rank {r} differ in parameters {odd}"
                   + (f" ({len(stale)} of them right on one rank only)" if stale else ""))


def judge_adam_state(t, ranks):
    """Each rank keeps Adam state for its own parameters only: at most its share plus one parameter's, no overlap."""
    sizes = ranks[0]["sizes"]
    world, total = len(ranks), sum(sizes)
    limit = 8 * (-(-total // world) + max(sizes))  # exp_avg and exp_avg_sq, fp32: 8 bytes an element
    entries = [ev["configs"][0] for ev in ranks]
    if any("error" in e for e in entries):
        t.fail("", "5 steps", "a rank raised (see the first case)")
    owned = [set(e["state"]["owned"]) for e in entries]
    if not any(owned):
        t.fail("no rank keeps Adam state in the optimizer's state (self.state[parameter])", "exp_avg and "
               "exp_avg_sq of each parameter, on its owner", "none found")
    for r, e in enumerate(entries):
        if e["state"]["bytes"] > limit:
            every = len(owned[r]) == len(sizes)
            t.fail("this rank keeps Adam state for " + ("every parameter: that is plain Adam, not ZeRO-1" if every
                   else f"parameters of {sum(sizes[i] for i in owned[r])} elements of {total}: share the "
                   "parameters so that each rank's part is near 1/world_size of the elements, not of the count"),
                   f"at most {limit} bytes (a share of {-(-total // world)} elements plus one parameter of "
                   f"{max(sizes)}, 8 bytes each)", f"rank {r} of {world}: {e['state']['bytes']} bytes")
    both = set.intersection(*owned)
    if both or set.union(*owned) != set(range(len(sizes))):
        t.fail("every parameter has its Adam state on exactly one rank, its owner",
               f"the {len(sizes)} parameters split over the ranks", f"on several ranks: {sorted(both)}; on none: "
               f"{sorted(set(range(len(sizes))) - set.union(*owned))}")


def judge_adam_traffic(t, ranks):
    """A step moves the updated parameters once: no all-reduce (DDP averaged the gradients), about P elements."""
    total = sum(ranks[0]["sizes"])
    for r, ev in enumerate(ranks):
        entry = ev["configs"][0]
        if "error" in entry:
            t.fail("", "5 steps", "a rank raised (see the first case)")
        ops = entry.get("step_ops") or []
        moved = sum(n for _, n in ops)
        if any(op == "all_reduce" for op, _ in ops):
            t.fail("your step all-reduces: DDP has already averaged the gradients in backward, so the step only "
                   "needs to share the updated parameters", "broadcasts or all-gathers of the parameters",
                   f"rank {r}: {ops}")
        if not ops:
            t.fail("your step issued no collective: the other ranks never receive the parameters this rank "
                   "updated", f"about {total} elements moved", "nothing")
        if moved > 2 * total:
            t.fail("each updated parameter needs to reach the other ranks once", f"about {total} elements",
                   f"rank {r}: {moved} elements in {len(ops)} collectives")


# -- build_sharded -------------------------------------------------------------------------
def judge_sharding(t, ev, want):
    """The model came back, each block and the root FSDP modules, every parameter a DTensor Shard(0) on the mesh."""
    if "fsdp" not in ev:
        t.fail("build_sharded returns the sharded model", "an nn.Module", f"a {ev['returned']}")
    if ev["fsdp"] != want:
        t.fail("every block of model.blocks is its own FSDP group and the root takes the rest, so that a "
               "forward gathers one block at a time", want, ev["fsdp"])
    for name, p in ev["params"].items():
        if not p["dtensor"]:
            t.fail(f"{name} is a plain {p['type']}: the root's own parameters (inp, head) are sharded too",
                   "DTensor", p["type"])
        if not p["shard0"] or not p["given_mesh"]:
            t.fail("every parameter is sharded on dim 0 over the mesh passed in (a default mesh lands on the "
                   "accelerator, CUDA on a GPU machine)", f"{name}: [Shard(dim=0)] on the mesh passed in",
                   f"{p['placements']} on {p['mesh']}")


def judge_live(t, ranks):
    """No rank's live parameter storage ever reached the whole model: at most its shards and room for three blocks
    (one unsharded block at a time while initialising, and the temporaries of copying it into the shards)."""
    for r, ev in enumerate(ranks):
        sizes = ev["sizes"]
        if "params" not in ev or not all(p["dtensor"] for p in ev["params"].values()):
            t.fail("no sharded model came back: an unsharded one is the whole model", "a sharded model",
                   ev.get("returned") if "params" not in ev else "plain tensors")
        limit = ev["end"] + 3 * sizes["block_bytes"]
        if ev["peak"] > limit or ev["peak"] >= sizes["whole_bytes"]:
            real = [c for c in ev["calls"] if c != "meta"]
            t.fail("a rank held the whole model at once" + (f": model_fn() ran {len(real)} time(s) on the "
                   f"{real[0]}, which makes every weight of the model at once; built on the meta device it "
                   "allocates nothing" if real else ""), f"at most {limit} bytes (this rank's shards, "
                   f"{ev['end']}, plus three blocks of {sizes['block_bytes']}); the whole model is "
                   f"{sizes['whole_bytes']}", f"rank {r}: a peak of {ev['peak']} bytes")


def judge_init(t, ev):
    """The gathered weights equal model_fn()'s on one process, for BlockNet and for a model whose head is made
    first and registered last."""
    bad = {k: v for k, v in ev["diff"].items() if v is None or v > 1e-6}
    if bad:
        zeros = all(v is not None for v in bad.values())
        t.fail("the weights are not those model_fn() makes on one process: after to_empty the memory holds "
               "whatever was there, and a random initialisation applied to each rank's shard draws other "
               "numbers than one process drawing whole tensors, in the order model_fn() made them"
               if zeros else "some parameters changed shape", "every parameter within 1e-6",
               f"{len(bad)} of {len(ev['diff'])} differ, e.g. {sorted(bad)[:3]}")
    other = ev.get("head_first")
    if not isinstance(other, dict):
        t.fail("build_sharded works for any model_fn shaped like BlockNet", "a sharded model of the second "
               "model_fn", f"{other}")
    bad = sorted(k for k, v in other.items() if v is None or v > 1e-6)
    if bad:
        t.fail("right for BlockNet, wrong for a model that makes its head first and registers it last: one process "
               "draws the layers' weights in the order model_fn() makes them, which need not be the order the model "
               "lists them in (named_modules, parameters)", "every parameter within 1e-6",
               f"second model: {len(bad)} of {len(other)} differ, e.g. {bad[:3]}")


def judge_built_sharded(t, ranks):
    """Cases that judge the sharded model count for a model built without any rank holding it whole: a model
    built whole and sharded afterwards is the lesson's demo, with nothing of the exercise in it."""
    for r, ev in enumerate(ranks):
        real = [c for c in ev.get("calls", []) if c != "meta"]
        limit = ev["end"] + 3 * ev["sizes"]["block_bytes"] if "end" in ev else 0
        if real or ("peak" in ev and (ev["peak"] > limit or ev["peak"] >= ev["sizes"]["whole_bytes"])):
            t.fail("not judged: rank {r} built the whole model and sharded it afterwards, as section 4's demo "
                   "does; this case counts for a model built without any rank holding it whole (see the case "
                   "about the parameter storage)".format(r=r), "a model built shard by shard",
                   f"rank {r}: model_fn() ran on the {real[0]}" if real else f"rank {r}: a peak of {ev['peak']} bytes")


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


# -- load_full_into_sharded ----------------------------------------------------------------
def judge_loaded(t, ranks):
    """Every parameter, gathered, equals the file's."""
    bad = {k: v for k, v in ranks[0]["diff"].items() if v is None or v > 0}
    if bad:
        t.fail("after loading, the model's weights are not the file's: every rank's shards come from the "
               "file rank 0 read", "every parameter equal", f"{len(bad)} of {len(ranks[0]['diff'])} differ, "
               f"e.g. {sorted(bad)[:3]}")


def judge_own_shards(t, ranks):
    """Every rank ends with exactly its shards: DTensors Shard(0), local rows the file's chunk of this rank."""
    for r, ev in enumerate(ranks):
        plain = [k for k, p in ev["params"].items() if not p["dtensor"] or not p["shard0"] or not p["given_mesh"]]
        if plain:
            p = ev["params"][plain[0]]
            t.fail("the model stays sharded as it was: loading puts values into each rank's shards, it does not "
                   "replace the parameters", f"{plain[0]}: a DTensor Shard(0) on the model's mesh",
                   f"rank {r}: {p.get('placements', p.get('type'))}")
        wrong = sorted(set(ev["params"]) - set(ev["local_ok"]))
        if wrong:
            t.fail("rank r keeps the rows of chunk r of each tensor (dim 0 cut in world_size pieces)",
                   "every local shard equal to its chunk of the file's tensor", f"rank {r}: {wrong[:3]} differ")


def judge_opened(t, ranks):
    """Only rank 0 opened the file."""
    if any(sorted(ev["local_ok"]) != sorted(ev["params"]) for ev in ranks):
        t.fail("not every rank ended with its shards of the file: the file was not read and shared",
               "the file's shards loaded on every rank", "not loaded")
    if not ranks[0]["opened"]:
        t.fail("rank 0 never opened the checkpoint: it alone reads it", "rank 0 opens the file", "no open")
    others = [r for r, ev in enumerate(ranks) if r and ev["opened"]]
    if others:
        t.fail("other ranks read the file too: on a cluster every rank reading a full checkpoint is world_size "
               "times the reads and the memory; rank 0 reads it and the others receive their part",
               "only rank 0 opens the file", f"rank(s) {others} opened it")


def judge_not_full(t, ranks):
    """No rank but 0 ever held the full state: its live storage stays below half of it (one tensor at a time)."""
    for r, ev in enumerate(ranks):
        if r == 0:
            continue
        if sorted(ev["local_ok"]) != sorted(ev["params"]):
            t.fail(f"rank {r} did not end with its shards of the file, so what it held meanwhile is no evidence",
                   "the file's shards loaded", f"{len(ev['local_ok'])} of {len(ev['params'])} parameters")
        if ev["peak"] >= ev["whole_bytes"] // 2:
            t.fail("a rank other than 0 held (nearly) the whole state at once: it received every full tensor "
                   "before keeping its part; one full tensor at a time is all it needs", f"rank {r}: under "
                   f"{ev['whole_bytes'] // 2} bytes (the full state is {ev['whole_bytes']}, its largest tensor "
                   f"{ev['largest_bytes']})", f"a peak of {ev['peak']} bytes")


# -- MiniFSDP ------------------------------------------------------------------------------
def mini_scenario(t, ranks, name):
    """The evidence of scenario ``name`` on every rank, or the case fails with the error a rank raised."""
    found = []
    for r, ev in enumerate(ranks):
        got = ev["scenarios"].get(name)
        if got is None:
            t.fail("", f"scenario {name}", "not run")
        if "error" in got:
            hint = ("a tensor your code made landed on torch's default device ('meta' here) instead of beside the "
                    "shards: on a GPU machine it is a CPU tensor beside cuda ones and NCCL refuses it; every tensor "
                    "you make takes the device of the tensors it works with"
                    if "meta" in got["error"].lower() else "")
            t.fail(hint, "training runs", f"rank {r} raised {got['error']}")
        found.append(got)
    return found


def judge_mini_weights(t, ranks, name, tol=None, factor=1.0, measured=None):
    """Scenario ``name``: the gathered weights equal one process's within ``tol`` (or ``factor`` x fully_shard's
    measured distance, at least 1e-5); names unchanged weights, missing names, the sum of gradients."""
    for r, got in enumerate(mini_scenario(t, ranks, name)):
        fsdp = ranks[r]["scenarios"][measured]["fsdp"] if measured else got.get("fsdp")
        limit = tol if tol is not None else max(factor * fsdp, 1e-5)
        missing = sorted(k for k, v in got["diff"].items() if v is None)
        if missing:
            t.fail("gather_full_params() returns every parameter of the wrapped module under its name there "
                   "(as module.named_parameters() names it), with its full shape", "every parameter",
                   f"missing or misshapen on rank {r}: {missing[:4]}")
        worst = max(got["diff"].values())
        if worst > limit:
            same = max(got["start"].values()) <= limit
            hint = ("the weights are where they started: the optimizer's steps never reached the tensors the "
                    "forward uses, or the gradients never reached the tensors the optimizer steps") if worst >= max(
                got["start"].values()) * 0.99 else ("the weights moved but not as one process's: gradients are "
                                                    "averaged over the ranks, as DDP averages them, and every "
                                                    "element of every parameter must be updated exactly once")
            t.fail("" if same else hint, f"max difference <= {limit:.2g}", f"{worst:.3g} on rank {r} ({name})")


def judge_mini_dtypes(t, ranks, name):
    """gather_full_params() gives fp32 full tensors, also when the compute dtype is 16-bit."""
    for r, got in enumerate(mini_scenario(t, ranks, name)):
        if not isinstance(got["dtypes"], dict):
            t.fail("gather_full_params() returns a dict of tensors by name", "a dict", got["dtypes"])
        names = ranks[r]["sizes"]["names"]
        if sorted(got["dtypes"]) != names or any(v is None for v in got["diff"].values()):
            t.fail("gather_full_params() returns every parameter of the wrapped module under its name there, "
                   "with its full shape", names[:4], f"rank {r}: {sorted(got['dtypes'])[:4]}")
        other = {k: v for k, v in got["dtypes"].items() if v != "torch.float32"}
        if other:
            t.fail("the full parameters are the fp32 master weights, whatever the compute dtype", "torch.float32",
                   f"rank {r}: {dict(list(other.items())[:3])}")


def judge_mini_shards(t, ranks):
    """parameters() are the shards: about 1/W of the elements on every rank."""
    sizes, world = ranks[0]["sizes"], len(ranks)
    most = sizes["total"] / world + world * sizes["count"]
    for r, ev in enumerate(ranks):
        got = next(iter(mini_scenario(t, [ev], next(iter(ev["scenarios"])))))["shard_numel"]
        if not 0 < got <= most:
            t.fail("parameters() of the wrapper are what the optimizer steps: this rank's shards, about 1/"
                   f"{world} of the model (with padding to split sizes {world} does not divide)",
                   f"at most {int(most)} elements ({sizes['total']} / {world} + padding)", f"{got} on rank {r}")


def judge_mini_held(t, ranks):
    """Between steps each rank's storage alive (created since the model was built) is its shards."""
    sizes, world = ranks[0]["sizes"], len(ranks)
    most = 4 * (sizes["total"] / world + world * sizes["count"]) + 4096
    for r, ev in enumerate(ranks):
        mem = ev["memory"]
        if "error" in mem:
            t.fail("", "training runs", f"rank {r} raised {mem['error']}")
        worst = max(mem["held"])
        if worst > most:
            t.fail("between steps a rank keeps only its shards: the full weights of the module it was given, or "
                   "weights gathered for computing, are still alive"
                   + (" (the whole model)" if worst >= sizes["whole_bytes"] else ""),
                   f"at most {int(most):,} B (1/{world} of {sizes['whole_bytes']:,} B, padding, bookkeeping)",
                   f"{worst:,} B on rank {r} ({mem['held']})")


def judge_mini_peak(t, ranks, name):
    """During forward + backward the storage beyond the shards stays within the activations and one unit."""
    sizes, world = ranks[0]["sizes"], len(ranks)
    for r, ev in enumerate(ranks):
        mem, got = ev["memory"], mini_scenario(t, [ev], name)[0]
        if "error" in mem:
            t.fail("", "training runs", f"rank {r} raised {mem['error']}")
        unit = max([n for op, n, _ in got["collectives"] if op == "all_gather"], default=0)
        if not unit:
            t.fail("no all-gather in a step: the model was not sharded, so there is no unit to hold",
                   "all-gathers", got["collectives"][:6])
        shards = 4 * (sizes["total"] / world + world * sizes["count"])
        budget = shards + 1.5 * mem["acts"] + 4 * 4 * unit
        worst = max(mem["peak"])
        if worst > budget:
            t.fail("while forward and backward run, a rank holds its shards, their gradients, the activations and "
                   "the full weights of the unit computing now (with its gradients): weights gathered earlier are "
                   "still alive, or autograd keeps them for backward",
                   f"at most {int(budget):,} B beyond the storage held at the step's start "
                   f"(gradient shards {int(shards):,}, 1.5 x activations {mem['acts']:,}, 4 x the largest "
                   f"unit, {unit} elements, in fp32)", f"{worst:,} B on rank {r} (the whole model: "
                   f"{sizes['whole_bytes']:,} B)")


def judge_mini_gathers(t, ranks, name):
    """A step all-gathers the weights in units no larger than a layer, every weight in forward and again in
    backward: at least twice the model's elements."""
    sizes = ranks[0]["sizes"]
    for r, got in enumerate(mini_scenario(t, ranks, name)):
        gathers = [n for op, n, _ in got["collectives"] if op == "all_gather"]
        if not gathers:
            t.fail("no all-gather in a step: the weights a rank computes with never came from the other ranks' "
                   "shards", "all-gathers", got["collectives"][:6])
        if max(gathers) > sizes["layer"]:
            t.fail("one all-gather brought more than a layer's weights at once: a unit is at most one layer (a "
                   "block), so that no rank ever holds much more than one layer's full weights",
                   f"all-gathers of at most {sizes['layer']} elements", f"one of {max(gathers)} on rank {r}")
        if sum(gathers) < 2 * sizes["total"]:
            t.fail("backward needs the full weights again (a layer's input gradient is computed with them), and "
                   "they were freed after forward: every weight is gathered in forward and again in backward",
                   f"at least {2 * sizes['total']} elements gathered per step", f"{sum(gathers)} on rank {r}")


def judge_mini_reduce(t, ranks, name):
    """Gradients reach the shards by reduce-scatters of about the model's size, no all-reduce."""
    sizes = ranks[0]["sizes"]
    for r, got in enumerate(mini_scenario(t, ranks, name)):
        ops = got["collectives"]
        if any(op == "all_reduce" for op, _, _ in ops):
            t.fail("your step all-reduces gradients, so every rank holds every summed gradient, DDP's way: each "
                   "rank needs only the sum of its own shard's gradient", "no all-reduce",
                   [c for c in ops if c[0] == "all_reduce"][:3])
        scattered = sum(n for op, n, _ in ops if op == "reduce_scatter")
        if not sizes["total"] <= scattered <= sizes["total"] + len(ranks) * sizes["count"] * 2:
            t.fail("each gradient element reaches its shard once per step, by a reduce-scatter",
                   f"reduce-scatters of about {sizes['total']} elements per step", f"{scattered} on rank {r}")


def judge_mini_half(t, ranks, name, dtype):
    """With a 16-bit compute dtype every all-gather moves that dtype: half the bytes of fp32."""
    for r, got in enumerate(mini_scenario(t, ranks, name)):
        kinds = sorted({d for op, _, d in got["collectives"] if op == "all_gather"})
        if kinds != [f"torch.{dtype}"]:
            t.fail(f"with compute_dtype={dtype} the weights travel in {dtype}, half the bytes of fp32: the "
                   "all-gathers carried another dtype",
                   f"all-gathers in torch.{dtype}", f"{kinds} on rank {r}")

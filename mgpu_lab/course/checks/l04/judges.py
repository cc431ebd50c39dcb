"""How lesson 04's ddp_train check judges the evidence of its ranks (in the kernel).

:func:`mgpu_lab.course.checks.l04.ranks.run_ddp_train` returns, per rank, the
samples it read, every move of the model and of each batch (on virtual GPUs),
DDP's ``device_ids`` and the final weights. Each ``judge_*`` function here
fails its case with the bug the evidence shows: the shards, the order across
epochs, where the model and the batches went, and the weights, compared with
one process trained on the global batch and, when they differ, with the wrong
variants a learner is likely to have written.
"""
from __future__ import annotations

import math
import os
import torch
from torch.utils.data import DataLoader, DistributedSampler

from mgpu_lab.data import sampler_view
from mgpu_lab.parallel import baseline
from .ranks import check_data, check_model, exact_model


# -- shard_indices -----------------------------------------------------------------------
def _shard_diagnosis(combo, got, hint) -> str:
    """The bug a wrong list shows, when it matches a known wrong variant; else the case's hint."""
    n, rank, world, shuffle, seed, epoch, drop_last = combo
    right = sampler_view.sampler_indices
    padded = right(n, 0, 1, shuffle, seed, epoch)
    per = len(right(n, rank, world, shuffle, seed, epoch, drop_last))
    known = [
        (shuffle and epoch and got == right(n, rank, world, shuffle, seed, 0, drop_last),
         "your order ignores the epoch: every epoch repeats epoch 0's shuffle"),
        (shuffle and n >= 6 and got == right(n, rank, world, False, seed, epoch, drop_last),
         "your order is not shuffled although shuffle=True"),
        (world > 1 and got == (padded * world)[rank * per:(rank + 1) * per],
         "your ranks take contiguous blocks: the sampler interleaves the ranks (rank r gets positions r, "
         "r + world_size, ...)"),
    ]
    return next((message for found, message in known if found), hint)


def shard_case(t, results, combos, hint):
    for combo, got in zip(combos, results):
        n, rank, world, shuffle, seed, epoch, drop_last = combo
        expected = sampler_view.sampler_indices(n, rank, world, shuffle, seed, epoch, drop_last)
        if got[0] != "ok" or got[1] != expected:
            call = (f"shard_indices(n={n}, rank={rank}, world_size={world}, shuffle={shuffle}, seed={seed}, "
                    f"epoch={epoch}, drop_last={drop_last})")
            why = _shard_diagnosis(combo, got[1], hint) if got[0] == "ok" else hint
            t.fail(f"{call}: {why}", expected, got[1] if got[0] == "ok" else f"raised {got[1]}: {got[2]}")


def every_rank(n, world, **kw):
    return [(n, r, world, kw.get("shuffle", False), kw.get("seed", 0), kw.get("epoch", 0),
             kw.get("drop_last", False)) for r in range(world)]


# -- download_once -----------------------------------------------------------------------
def log_counts(roots, name, round_):
    counts = []
    for root in roots:
        path = os.path.join(root, name)
        lines = open(path).read().split() if os.path.exists(path) else []
        counts.append(sum(1 for k in lines[0::2] if k == str(round_)))
    return counts


def download_callers(roots, round_):
    out = []
    for root in roots:
        path = os.path.join(root, "calls.log")
        words = open(path).read().split() if os.path.exists(path) else []
        out.append(sorted(int(r) for k, r in zip(words[0::2], words[1::2]) if k == str(round_)))
    return out


def self_fetched(callers, results) -> list[int]:
    """The ranks that called fn themselves though they are not their node's local rank 0."""
    return sorted(r for node in callers for r in node if results[r]["local_rank"] != 0)


def judge_paths(t, results, roots, round_, callers=()):
    own = self_fetched(callers, results)
    if own:
        t.fail(f"not judged: ranks {own} called fn themselves (see the first case), so the path they return is "
               "their own, not the one their node's local rank 0 got", "every rank with its local rank 0's path",
               f"ranks {own} fetched for themselves")
    for r, res in enumerate(results):
        got = res["rounds"][round_]
        expected = os.path.join(roots[res["node"]], "data.bin")
        if got["path"] != expected:
            other = [i for i, root in enumerate(roots) if got["path"].startswith(root) and i != res["node"]]
            hint = (f"rank {r} on node {res['node']} got node {other[0]}'s path: every rank needs the path its own "
                    "node's local rank 0 got, which only a collective can bring it") if other else (
                f"rank {r} (local rank {res['local_rank']}) returned {got['path']}: every rank must return the "
                "path that fn returned on its node's local rank 0")
            t.fail(hint, expected, got["path"])


def judge_complete(t, results, round_, callers=()):
    own = self_fetched(callers, results)
    if own:
        t.fail(f"not judged: ranks {own} called fn themselves (see the first case): a rank that wrote the file "
               "finds it complete without waiting for anyone", "ranks that wait for their local rank 0's file",
               f"ranks {own} fetched for themselves")
    for r, res in enumerate(results):
        if not res["rounds"][round_]["found"]:
            t.fail(f"not judged: rank {r} returned no file (see the case above)", "a file", "no file")
        if not res["rounds"][round_]["complete"]:
            t.fail(f"rank {r} returned before the file was complete: the ranks that do not download must not "
                   "return before their node's local rank 0 has", "the complete file", "half a file")


# -- global_mean -------------------------------------------------------------------------
def mean_diagnosis(values, sums, counts) -> str:
    """Name the wrong formula that every rank's value matches, if one does."""
    world, total = len(sums), sum(counts)
    means = [s / c if c else math.nan for s, c in zip(sums, counts)]
    known = [
        ([sum(means) / world] * world, "you averaged the ranks' means: that weighs a rank with 1 sample like a "
                                        "rank with 8: every sample must weigh the same"),
        ([sum(sums) / c if c else math.nan for c in counts], "you divided the total sum by this rank's own "
                                                            "count, not by the count over every rank"),
        ([sum(sums) / total] + values[1:], "only rank 0 has the right mean, as after a reduce to rank 0: "
                                            "every rank needs the result"),
        ([max(sums) / max(counts)] * world, "your values match the largest sum over the largest count, as "
                                            "with op MAX: sums and counts add up over the ranks"),
        ([float(sum(sums))] * world, "you returned the total sum: divide it by the total count"),
    ]
    for formula, message in known:
        if all(isinstance(v, (int, float)) and math.isclose(v, f, rel_tol=1e-6) for v, f in zip(values, formula)):
            return message
    return ("the mean over every rank's samples is the total of the sums over the total of the counts; every "
            "rank must return it")


def judge_shards(t, results, n, world, epochs):
    """Every rank read a disjoint 1/world of the data set in every epoch."""
    per_epoch = -(-n // world)
    for r, res in enumerate(results):
        if len(res["seen"]) == epochs * n:
            t.fail("every rank read the whole data set: a DataLoader that shuffles does not split the data "
                   "among the ranks; a DistributedSampler does", f"{epochs * per_epoch} reads on rank {r}",
                   f"{epochs * n} reads")
        if len(res["seen"]) != epochs * per_epoch:
            t.fail("your ranks did not read their shard of the dataset passed in once per epoch",
                   f"{epochs * per_epoch} samples read by rank {r} ({epochs} epochs)", f"{len(res['seen'])}")
    for e in range(epochs):
        chunks = [set(res["seen"][e * per_epoch:(e + 1) * per_epoch]) for res in results]
        if set().union(*chunks) != set(range(n)) or sum(map(len, chunks)) != n:
            t.fail("the ranks' samples overlap or miss some: each rank needs its own shard",
                   f"epoch {e}: disjoint shards covering 0..{n - 1}", [sorted(c) for c in chunks])


def judge_order(t, results, s):
    """A new shuffled order in every epoch: set_epoch called, shuffle left on."""
    for r, res in enumerate(results):
        size = len(res["seen"]) // s["epochs"]
        if not size:
            t.fail(f"not judged: rank {r} read no sample of the dataset passed in (see the first case)",
                   "a shuffled order in every epoch", "nothing read")
        orders = [res["seen"][e * size:(e + 1) * size] for e in range(s["epochs"])]
        if all(order == list(range(r, s["n"], s["world"])) for order in orders):
            t.fail("your ranks read their shard in index order: the sampler's default is to shuffle",
                   "a shuffled order", f"rank {r}: {orders[0]} in every epoch")
        if size and orders[0] == orders[1]:
            t.fail("every epoch repeats the same order: the sampler only changes its shuffle when it is told "
                   "the epoch", "a new order in epoch 1",
                   f"rank {r}: the same order {orders[0]} twice")


def _resolved(moves):
    """``(who, device)`` of every ``(who, from, to)`` move, ``"cuda"`` read as the current device
    (``torch.cuda.set_device``, else GPU 0)."""
    current, out = "cuda:0", []
    for who, _, device in moves:
        if who == "set_device":
            current = device
        else:  # DDP's device_ids are logged as "None" or "cuda:1,cuda:2"
            out.append((who, ",".join(current if d == "cuda" else d for d in device.split(","))))
    return out


def _wrong_device(got, want, res) -> str:
    rank, local, node = res["rank"], res["local_rank"], res["node"]
    if got in ("cpu", ".cpu()"):
        return (f"rank {rank} sent it to the CPU: on a GPU node each rank uses its own GPU, "
                "mgpu_lab.dist.device(), not a hard-coded 'cpu'")
    if got == "cuda:0":
        return (f"rank {rank} (local rank {local}) used cuda:0, as if every rank shared GPU 0 ('cuda' without an "
                "index is the current device, GPU 0); each rank's GPU is cuda:LOCAL_RANK (mgpu_lab.dist.device())")
    if got == f"cuda:{rank}":
        return (f"rank {rank} is local rank {local} on node {node}: index the GPU with the local rank "
                "(LOCAL_RANK, mgpu_lab.dist.device()), not the global rank")
    return f"rank {rank} used {got}: each rank uses cuda:LOCAL_RANK, here {want} (mgpu_lab.dist.device())"


def judge_model_device(t, results, s):
    """The model went to cuda:LOCAL_RANK on every rank, and DDP's device_ids, if given, say that GPU."""
    for res in results:
        want, moves = f"cuda:{res['local_rank']}", _resolved(res["moves"])
        placed = [device for tag, device in moves if tag == "model"]
        if not placed:
            t.fail(f"rank {res['rank']} never moved the model to its device ({want} on this rank)", want,
                   "the model never moved")
        if placed[-1] != want:
            t.fail(_wrong_device(placed[-1], want, res), want, f"rank {res['rank']}: the model on {placed[-1]}")
        ids = [device for tag, device in moves if tag == "DDP device_ids"]
        if ids and ids[-1] not in ("None", want):
            t.fail(f"rank {res['rank']}'s model is on {want} but DDP was told device_ids=[{ids[-1]}]: DDP's "
                   "device_ids name the one GPU the model is on, or are left out", f"device_ids=[{want}] or None",
                   f"rank {res['rank']}: device_ids=[{ids[-1]}]")


def _model_on(moves):
    placed = [device for tag, device in moves if tag == "model"]
    return placed[-1] if placed else None


def judge_batches(t, results, s):
    """Every batch's inputs and labels went to the rank's GPU.

    The model's parameters stay on the CPU in this simulation, so a batch sent to
    ``next(model.parameters()).device`` (the CPU here, the GPU on a real node) is
    accepted when the model itself went to the right GPU.
    """
    for res in results:
        want, moves = f"cuda:{res['local_rank']}", _resolved(res["moves"])
        for tag, name in (("inputs", "x"), ("labels", "y")):
            made = res["batches"][tag]
            moved = [d for tg, d in moves if tg == tag]
            if not made:
                t.fail("no batch of the dataset passed in was recorded: read the dataset given, through a "
                       "DataLoader in this process (no workers)", "batches", "none")
            # "cpu" is where the parameters of this simulation's model are: x.to(next(model.parameters()).device)
            wrong = [d for d in moved if d != want and not (d == "cpu" and _model_on(moves) == want)]
            if wrong:
                t.fail(_wrong_device(wrong[0], want, res) + f" (the {tag})", want, f"{tag} moved to {wrong[0]}")
            if len(moved) < made:
                t.fail(f"rank {res['rank']}: the {tag} of {made - len(moved)} of its {made} batches never went "
                       f"to its GPU before the forward pass (on a GPU a CPU tensor meeting the model or the loss "
                       "fails)", f"{made} moves to {want}",
                       f"{len(moved)}")


def variant_train(s, global_batch, lr, *, set_epoch=True, zero_grad=True, momentum=0.0, shuffle=True):
    """One process trained like the reference with one thing changed: the wrong variants to diagnose."""
    data, model = check_data(s["n"]), check_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=shuffle)
    loss_fn = torch.nn.CrossEntropyLoss()
    for epoch in range(s["epochs"]):
        if set_epoch:
            sampler.set_epoch(epoch)
        for x, y in DataLoader(data, batch_size=global_batch, sampler=sampler):
            if zero_grad:
                optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _diagnose(state, s) -> str:
    """Name the likely bug: the variant of the reference that the learner's weights match, if any."""
    acc = s.get("accumulate", 1)
    big, lr, world = s["batch"] * s["world"] * acc, s["lr"], s["world"]
    guesses = [
        (dict(global_batch=big, lr=lr / world), f"your weights match lr / world_size = {lr / world:g}: "
                                                "use lr as given"),
        (dict(global_batch=big, lr=lr * world), f"your weights match lr * world_size = {lr * world:g}: "
                                                "use lr as given"),
        (dict(global_batch=big, lr=lr, set_epoch=False), "your weights match training whose sampler is never "
                                                           "told the epoch"),
        (dict(global_batch=s["batch"] * acc, lr=lr), "your weights match a global batch of batch_size: batch_size "
                                                     "is per rank"),
        (dict(global_batch=big, lr=lr, zero_grad=False), "your weights match training whose gradients pile up "
                                                         "over steps: they were never zeroed"),
        (dict(global_batch=big, lr=lr, momentum=0.9), "your weights match SGD with momentum=0.9: the optimizer "
                                                      "is plain SGD"),
    ]
    if acc > 1:
        guesses[:0] = [
            (dict(global_batch=big // acc, lr=lr), f"your weights match an optimizer step after every micro-batch: "
                                                   f"with accumulate={acc} one step covers {acc} micro-batches per "
                                                   f"rank, a global batch of {big}"),
            (dict(global_batch=big, lr=lr * acc), f"your weights match lr x accumulate: your step used the sum of "
                                                  f"the {acc} micro-batches' mean gradients, {acc} times the mean "
                                                  f"gradient over the step's {big} samples"),
        ]
    for kwargs, message in guesses:
        if baseline.max_diff(state, variant_train(s, **kwargs)) < 1e-5:
            return message
    return (f"train so that one optimizer step sees the mean gradient over a global batch of {big} samples: every "
            "rank its DistributedSampler shard, set_epoch every epoch, plain SGD(lr) without momentum, mean "
            "CrossEntropyLoss")


def judge_syncs(t, results, s):
    """One gradient all-reduce (per bucket) per optimizer step: the micro-batches before the last skip it."""
    steps = s["epochs"] * s["n"] // (s["world"] * s["batch"] * s["accumulate"])
    micro = steps * s["accumulate"]
    for res in results:
        got = res["allreduces"]
        if got == 0:
            t.fail(f"rank {res['rank']} never all-reduced a gradient: the micro-batch that ends a step must "
                   "synchronise (outside no_sync), or the ranks drift apart", f"{steps} all-reduces", "0")
        if got >= micro:
            t.fail(f"rank {res['rank']} all-reduced after every micro-batch's backward ({got} times for {micro} "
                   "micro-batches): DDP skips it only for a micro-batch whose forward and backward passes both run "
                   f"inside its no_sync() context, so {s['accumulate'] - 1} of every {s['accumulate']} all-reduces "
                   "are wasted", f"{steps} all-reduces (one per step)", got)
        if got != steps:
            t.fail("", f"{steps} all-reduces (one per optimizer step)", f"rank {res['rank']}: {got}")


def judge_backwards(t, results, s):
    """One backward pass per micro-batch (the point of accumulating: one micro-batch's activations at a time)."""
    micro = s["epochs"] * s["n"] // (s["world"] * s["batch"])
    for res in results:
        if not res["backwards"]:
            t.fail(f"rank {res['rank']} never ran a backward pass through its DDP model", f"{micro} backward passes",
                   "0")
        if res["backwards"] < micro:
            t.fail(f"rank {res['rank']} ran {res['backwards']} backward passes for {micro} micro-batches: one backward "
                   "over several micro-batches (a bigger batch, or their losses summed) keeps all their activations "
                   "alive at once, the memory that accumulation exists to save", f"{micro} backward passes",
                   res["backwards"])


def _states(t, results):
    bad = [res["type"] for res in results if res["state"] is None]
    if bad:
        t.fail("return the trained model's state_dict (of the module inside DDP, without the 'module.' prefix)",
               "dict[str, Tensor]", bad[0])
    return [res["state"] for res in results]


def judge_same_weights(t, results, s):
    """Every rank ends with rank 0's weights (DDP averages the gradients)."""
    states = _states(t, results)
    worst = max(baseline.max_diff(states[0], other) for other in states[1:])
    if worst > 1e-6:
        t.fail("", "identical weights", f"ranks differ by up to {worst:.3g}")
    if not all(res["allreduces"] for res in results):
        t.fail("your ranks ended alike without ever all-reducing a gradient: each trained the same thing on its own "
               "(the same data in the same order); under DDP every rank reads its own shard, and the gradient "
               "all-reduce is what keeps them equal", "identical weights kept by DDP's gradient all-reduces",
               f"gradient all-reduces per rank: {[res['allreduces'] for res in results]}")


def judge_weights(t, results, s):
    """Rank 0's weights equal one process trained on the global batch (to 1e-5)."""
    state = _states(t, results)[0]
    ref = baseline.reference_train(check_model, check_data(s["n"]), s["epochs"],
                                   s["batch"] * s["world"] * s.get("accumulate", 1), s["lr"])
    worst = baseline.max_diff(state, ref)
    if worst > 1e-5:
        t.fail(_diagnose(state, s), "max difference <= 1e-05", f"max difference {worst:.3g}")


def judge_accumulated(t, results, s):
    """With accumulation: every rank ends with the same weights, those of one process with the whole global batch."""
    states = _states(t, results)
    worst = max(baseline.max_diff(states[0], other) for other in states[1:])
    if worst > 1e-6:
        t.fail("your ranks ended with different weights: some optimizer step used gradients that never crossed the "
               "ranks (as when a step follows every micro-batch while all but the step's last skip the all-reduce: "
               "one step after every micro-batch)", "identical weights", f"ranks differ by up to {worst:.3g}")
    judge_weights(t, results, s)


# -- train_exact -------------------------------------------------------------------------
def _exact_steps(n, epochs, lr, plan) -> dict:
    """One process, plain SGD on :func:`.ranks.exact_model`: each step's loss is the sum over ``plan(order)``'s
    groups ``(indices, coefficient)`` of the coefficient times the summed cross-entropy of those samples."""
    from torch.utils.data import default_collate

    data, model = check_data(n), exact_model()
    x, y = default_collate([data[i] for i in range(n)])
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    loss_fn = torch.nn.CrossEntropyLoss(reduction="sum")
    for epoch in range(epochs):
        order = torch.randperm(n, generator=torch.Generator().manual_seed(epoch)).tolist()
        for groups in plan(order):
            optimizer.zero_grad()
            sum(c * loss_fn(model(x[idx]), y[idx]) for idx, c in groups).backward()
            optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _batches(order, size, last=True):
    out = [order[i:i + size] for i in range(0, len(order), size)]
    return out if last or len(out[-1]) == size else out[:-1]


def _means_of(parts, world):
    """DDP's plain average of per-rank means (a rank without samples: a mean over nothing, NaN)."""
    return [(p, 1 / (world * len(p)) if p else math.nan) for p in parts]


def exact_plans(g, world) -> dict:
    """The right plan (``"right"``) and the known wrong ones, by the words that name them."""
    def contiguous(b):
        q, r = divmod(len(b), world)
        bounds = [k * q + min(k, r) for k in range(world + 1)]
        return [b[bounds[k]:bounds[k + 1]] for k in range(world)]

    def sampler(per_rank):
        def plan(order):
            padded = (order * world)[:-(-len(order) // world) * world]
            shards = [padded[r::world] for r in range(world)]
            return [_means_of([s[i:i + per_rank] for s in shards], world) for i in range(0, len(shards[0]), per_rank)]
        return plan

    def borrowed(b):  # the ranks past the step's end each train on the step's first sample too
        return [(b, 1 / len(b))] + ([(b[:1], (world - len(b)) / len(b))] if len(b) < world else [])

    return {
        "right": lambda o: [[(b, 1 / len(b))] for b in _batches(o, g)],
        "your weights match training in which a rank without samples in a step trains on a sample it only read "
        "(one of the step's): a rank may read samples, but it trains on its own only":
            lambda o: [borrowed(b) for b in _batches(o, g)],
        "your weights match DDP's plain average of the ranks' mean losses: the rank with fewer samples weighs as "
        "much as the others, so its samples count more than theirs; every sample of the global batch must weigh "
        "the same": lambda o: [_means_of([b[r::world] for r in range(world)], world) for b in _batches(o, g)],
        "your weights match DDP's plain average of the ranks' mean losses (ranks taking contiguous parts): a rank "
        "with fewer samples weighs as much as the others; every sample of the global batch must weigh the same":
            lambda o: [_means_of(contiguous(b), world) for b in _batches(o, g)],
        "your weights match training that drops the last, smaller batch of each epoch: one process trains on it "
        "too": lambda o: [[(b, 1 / len(b))] for b in _batches(o, g, last=False)],
        "your weights match training whose last batch is padded to the full global batch with samples from the "
        "start of the order: one process trains on the smaller batch as it is, each sample once":
            lambda o: [[(b + o[:g - len(b)], 1 / g)] for b in _batches(o, g)],
        f"your weights match DistributedSampler's shards with {g // world} samples per rank per step: the sampler "
        "pads the shards to equal lengths and its batches are not the global batches of one process":
            sampler(max(1, g // world)),
        f"your weights match DistributedSampler's shards with {-(-g // world)} samples per rank per step: the "
        "sampler pads the shards to equal lengths and its batches are not the global batches of one process":
            sampler(-(-g // world)),
    }


def reference_exact(n, g, epochs, lr) -> dict:
    """One process training with global batches of ``g`` (the last smaller one too), mean cross-entropy."""
    return _exact_steps(n, epochs, lr, exact_plans(g, 1)["right"])


def exact_diagnosis(state, scenario, world, lr) -> str:
    """The known wrong training the weights match, if one does."""
    n, g, epochs, _ = scenario
    if any(not torch.isfinite(v).all() for v in state.values()):
        return ("your weights are NaN: a rank without samples in a step took a mean over no samples (0 / 0); "
                "such a rank still takes part in the step, and its samples, none, add nothing")
    plans = {k: v for k, v in exact_plans(g, world).items() if k != "right"}
    for message, plan in plans.items():
        if baseline.max_diff(state, _exact_steps(n, epochs, lr, plan)) < 1e-5:
            return message
    right = exact_plans(g, 1)["right"]
    for factor, message in ((1 / world, f"your weights match lr / {world}: the loss was divided by the global "
                             "batch and DDP's average over the ranks divided the gradient again"),
                            (world, f"your weights match lr x {world}: the gradient is {world} times the mean over "
                             "the global batch")):
        if baseline.max_diff(state, _exact_steps(n, epochs, lr * factor, right)) < 1e-5:
            return message
    return ("every optimizer step must apply the mean gradient over the next global_batch samples of the epoch's "
            "permutation (torch.randperm with a generator seeded with the epoch), each sample once, the last "
            "smaller batch included")

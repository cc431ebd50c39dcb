"""Checks of lesson 04 (DDP): shard_indices, ddp_train, download_once, global_mean.

The reference is always the real thing: ``DistributedSampler`` itself for
shard_indices, single-process training with the global batch for ddp_train.
ddp_train, download_once and global_mean run in real ranks; the evidence they
leave (which samples each rank read, in which order; which rank called the
download, and what it found on return) is what the cases judge. What runs in
the ranks is :mod:`.probes04`; this module judges, in the kernel.
"""
from __future__ import annotations

import os
import shutil
import tempfile

from mgpu_lab import ddp, sampler_view
from ._core import exercise
from .probes04 import check_data, check_model, run_ddp_train, run_download_once, run_global_mean, shard_all


# -- shard_indices -----------------------------------------------------------------------
def _shard_case(t, results, combos, hint):
    for combo, got in zip(combos, results):
        n, rank, world, shuffle, seed, epoch, drop_last = combo
        expected = sampler_view.sampler_indices(n, rank, world, shuffle, seed, epoch, drop_last)
        if got[0] != "ok" or got[1] != expected:
            call = (f"shard_indices(n={n}, rank={rank}, world_size={world}, shuffle={shuffle}, seed={seed}, "
                    f"epoch={epoch}, drop_last={drop_last})")
            t.fail(f"{call}: {hint}", expected, got[1] if got[0] == "ok" else f"raised {got[1]}: {got[2]}")


def _every(n, world, **kw):
    return [(n, r, world, kw.get("shuffle", False), kw.get("seed", 0), kw.get("epoch", 0),
             kw.get("drop_last", False)) for r in range(world)]


@exercise("04.shard_indices", points=5, description="shard_indices(n, rank, world_size, shuffle, seed, epoch, "
          "drop_last): exactly the indices DistributedSampler yields to that rank")
def _shard_indices(t, shard_indices):
    shuffled = [c for e in (0, 1, 2) for c in _every(12, 3, shuffle=True, seed=5, epoch=e)]
    sweep = [(n, r, w, s, seed, e, d) for n in range(1, 14) for w in range(1, 6) for r in range(w)
             for s in (False, True) for d in (False, True) for seed, e in ((0, 0), (7, 3))]
    groups = [
        ("no shuffle, 12 samples on 3 ranks: rank r takes r, r+3, r+6, ...", _every(12, 3), False,
         "rank r takes indices[r::world_size] (interleaved, not a contiguous block)"),
        ("no shuffle, 10 samples on 4 ranks: padded to 12 by repeating the first indices", _every(10, 4), False,
         "without drop_last every rank gets ceil(n / world_size) samples: pad the list with its own first "
         "indices (indices += indices[:total - n]) before taking every world_size-th"),
        ("drop_last=True, 10 samples on 4 ranks: the last 2 are dropped", _every(10, 4, drop_last=True), False,
         "with drop_last keep only the first (n // world_size) * world_size indices, then stride"),
        ("shuffle=True, seed=5, epochs 0-2: the order comes from a generator seeded with seed + epoch", shuffled,
         False, "shuffle with g = torch.Generator(); g.manual_seed(seed + epoch); "
                "torch.randperm(n, generator=g).tolist(): not the global RNG, not random.shuffle, not seed alone"),
        ("every combination of n 1-13, world_size 1-5, shuffle, drop_last, seed, epoch (n < world_size too)",
         sweep, True, "when n < world_size the padding repeats the whole list several times"),
    ]
    combos = [c for _, group, _, _ in groups for c in group]
    results, start = None, 0
    for name, group, hidden, hint in groups:
        with t.case(name, hidden=hidden, hint=hint):
            if results is None:
                results = t.call(shard_all, shard_indices, combos)
            _shard_case(t, results[start:start + len(group)], group, hint)
        start += len(group)


# -- ddp_train ---------------------------------------------------------------------------
def _diagnose(state, n, world, epochs, batch_size, lr) -> str:
    """Name the likely bug: the variant of the reference that the learner's weights match, if any."""
    ds, big = check_data(n), batch_size * world
    guesses = [
        (big, lr / world, True, f"your weights match lr / world_size = {lr / world:g}: use lr as given"),
        (big, lr * world, True, f"your weights match lr * world_size = {lr * world:g}: use lr as given"),
        (big, lr, False, "your weights match training without sampler.set_epoch(epoch)"),
        (batch_size, lr, True, "your weights match a global batch of batch_size: batch_size is per rank, "
                               "pass it to the DataLoader unchanged"),
    ]
    for global_batch, rate, set_epoch, message in guesses:
        ref = ddp.reference_train(check_model, ds, epochs, global_batch, rate, set_epoch=set_epoch)
        if ddp.max_diff(state, ref) < 1e-5:
            return message
    return ("train like the reference: model_fn() wrapped in DDP, DataLoader(dataset, batch_size, "
            "sampler=DistributedSampler(dataset)), sampler.set_epoch(epoch), plain SGD(lr) without momentum, "
            "mean CrossEntropyLoss, zero_grad/backward/step once per batch")


def _judge_shards(t, results, n, world, epochs):
    per_epoch = n // world
    for r, res in enumerate(results):
        if len(res["seen"]) == epochs * n:
            t.fail("every rank read the whole data set: DataLoader(shuffle=True) shuffles but does not "
                   "split; pass sampler=DistributedSampler(dataset)", f"{epochs * per_epoch} reads on rank {r}",
                   f"{epochs * n} reads")
        if len(res["seen"]) != epochs * per_epoch:
            t.fail("train on the dataset passed in, through a DataLoader with a DistributedSampler",
                   f"{epochs * per_epoch} samples read by rank {r} ({epochs} epochs)", f"{len(res['seen'])}")
    for e in range(epochs):
        chunks = [set(res["seen"][e * per_epoch:(e + 1) * per_epoch]) for res in results]
        if set().union(*chunks) != set(range(n)) or sum(map(len, chunks)) != n:
            t.fail("the ranks' samples overlap or miss some: each rank needs its own shard",
                   f"epoch {e}: disjoint shards covering 0..{n - 1}", [sorted(c) for c in chunks])


def _judge_order(t, results, epochs):
    for r, res in enumerate(results):
        size = len(res["seen"]) // epochs
        orders = [res["seen"][e * size:(e + 1) * size] for e in range(epochs)]
        if size and orders[0] == orders[1]:
            t.fail("call sampler.set_epoch(epoch) at the start of every epoch: without it the sampler "
                   "shuffles the same way each epoch", "a new order in epoch 1",
                   f"rank {r}: the same order {orders[0]} twice")


def _states(t, results):
    bad = [res["type"] for res in results if res["state"] is None]
    if bad:
        t.fail("return model.state_dict() (of the module inside DDP: ddp_model.module.state_dict())",
               "dict[str, Tensor]", bad[0])
    return [res["state"] for res in results]


def _judge_weights(t, states, n, world, epochs, batch_size, lr):
    ref = ddp.reference_train(check_model, check_data(n), epochs, batch_size * world, lr)
    worst = ddp.max_diff(states[0], ref)
    if worst > 1e-5:
        t.fail(_diagnose(states[0], n, world, epochs, batch_size, lr), "max difference <= 1e-05",
               f"max difference {worst:.3g}")


def _run_ddp(t, ddp_train, world, n, epochs, batch_size, lr):
    log_dir = t.local(tempfile.mkdtemp, None, "mgpu-lab-04-")  # t.local: where the ranks run (a grader's sandbox)
    try:
        return t.ranks(run_ddp_train, world, ddp_train, n, epochs, batch_size, lr, log_dir, timeout=90)
    finally:
        if not t.grading:  # a grader deletes the whole sandbox
            shutil.rmtree(log_dir, ignore_errors=True)


@exercise("04.ddp_train", points=5, description="ddp_train(model_fn, dataset, epochs, batch_size, lr): DDP with a "
          "DistributedSampler and set_epoch; ends with the weights of single-process training")
def _ddp_train(t, ddp_train):
    n, world, epochs, batch, lr = 24, 2, 3, 4, 0.3
    results = states = None
    with t.case(f"{world} ranks: every rank reads its own half of the data each epoch (a DistributedSampler, "
                "not shuffle=True)", hint="ddp_train runs inside each rank with the process group initialised: "
                                          "don't call init_process_group or destroy_process_group"):
        results = _run_ddp(t, ddp_train, world, n, epochs, batch, lr)
        _judge_shards(t, results, n, world, epochs)
    with t.case("the data order changes from epoch to epoch"):
        if results is None:
            t.fail("the first case did not finish")
        _judge_order(t, results, epochs)
    with t.case("every rank ends with the same weights",
                hint="wrap the model in DistributedDataParallel so that the gradients are averaged"):
        if results is None:
            t.fail("the first case did not finish")
        states = _states(t, results)
        worst = max(ddp.max_diff(states[0], s) for s in states[1:])
        if worst > 1e-6:
            t.fail("", "identical weights", f"ranks differ by up to {worst:.3g}")
    with t.case(f"{world} ranks x batch {batch} end with the weights of 1 process with global batch "
                f"{world * batch} and lr {lr:g} (to 1e-5)"):
        if states is None:
            t.fail("the previous cases did not finish")
        _judge_weights(t, states, n, world, epochs, batch, lr)
    with t.case("3 ranks x batch 5, 36 samples (a smaller last batch): the single-process weights", hidden=True):
        if states is None:
            t.fail("the previous cases did not finish")
        n, world, epochs, batch, lr = 36, 3, 2, 5, 0.2
        states = _states(t, _run_ddp(t, ddp_train, world, n, epochs, batch, lr))
        _judge_weights(t, states, n, world, epochs, batch, lr)


# -- download_once -----------------------------------------------------------------------
def _log_counts(roots, name, round_):
    counts = []
    for root in roots:
        path = os.path.join(root, name)
        lines = open(path).read().split() if os.path.exists(path) else []
        counts.append(sum(1 for k in lines[0::2] if k == str(round_)))
    return counts


def _judge_paths(t, results, roots, round_):
    for r, res in enumerate(results):
        got = res["rounds"][round_]
        expected = os.path.join(roots[res["node"]], "data.bin")
        if got["path"] != expected:
            other = [i for i, root in enumerate(roots) if got["path"].startswith(root) and i != res["node"]]
            hint = (f"rank {r} on node {res['node']} got node {other[0]}'s path: take the path from local rank 0 "
                    "of your own node (e.g. gather every rank's answer with dist.all_gather_object and pick "
                    "global rank rank - local_rank)") if other else "every rank must return the path fn returned"
            t.fail(hint, expected, got["path"])
        if not got["complete"]:
            t.fail(f"rank {r} returned before the file was complete: make the other ranks wait at "
                   "dist.barrier() until local rank 0's fn has returned", "the complete file", "half a file")


@exercise("04.download_once", points=4, description="download_once(fn): one rank per node calls fn(root), every "
          "rank returns the path once the file is complete, a second call downloads nothing")
def _download_once(t, download_once):
    roots = [t.local(tempfile.mkdtemp, None, f"mgpu-lab-04-node{i}-") for i in range(2)]
    try:
        results = None
        with t.case("2 nodes x 2 ranks: exactly one rank per node calls fn",
                    hint="call fn only where mgpu_lab.dist.local_rank() == 0; the other ranks wait at a barrier"):
            results = t.ranks(run_download_once, 4, download_once, roots, 2, timeout=45)
            calls = t.local(_log_counts, roots, "calls.log", 0)
            if calls != [1, 1]:
                hint = ("every rank called fn: only local rank 0 should" if min(calls) > 1 else
                        "a node did not download: use the local rank (LOCAL_RANK), not the global rank; every "
                        "node has its own disk" if 0 in calls else "")
                t.fail(hint, "calls per node [1, 1]", f"calls per node {calls}")
        with t.case("every rank returns its node's path, only once the file is complete"):
            if results is None:
                t.fail("the first case did not finish")
            _judge_paths(t, results, roots, 0)
        with t.case("a second call downloads nothing and again returns the complete file",
                    hint="the second call must go through the same steps: local rank 0 calls fn, which finds "
                         "the file; the others wait and return the path"):
            if results is None:
                t.fail("the first case did not finish")
            calls = t.local(_log_counts, roots, "calls.log", 1)
            downloads = t.local(_log_counts, roots, "downloads.log", 1)
            if max(calls) > 1 or any(downloads):
                t.fail("", "at most 1 call and 0 downloads per node", f"calls {calls}, downloads {downloads}")
            _judge_paths(t, results, roots, 1)
        with t.case("1 node x 3 ranks: one call, every rank gets the complete file", hidden=True):
            root = [t.local(tempfile.mkdtemp, None, "mgpu-lab-04-one-")]
            roots.append(root[0])
            results = t.ranks(run_download_once, 3, download_once, root, 3, 1, timeout=45)
            if t.local(_log_counts, root, "calls.log", 0) != [1]:
                t.fail("one call per node")
            _judge_paths(t, results, root, 0)
    finally:
        for root in roots if not t.grading else ():
            shutil.rmtree(root, ignore_errors=True)


# -- global_mean -------------------------------------------------------------------------
@exercise("04.global_mean", points=4, description="global_mean(local_sum, local_count): the mean over every "
          "rank's samples, counts differing per rank, via all_reduce")
def _global_mean(t, global_mean):
    hint = ("all_reduce the sum and the count (e.g. one tensor [sum, count] with op SUM), then divide: "
            "averaging the ranks' means weighs a rank with 1 sample like a rank with 8")
    cases = [("2 ranks with 4 samples each", [10.0, 2.0], [4, 4], False),
             ("3 ranks with 1, 3 and 8 samples: every sample counts the same, not every rank",
              [9.0, 3.0, 4.0], [1, 3, 8], False),
             ("a rank with no samples (count 0)", [0.0, 5.0], [0, 2], True)]
    typed = None
    for name, sums, counts, hidden in cases:
        with t.case(name, hidden=hidden, hint=hint):
            got = t.ranks(run_global_mean, len(sums), global_mean, sums, counts, timeout=30)
            if len(sums) == 3:
                typed = got
            t.close(got[0][0], sum(sums) / sum(counts), atol=1e-6)
        if len(sums) == 3:
            with t.case("returns the same Python float on every rank",
                        hint="return mean.item() (a float), computed from the all-reduced totals on every rank"):
                if typed is None:
                    t.fail("the previous case did not finish")
                values = {v for v, _ in typed}
                kinds = {k for _, k in typed}
                if kinds != {"float"}:
                    t.fail("", "float", ", ".join(sorted(kinds)))
                if len(values) != 1:
                    t.fail("", "one value", sorted(values))

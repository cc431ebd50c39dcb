"""Checks of lesson 04 (DDP): shard_indices, ddp_train, download_once, global_mean.

The reference is always the real thing: ``DistributedSampler`` itself for
shard_indices, single-process training with the global batch for ddp_train.
ddp_train, download_once and global_mean run in real ranks, each in one launch;
the evidence they leave (which samples each rank read, in which order; where
the model and every batch were moved; which rank called the download, and what
it found on return; every rank's mean) is what the cases judge. What runs in
the ranks is :mod:`.ranks`; this module judges, in the kernel.
"""
from __future__ import annotations

import math

from .._core import exercise
from ..sim.scenarios import launch_scenarios
from .judges import (download_callers, every_rank, judge_complete, judge_paths, log_counts, mean_diagnosis, shard_case,
                     judge_batches, judge_model_device, judge_order, judge_same_weights, judge_shards, judge_weights)
from .ranks import run_ddp_train, run_download_once, run_global_mean, shard_all


DOWNLOAD_TIMEOUT = 45.0  # seconds for the download_once launch; a right answer takes about one


GLOBAL_MEAN_TIMEOUT = 30.0


@exercise("04.shard_indices", points=6, description="shard_indices(n, rank, world_size, shuffle, seed, epoch, "
          "drop_last): exactly the indices DistributedSampler yields to that rank")
def _shard_indices(t, shard_indices):
    """Compares with DistributedSampler itself, all combinations in one fresh process.

    Catches: contiguous blocks instead of every world_size-th index, no padding,
    padding that repeats the list only once (n < world_size) or from its end,
    drop_last ignored or cutting too much, a seed without the epoch, the global
    RNG or no shuffle at all.
    """
    shuffled = [c for e in (0, 1, 2) for c in every_rank(12, 3, shuffle=True, seed=5, epoch=e)]
    sweep = [(n, r, w, s, seed, e, d) for n in range(1, 14) for w in range(1, 6) for r in range(w)
             for s in (False, True) for d in (False, True) for seed, e in ((0, 0), (7, 3))]
    groups = [
        ("no shuffle, 12 samples on 3 ranks: rank r takes r, r+3, r+6, ...", every_rank(12, 3), False,
         "rank r takes indices[r::world_size] (interleaved, not a contiguous block)"),
        ("no shuffle, 10 samples on 4 ranks: padded to 12 by repeating the first indices", every_rank(10, 4), False,
         "without drop_last every rank gets ceil(n / world_size) samples: pad the list with its own first "
         "indices (indices += indices[:total - n]) before taking every world_size-th"),
        ("fewer samples than ranks (1 on 3, 2 on 5): the list is repeated until every rank has one",
         every_rank(1, 3) + every_rank(2, 5, shuffle=True, seed=1), False,
         "when n < world_size the padding must repeat the whole list several times, not once"),
        ("drop_last=True, 10 samples on 4 ranks: the last 2 are dropped", every_rank(10, 4, drop_last=True), False,
         "with drop_last keep only the first (n // world_size) * world_size indices, then stride; never pad"),
        ("shuffle=True, seed=5, epochs 0-2: the order comes from a generator seeded with seed + epoch", shuffled,
         False, "shuffle with g = torch.Generator(); g.manual_seed(seed + epoch); "
                "torch.randperm(n, generator=g).tolist(): not the global RNG, not random.shuffle, not seed alone"),
        ("every combination of n 1-13, world_size 1-5, shuffle, drop_last, seed, epoch", sweep, True,
         "compare your lists with DistributedSampler's for small n and world sizes"),
    ]
    combos = [c for _, group, _, _ in groups for c in group]
    results, start = None, 0
    for name, group, hidden, hint in groups:
        with t.case(name, hidden=hidden, hint=hint):
            if results is None:
                results = t.call(shard_all, shard_indices, combos)
            shard_case(t, results[start:start + len(group)], group, hint)
        start += len(group)


# -- ddp_train ---------------------------------------------------------------------------
DDP_SETUP = dict(n=40, world=4, per_node=2, epochs=2, batch=4, lr=0.3)


@exercise("04.ddp_train", points=6, description="ddp_train(model_fn, dataset, epochs, batch_size, lr): DDP on the "
          "rank's own GPU with a DistributedSampler and set_epoch; ends with the weights of single-process training")
def _ddp_train(t, ddp_train):
    """One launch of 4 ranks as 2 simulated nodes x 2 virtual GPUs (``sim.cuda``, ``sim.parallel.virtual_ddp``).

    Catches: no DistributedSampler (DataLoader shuffle=True: every rank reads
    everything), set_epoch missing, shuffle=False, the model or the inputs or
    the labels never moved to the rank's GPU, every rank on cuda:0 ("cuda"),
    the global rank used as GPU index (wrong on the second node), a hard-coded
    "cpu", wrong DDP device_ids, no DDP (ranks drift apart), the lr scaled by
    the world size, batch_size taken as the global batch, no zero_grad,
    momentum. The diagnosis names the wrong variant the weights match.
    """
    s = DDP_SETUP
    results = None
    with t.case(f"{s['world']} ranks: every rank reads its own quarter of the data each epoch (a "
                "DistributedSampler, not shuffle=True)", hint="ddp_train runs inside each rank with the process "
                "group initialised: don't call init_process_group or destroy_process_group"):
        log_dir = t.scratch("mgpu-lab-04-")  # where the ranks run (a grader's sandbox)
        results = t.ranks(run_ddp_train, s["world"], ddp_train, s["n"], s["epochs"], s["batch"], s["lr"],
                          log_dir, s["per_node"], timeout=90)
        judge_shards(t, results, s["n"], s["world"], s["epochs"])
    cases = [
        ("the data order changes from epoch to epoch (sampler.set_epoch)", judge_order, ""),
        ("2 nodes x 2 GPUs (virtual): each rank's model goes to its own GPU, cuda:LOCAL_RANK, and DDP gets "
         "that device or none", judge_model_device, ""),
        ("every batch's inputs and labels go to the rank's GPU before the forward pass", judge_batches, ""),
        ("every rank ends with the same weights", judge_same_weights,
         "wrap the model in DistributedDataParallel so that the gradients are averaged"),
        (f"the weights of 1 process with global batch {s['world'] * s['batch']} and lr {s['lr']:g} (to 1e-5)",
         judge_weights, ""),
    ]
    for name, judge, hint in cases:
        with t.case(name, hint=hint):
            if results is None:
                t.fail("not judged: the first case did not finish")
            judge(t, results, s)


@exercise("04.download_once", points=4, description="download_once(fn): one rank per node calls fn(root), every "
          "rank returns the path once the file is complete, a second call downloads nothing")
def _download_once(t, download_once):
    """One launch of 6 ranks as 2 simulated nodes x 3, each node with its own directory, two calls.

    Catches: every rank downloading, global rank 0 only (node 1 never gets the
    file), a hard-coded ranks-per-node (``rank % 2``), other ranks calling fn
    again after the barrier, no barrier (a rank reads half a file), a path
    only on local rank 0 or node 0's path everywhere, a barrier not every rank
    reaches (a hang).
    """
    roots = [t.scratch(f"mgpu-lab-04-node{i}-") for i in range(2)]
    results = None
    with t.case("2 nodes x 3 ranks: fn is called once per node, on local rank 0 (global ranks 0 and 3)",
                hint="call fn only where mgpu_lab.dist.local_rank() == 0; the other ranks wait at a barrier"):
        results = t.ranks(run_download_once, 6, download_once, roots, 3, timeout=DOWNLOAD_TIMEOUT)
        callers = t.local(download_callers, roots, 0)  # the learner's files are read where they were written
        if callers != [[0], [3]]:
            calls = [len(c) for c in callers]
            hint = ("every rank called fn: only local rank 0 should, the others wait and then use its path"
                    if min(calls) > 1 else
                    "a node did not download: use the local rank (LOCAL_RANK), not the global rank; every "
                    "node has its own disk" if 0 in calls else
                    "fn ran on a rank that is not its node's local rank 0: read the local rank with "
                    "mgpu_lab.dist.local_rank(), don't compute it from the global rank")
            t.fail(hint, "fn called by ranks [[0], [3]] (per node)", f"by ranks {callers}")
    for name, judge in (("every rank returns its own node's path", judge_paths),
                        ("no rank returns before its node's file is complete", judge_complete)):
        with t.case(name):
            if results is None:
                t.fail("not judged: the first case did not finish")
            judge(t, results, roots, 0) if judge is judge_paths else judge(t, results, 0)
    with t.case("a second call downloads nothing and again returns the complete file",
                hint="the second call must go through the same steps: local rank 0 calls fn, which finds "
                     "the file; the others wait and return the path"):
        if results is None:
            t.fail("not judged: the first case did not finish")
        calls = t.local(log_counts, roots, "calls.log", 1)
        downloads = t.local(log_counts, roots, "downloads.log", 1)
        if max(calls) > 1 or any(downloads):
            t.fail("", "at most 1 call and 0 downloads per node", f"calls {calls}, downloads {downloads}")
        judge_paths(t, results, roots, 1)
        judge_complete(t, results, 1)


GLOBAL_MEAN_SCENARIOS = [  # 3 ranks: sums, counts
    ([10.0, 2.0, 6.0], [4, 4, 4]), ([9.0, 3.0, 4.0], [1, 3, 8]), ([0.0, 5.0, 1.0], [0, 2, 5])]


@exercise("04.global_mean", points=4, description="global_mean(local_sum, local_count): the mean over every "
          "rank's samples, counts differing per rank, via all_reduce")
def _global_mean(t, global_mean):
    """One launch of 3 ranks running every scenario; every rank's value is judged.

    Catches: the mean of the ranks' means, the sum all-reduced but not the count,
    reduce to rank 0 instead of all_reduce, op MAX, no division, a division by
    zero on a rank without samples, a tensor returned instead of a float.
    Placement is not judged: the check runs gloo, on the CPU.
    """
    names = ["3 ranks with 4 samples each: the same mean on every rank",
             "3 ranks with 1, 3 and 8 samples: every sample counts the same, not every rank",
             "a rank with no samples (count 0)"]
    evidence = launch_scenarios(t, run_global_mean, 3, global_mean, GLOBAL_MEAN_SCENARIOS,
                                timeout=GLOBAL_MEAN_TIMEOUT)
    for k, ((sums, counts), name) in enumerate(zip(GLOBAL_MEAN_SCENARIOS, names)):
        with t.case(name, hidden=k == 2):
            values = [v for v, _ in evidence.get(t, k)]
            expected = sum(sums) / sum(counts)
            if not all(isinstance(v, (int, float)) and math.isclose(v, expected, rel_tol=1e-6) for v in values):
                t.fail(mean_diagnosis(values, sums, counts), f"{expected:g} on every rank", values)
        if k == 1:
            with t.case("returns the same Python float on every rank",
                        hint="return mean.item() (a float), computed from the all-reduced totals on every rank"):
                kinds = {kind for _, kind in evidence.get(t, 1)}
                if kinds != {"float"}:
                    t.fail("", "float", ", ".join(sorted(kinds)))

"""Checks of lesson 04 (DDP): shard_indices, ddp_train, download_once, global_mean, train_exact.

The yardstick is always the real thing: ``DistributedSampler`` itself for
shard_indices, single-process training with the global batch for ddp_train
(with and without gradient accumulation). ddp_train, download_once and
global_mean run in real ranks, each in one launch; the evidence they leave
(which samples each rank read, in which order; where the model and every batch
were moved; how many gradient all-reduces and backward passes each rank ran;
which rank called the download, and what it found on return; every rank's mean)
is what the cases judge. Every exercise names its references (torch's
``DistributedSampler``, the library's ``mgpu_lab.parallel.ddp`` training and
evaluation, ``mgpu_lab.data.per_node.run_once``): an answer that calls one
fails. What runs in
the ranks is :mod:`.ranks`; this module judges, in the kernel.
"""
from __future__ import annotations

import math

from mgpu_lab.parallel import baseline
from .._core import exercise
from ..sim.scenarios import launch_scenarios
from .judges import (download_callers, every_rank, exact_diagnosis, judge_accumulated, judge_backwards, judge_batches,
                     judge_complete,
                     judge_model_device, judge_order, judge_paths, judge_same_weights, judge_shards, judge_syncs,
                     judge_weights, log_counts, mean_diagnosis, reference_exact, shard_case)
from .ranks import (EXACT_LR, exact_backwards, exact_model, probe_exact, run_ddp_train, run_download_once,
                    run_global_mean, shard_all)


DOWNLOAD_TIMEOUT = 45.0  # seconds for the download_once launch; a right answer takes about one


GLOBAL_MEAN_TIMEOUT = 30.0


@exercise("04.shard_indices", points=6, description="shard_indices(n, rank, world_size, shuffle, seed, epoch, "
          "drop_last): exactly the indices DistributedSampler yields to that rank",
          references=("torch.utils.data.distributed:DistributedSampler",
                      "torch.utils.data.distributed:DistributedSampler.__iter__"))
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
         "your ranks' lists are not the sampler's: it deals the indices out to the ranks in turn"),
        ("no shuffle, 10 samples on 4 ranks: padded to 12 by repeating the first indices", every_rank(10, 4), False,
         "without drop_last every rank gets the same number of samples, ceil(n / world_size): the sampler makes "
         "up the shortfall with its own first indices"),
        ("fewer samples than ranks (1 on 3, 2 on 5): the list is repeated until every rank has one",
         every_rank(1, 3) + every_rank(2, 5, shuffle=True, seed=1), False,
         "with fewer samples than ranks one copy of the list is not enough padding: it is repeated as often as "
         "needed"),
        ("drop_last=True, 10 samples on 4 ranks: the last 2 are dropped", every_rank(10, 4, drop_last=True), False,
         "with drop_last every rank gets n // world_size samples: the tail that does not divide is left out, "
         "nothing is padded"),
        ("shuffle=True, seed=5, epochs 0-2: the order comes from a generator seeded with seed + epoch", shuffled,
         False, "your shuffled order is not the sampler's: it is the permutation torch.randperm draws from a "
                "generator of its own seeded with seed + epoch (never the global random state)"),
        ("every combination of n 1-13, world_size 1-5, shuffle, drop_last, seed, epoch", sweep, True,
         "some combination of small n and world sizes differs from DistributedSampler's lists"),
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
DDP_SETUP = dict(n=40, world=4, per_node=2, epochs=2, batch=4, lr=0.3, accumulate=1)
ACCUMULATE = dict(DDP_SETUP, n=48, batch=3, accumulate=2)  # 12 samples per rank: 4 micro-batches, 2 steps


@exercise("04.ddp_train", points=9, description="ddp_train(model_fn, dataset, epochs, batch_size, lr, accumulate=1): "
          "DDP on the rank's own GPU, a shard per rank and epoch, accumulate micro-batches per step with one "
          "all-reduce per step; ends with the weights of single-process training",
          references=("mgpu_lab.parallel.ddp:train", "mgpu_lab.parallel.ddp:fit", "mgpu_lab.parallel.ddp:wrap",
                      "mgpu_lab.parallel.ddp:distributed_loader"))
def _ddp_train(t, ddp_train):
    """One launch of 4 ranks as 2 simulated nodes x 2 virtual GPUs (``sim.cuda``, ``sim.parallel.virtual_ddp``),
    training twice: as given (accumulate left at its default) and with accumulate=2.

    Catches: no DistributedSampler (every rank reads everything), set_epoch missing, shuffle=False, the model
    or the inputs or the labels never moved to the rank's GPU, every rank on cuda:0 ("cuda"), the global rank as
    GPU index, a hard-coded "cpu", wrong DDP device_ids, no DDP (ranks drift apart), the lr scaled by the world
    size, batch_size taken as the global batch, no zero_grad, momentum; with accumulation: a step after every
    micro-batch, the micro-batch means summed (lr x accumulate), every micro-batch all-reduced (no no_sync),
    no all-reduce at all, one backward over summed losses. The diagnosis names the wrong variant it matches.
    """
    s, a = DDP_SETUP, ACCUMULATE
    results = None
    with t.case(f"{s['world']} ranks: every rank reads its own quarter of the data each epoch",
                hint="ddp_train runs inside each rank with the process group initialised: it neither initialises "
                     "nor destroys it"):
        log_dir = t.scratch("mgpu-lab-04-")  # where the ranks run (a grader's sandbox)
        scenarios = {name: (c["n"], c["epochs"], c["batch"], c["lr"], acc)
                     for name, c, acc in (("plain", s, None), ("accumulate", a, a["accumulate"]))}
        results = t.ranks(run_ddp_train, s["world"], ddp_train, scenarios, log_dir, s["per_node"], timeout=90)
        judge_shards(t, [r["plain"] for r in results], s["n"], s["world"], s["epochs"])
    global_batch = a["world"] * a["batch"] * a["accumulate"]
    cases = [
        ("the data order changes from epoch to epoch", judge_order, "plain", s, ""),
        ("2 nodes x 2 GPUs (virtual): each rank's model goes to its own GPU, cuda:LOCAL_RANK, and DDP gets "
         "that device or none", judge_model_device, "plain", s, ""),
        ("every batch's inputs and labels go to the rank's GPU before the forward pass", judge_batches, "plain", s, ""),
        ("every rank ends with the same weights", judge_same_weights, "plain", s,
         "your ranks ended with different weights: their gradients were never averaged across the ranks"),
        (f"the weights of 1 process with global batch {s['world'] * s['batch']} and lr {s['lr']:g} (to 1e-5)",
         judge_weights, "plain", s, ""),
        (f"accumulate={a['accumulate']}, micro-batches of {a['batch']}: the weights of 1 process with global batch "
         f"{global_batch} (to 1e-5), the same on every rank", judge_accumulated, "accumulate", a, ""),
        (f"accumulate={a['accumulate']}: one gradient all-reduce per optimizer step, not one per micro-batch",
         judge_syncs, "accumulate", a, ""),
        (f"accumulate={a['accumulate']}: one backward pass per micro-batch (one micro-batch's activations at a "
         "time)", judge_backwards, "accumulate", a, ""),
    ]
    for name, judge, scenario, setup, hint in cases:
        with t.case(name, hint=hint):
            if results is None:
                t.fail("not judged: the first case did not finish")
            judge(t, [r[scenario] for r in results], setup)


@exercise("04.download_once", points=4, description="download_once(fn): one rank per node calls fn(root), every "
          "rank returns the path once the file is complete, a second call downloads nothing",
          references=("mgpu_lab.data.per_node:run_once",))
def _download_once(t, download_once):
    """One launch of 6 ranks as 2 simulated nodes x 3, each node with its own directory, two calls.

    Catches: every rank downloading, global rank 0 only (node 1 never gets the
    file), a hard-coded ranks-per-node (``rank % 2``), other ranks calling fn
    again after the barrier, no barrier (a rank reads half a file), a path
    only on local rank 0 or node 0's path everywhere, a barrier not every rank
    reaches (a hang).
    """
    roots = [t.scratch(f"mgpu-lab-04-node{i}-") for i in range(2)]
    results, callers = None, ()
    with t.case("2 nodes x 3 ranks: fn is called once per node, on local rank 0 (global ranks 0 and 3)",
                hint="fn must run once per node, on the node's local rank 0, while the node's other ranks wait"):
        results = t.ranks(run_download_once, 6, download_once, roots, 3, timeout=DOWNLOAD_TIMEOUT)
        callers = t.local(download_callers, roots, 0)  # the learner's files are read where they were written
        if callers != [[0], [3]]:
            calls = [len(c) for c in callers]
            hint = ("every rank called fn: only local rank 0 should, the others wait and then use its path"
                    if min(calls) > 1 else
                    "a node did not download: use the local rank (LOCAL_RANK), not the global rank; every "
                    "node has its own disk" if 0 in calls else
                    "fn ran on a rank that is not its node's local rank 0: read the local rank with "
                    "mgpu_lab.dist.local_rank(), not something computed from the global rank")
            t.fail(hint, "fn called by ranks [[0], [3]] (per node)", f"by ranks {callers}")
    for name, judge in (("every rank returns its own node's path", judge_paths),
                        ("no rank returns before its node's file is complete", judge_complete)):
        with t.case(name):
            if results is None:
                t.fail("not judged: the first case did not finish")
            if judge is judge_paths:
                judge(t, results, roots, 0, callers)
            else:
                judge(t, results, 0, callers)
    with t.case("a second call behaves the same: fn again once per node, on local rank 0 (it finds the file "
                "complete and downloads nothing), and every rank waits for it and returns its node's path",
                hint="a second call must behave like the first: one call of fn per node (which finds the file "
                     "complete and downloads nothing), the node's other ranks waiting for it, every rank returning "
                     "the path"):
        if results is None:
            t.fail("not judged: the first case did not finish")
        again = t.local(download_callers, roots, 1)
        downloads = t.local(log_counts, roots, "downloads.log", 1)
        if again != [[0], [3]] or any(downloads):
            t.fail("" if again != [[], []] else "your second call did not call fn at all: only fn knows whether "
                   "the file on disk is still complete (another job may have removed or changed it); call it "
                   "again on each node's local rank 0, and it downloads nothing when it needs not",
                   "fn called by ranks [[0], [3]], 0 downloads", f"fn called by ranks {again}, downloads {downloads}")
        judge_paths(t, results, roots, 1, again)
        early = [r for r, res in enumerate(results) if not res["rounds"][1]["waited"]]
        if early:
            t.fail(f"ranks {early} returned from the second call before their node's fn did: a rank that does not "
                   "wait for it the second time reads a file that fn may still be replacing",
                   "every rank returning after its node's fn", f"ranks {early} returned first")


GLOBAL_MEAN_SCENARIOS = [  # 3 ranks: sums, counts
    ([10.0, 2.0, 6.0], [4, 4, 4]), ([9.0, 3.0, 4.0], [1, 3, 8]),
    ([16777217.0, 33554433.0, 1.0], [1, 2, 3]),  # above 2**24: a float32 keeps no units there
    ([0.0, 5.0, 1.0], [0, 2, 5])]  # last: a rank without samples (an answer that fails there fails it alone)
NCCL_HINT = ("with NCCL a collective's tensors must be on the rank's own GPU (mgpu_lab.dist.device()): NCCL refuses "
             "a tensor on the CPU, and gloo's CPU path hides that")


def _mean_values(t, evidence, k, rel_tol, near_hint=""):
    """Fail the case unless every rank returned the mean of scenario ``k`` to ``rel_tol``; values right to
    1e-6 only get ``near_hint``, others the diagnosis of the wrong formula they match."""
    sums, counts = GLOBAL_MEAN_SCENARIOS[k]
    values = [v for v, *_ in evidence.get(t, k)]
    expected = sum(sums) / sum(counts)

    def within(tol):
        return all(isinstance(v, (int, float)) and math.isclose(v, expected, rel_tol=tol) for v in values)
    if not within(rel_tol):
        hint = near_hint if near_hint and within(1e-6) else mean_diagnosis(values, sums, counts)
        t.fail(hint, f"{expected:.10g} on every rank", values)


def _judge_nccl(t, evidence):
    """Fail unless some collective ran and every tensor handed to one was on its rank's (simulated) GPU."""
    calls = [(r, op, on) for k in range(len(GLOBAL_MEAN_SCENARIOS) - 1)
             for r, (_, _, rank_calls) in enumerate(evidence.get(t, k)) for op, on in rank_calls]
    if not calls:
        t.fail("not judged: your ranks called no collective, so nothing crossed between them (see the cases "
               "above)", "a collective on every rank", "none")
    wrong = [(r, op, on) for r, op, on in calls if on is not None and on != f"cuda:{r}"]
    if wrong:
        r, op, on = wrong[0]
        t.fail(NCCL_HINT, f"rank {r}'s {op} given a tensor on cuda:{r}", f"rank {r}'s {op} given a tensor on {on}")


@exercise("04.global_mean", points=6, description="global_mean(local_sum, local_count): the mean over every "
          "rank's samples, counts differing per rank, on every rank, exact for large sums; with NCCL the "
          "collective's tensors on the rank's GPU",
          references=("mgpu_lab.parallel.ddp:mean_over_ranks", "mgpu_lab.parallel.ddp:evaluate"))
def _global_mean(t, global_mean):
    """One launch of 3 ranks running every scenario as NCCL ranks on simulated GPUs (gloo underneath); every
    rank's value and every collective's tensor device are judged.

    Catches: the mean of the ranks' means, the sum all-reduced but not the count,
    reduce to rank 0 instead of all_reduce, op MAX, no division, a division by
    zero on a rank without samples, a tensor returned instead of a float, the
    collective's tensor left on the CPU (NCCL refuses it), sums in float32.
    """
    evidence = launch_scenarios(t, run_global_mean, 3, global_mean, GLOBAL_MEAN_SCENARIOS,
                                timeout=GLOBAL_MEAN_TIMEOUT)
    with t.case("3 ranks with 4 samples each: the same mean on every rank"):
        _mean_values(t, evidence, 0, 1e-6)
    with t.case("3 ranks with 1, 3 and 8 samples: every sample counts the same, not every rank"):
        _mean_values(t, evidence, 1, 1e-6)
    with t.case("returns the same Python float on every rank",
                hint="your global_mean returned something else than a Python float on some rank (a tensor "
                     "keeps its device and autograd state; callers format and compare floats)"):
        got = evidence.get(t, 1)
        kinds = {kind for _, kind, _ in got}
        if kinds != {"float"}:
            t.fail("", "float", ", ".join(sorted(kinds)))
        if len({v for v, *_ in got}) > 1:
            t.fail("your ranks returned different numbers: each computed from its own samples only; the "
                   "ranks' sums and counts must cross between them (a collective) so that every rank "
                   "returns the one mean", "the same float on every rank", [v for v, *_ in got])
    with t.case("NCCL ranks (simulated GPUs cuda:0-2): every tensor handed to a collective is on the rank's own "
                "GPU", hint=NCCL_HINT):
        _judge_nccl(t, evidence)
    with t.case("sums past 2**24 (16777217 and 33554433 samples' worth): the mean exact to 1e-9"):
        _mean_values(t, evidence, 2, 1e-9, near_hint="your mean lost the units of large sums: a float32 holds "
                     "whole numbers exactly only up to 2**24 (16777216), and a long evaluation's sums pass that; "
                     "Python floats and float64 tensors keep them")
    with t.case("a rank with no samples (count 0)", hidden=True):
        _mean_values(t, evidence, 3, 1e-6)


# -- train_exact -------------------------------------------------------------------------
EXACT_TIMEOUT = 30.0  # seconds for the one launch of every scenario; a right answer takes a few
EXACT_WORLD = 3
EXACT_SCENARIOS = [(28, 8, 2, False), (24, 6, 2, False), (25, 8, 2, False),  # (n, global_batch, epochs, gpus)
                   (20, 9, 1, True)]  # last: NCCL ranks on simulated GPUs, a rank without samples in the last step
SKIP_HINT = ("a rank without samples in a step left the step out, while the others waited for it in the gradient "
             "all-reduce: every rank takes part in every step, and a rank with no samples contributes nothing to "
             "the sum")
GPU_HINT = ("on a GPU the model and its output are on the rank's GPU (mgpu_lab.dist.device()): every input the model "
            "gets and the labels the loss compares with must be there, on every rank and in every step; gloo's CPU path hides a "
            "tensor made or left on the CPU, a GPU refuses it")


def _steps(scenario) -> int:
    n, g, epochs, _ = scenario
    return -(-n // g) * epochs


def _exact_states(t, got, k):
    """Every rank's returned state_dict (the case fails unless each is one of the model's, all equal)."""
    keys = sorted(exact_model().state_dict())
    for r, res in enumerate(got):
        if res["state"] is None or sorted(res["state"]) != keys:
            t.fail("return the trained model's state_dict (of the module inside DDP, without the 'module.' prefix)",
                   f"keys {keys}", f"rank {r} returned {res.get('returned') or sorted(res['state'])}")
    worst = max(baseline.max_diff(got[0]["state"], res["state"]) for res in got[1:])
    if worst > 1e-6:
        t.fail("your ranks ended with different weights: some step's gradients did not cross the ranks", "identical "
               "weights on every rank", f"ranks differ by up to {worst:.3g}")
    return [res["state"] for res in got]


def _exact_weights(t, got, k):
    states = _exact_states(t, got, k)
    n, g, epochs, _ = scenario = EXACT_SCENARIOS[k]
    worst = baseline.max_diff(states[0], reference_exact(n, g, epochs, EXACT_LR))
    if worst > 1e-5:
        t.fail(exact_diagnosis(states[0], scenario, EXACT_WORLD, EXACT_LR), "max difference <= 1e-05",
               f"max difference {worst:.3g}")


def _exact_counts(t, got, k, counted=("allreduces", "backwards")):
    steps = _steps(EXACT_SCENARIOS[k])
    for r, res in enumerate(got):
        for what in counted:
            if res[what] != steps:
                name = {"backwards": "backward passes", "allreduces": "DDP gradient all-reduces"}[what]
                hint = ("" if res[what] else f"rank {r} ran no {name}: " + (
                    "its gradients never crossed the ranks through DDP; train the model wrapped in DDP, whose "
                    "all-reduce in backward keeps the ranks equal" if what == "allreduces" else SKIP_HINT))
                t.fail(hint or f"one per optimizer step on every rank ({steps} steps); " + SKIP_HINT,
                       f"{steps} {name} on every rank", f"rank {r}: {res[what]}")


def _exact_hang(t, evidence, k):
    """Scenario ``k``'s evidence; a hang fails the case with each rank's backward passes before it stopped."""
    from mgpu_lab.launcher.errors import LaunchTimeout

    try:
        return evidence.get(t, k)
    except LaunchTimeout as exc:
        done = t.local(exact_backwards, evidence.log_dir, k, EXACT_WORLD)
        t.fail(SKIP_HINT if len(set(done)) > 1 else "your ranks hang: " + SKIP_HINT,
               f"{_steps(EXACT_SCENARIOS[k])} backward passes on every rank, then a return",
               f"no answer within {EXACT_TIMEOUT:g} s; backward passes per rank before it: {done}")


def _exact_placement(t, got, mixes):
    inputs = [(r, *entry) for r, res in enumerate(got) for entry in res.get("inputs", [])]
    if not inputs:
        t.fail("not judged: on simulated GPUs your ranks gave the model no input", "forward passes", "none")
    if not mixes:
        wrong = [(r, tag, on, model, size) for r, tag, on, model, size in inputs if on != model]
        if wrong:
            r, tag, on, model, size = wrong[0]
            t.fail(GPU_HINT, f"rank {r}'s inputs on {model}",
                   f"rank {r} gave the model on {model} {size} sample(s) ({tag}) on {on}")
        return
    mixed = [(r, op, on) for r, res in enumerate(got) for op, on in res.get("mixes", [])]
    if mixed:
        r, op, on = mixed[0]
        t.fail(GPU_HINT + " (here: the labels)", "every operation on one device",
               f"rank {r}: {op} given tensors on {', '.join(on)}")


@exercise("04.train_exact", points=25, description="train_exact(model_fn, dataset, global_batch, epochs, lr) -> "
          "state_dict: DDP whose every step is one process's step on the next global_batch samples of the epoch's "
          "permutation, for any world size, data set length and last batch",
          references=("mgpu_lab.parallel.ddp:train", "mgpu_lab.parallel.ddp:fit", "mgpu_lab.parallel.ddp:wrap",
                      "mgpu_lab.parallel.ddp:distributed_loader"))
def _train_exact(t, train_exact):
    """One launch of 3 ranks, four scenarios: three on gloo and the CPU (weights, counts), the last as NCCL ranks on
    simulated GPUs (placement). The lesson's idea, the weights of one process whatever the batches and a rank
    without samples that still takes part, carries most of the points: half of the lesson's.

    Catches: DDP's plain average of per-rank means, the last batch dropped or padded, DistributedSampler's padded
    shards, a rank without samples that skips the step (a hang, reported after EXACT_TIMEOUT with each rank's
    backward passes), a mean over no samples (NaN), the loss divided by the global batch without undoing DDP's
    average (lr / world), no DDP, an empty input made on the CPU, labels left on the CPU.
    """
    evidence = launch_scenarios(t, probe_exact, EXACT_WORLD, train_exact, EXACT_SCENARIOS, timeout=EXACT_TIMEOUT)
    got = {}
    with t.case("3 ranks, 28 samples, global batch 8 (3, 3 and 2 samples per rank; the last batch 4), 2 epochs: "
                "every rank returns the model's state_dict, all equal"):
        got[0] = evidence.get(t, 0)
        _exact_states(t, got[0], 0)
    with t.case("... the weights of one process with batches of 8, the last of 4 included (to 1e-5)", points=6):
        _exact_weights(t, got.get(0) or evidence.get(t, 0), 0)
    with t.case("... every rank runs one backward pass and one DDP gradient all-reduce per optimizer step (8)",
                points=2):
        _exact_counts(t, got.get(0) or evidence.get(t, 0), 0)
    with t.case("24 samples, global batch 6 (everything divides), 2 epochs: the weights of one process", points=2):
        _exact_weights(t, evidence.get(t, 1), 1)
    with t.case("25 samples, global batch 8: the last batch holds 1 sample and 2 ranks none; every rank takes part "
                "in every step (one backward pass each, 8 in all) and returns", hint=SKIP_HINT, points=6):
        got[2] = _exact_hang(t, evidence, 2)
        _exact_counts(t, got[2], 2)
    with t.case("... the weights of one process with batches of 8, 8, 8 and 1", points=5):
        _exact_weights(t, got.get(2) or evidence.get(t, 2), 2)
    last = len(EXACT_SCENARIOS) - 1
    with t.case("NCCL ranks on simulated GPUs (20 samples, global batch 9, 1 epoch; rank 2 has no sample in the last "
                "step): every input the model gets, on every rank and in every step, is on the model's GPU", hint=GPU_HINT,
                points=2):
        got[last] = evidence.get(t, last)
        _exact_placement(t, got[last], mixes=False)
    with t.case("... the loss meets the labels on the model's GPU: no operation mixes devices", hint=GPU_HINT):
        _exact_placement(t, got.get(last) or evidence.get(t, last), mixes=True)

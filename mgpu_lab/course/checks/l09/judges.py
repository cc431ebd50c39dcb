"""Lesson 09's verdicts: the evidence of :mod:`.ranks`, in the words of each case."""
from __future__ import annotations

import math
import torch

from mgpu_lab.comm.bucketing import torch_bucket_assignment
from mgpu_lab.launcher.errors import is_consequence


def _own_first(per_rank: list, error_of) -> list:
    """``(rank, item)`` pairs, the ranks whose error is their own first: a rank that raised makes its peer's
    collective fail too ("Connection closed by peer"), and the case names the cause, not that echo of it
    (the launcher orders a failed launch's ranks the same way)."""
    return sorted(enumerate(per_rank), key=lambda ri: is_consequence(("error", {"message": error_of(ri[1]) or ""})))


def ring_result(t, runs, world, picks, hint, said: set | None = None, fresh: bool = False):
    """The sums of trials ``picks`` at ``world`` ranks; ``fresh``: the input tensor was also left as it was."""
    for k in picks:
        for rank, trials in _own_first(runs[world], lambda trials: trials[k].get("error") if k < len(trials) else None):
            if k >= len(trials):
                t.fail("the ranks stopped before this tensor: an earlier one failed", "a result", "none")
            trial = trials[k]
            call = f"{world} ranks, rank {rank}, a {trial['dtype']} tensor of shape {tuple(trial['shape'])}"
            if trial.get("error", "").startswith("Deadlock"):
                _deadlocked(t, runs, world, said if said is not None else set())
            if "error" in trial:
                t.fail(f"{call}: {hint}", "the sum over ranks", f"raised {trial['error']}")
            got = trial["result"]
            if got["type"] != "Tensor":
                t.fail(f"{call}: return the summed tensor", "a Tensor", got["type"])
            if got["shape"] != trial["shape"] or got["dtype"] != f"torch.{trial['dtype']}":
                t.fail(f"{call}: return a tensor of the input's shape and dtype: the ring works on the "
                       "flat elements, the caller gets back a tensor like the one it passed, and buffers made "
                       "without the input's dtype hold the wrong kind of numbers",
                       f"shape {trial['shape']}, torch.{trial['dtype']}", f"shape {got['shape']}, {got['dtype']}")
            if got["values"] != trial["expected"]:
                wrong = sum(a != b for a, b in zip(got["values"], trial["expected"]))
                t.fail(f"{call}: {hint}", trial["expected"], f"{got['values']} ({wrong} elements differ)")
            if fresh and trial.get("input_changed"):
                t.fail(f"{call}: the sum is right, but it was written into the caller's tensor: ring_allreduce "
                       "returns a new tensor and leaves its input as it was (the caller may still need its own "
                       "values, and dist.all_reduce's in-place way is not what this function promises)",
                       "the input unchanged", "the input holds the sum after the call")


def deadlocked_worlds(runs: dict) -> list:
    """The world sizes at which some rank's ring stopped with the recorder's Deadlock."""
    return sorted(w for w, ranks in runs.items() if isinstance(ranks, list) and any(
        trial.get("error", "").startswith("Deadlock") for trials in ranks for trial in trials))


def and_(items: list) -> str:
    """Items in words.

    Example:
        >>> and_([2]), and_([2, 3, 4])
        ('2', '2, 3 and 4')
    """
    items = [str(i) for i in items]
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _deadlocked(t, runs: dict, world: int, said: set) -> None:
    """Fail the case with the deadlock, in full the first time (with every world size it happened at)."""
    worlds = deadlocked_worlds(runs)
    if said:
        t.fail("", "the sum over ranks", f"deadlocked with {world} ranks too (the first failed case says why)")
    said.add(world)
    error = next(trial["error"] for trials in runs[world] for trial in trials
                 if trial.get("error", "").startswith("Deadlock"))
    text = error.split(": ", 1)[1].removeprefix("deadlock: ")
    waits, _, why = text.partition("). ")
    head, _, verdict = waits.partition(" (")
    t.fail(why, "the sum over ranks", f"deadlock with {and_(worlds)} ranks: {head} (with {world} ranks: {verdict})")


def ring_events(runs):
    for world, ranks in runs.items():
        for rank, trials in enumerate(ranks):
            for trial in trials:
                for event in trial["events"]:
                    yield world, rank, trial, event


def sends_something(t, done: dict) -> None:
    """Fail unless every rank of every run sent something: the cases about messages need messages."""
    for world, ranks in done.items():
        for rank, trials in enumerate(ranks):
            if world > 1 and not any(e["op"] == "send" for trial in trials for e in trial["events"]):
                t.fail("no send at all: each rank's values have to travel to the other ranks, around the ring",
                       "sends to the right-hand neighbour", f"{world} ranks, rank {rank}: nothing sent")


def ring_traffic(t, done: dict) -> None:
    with t.case("each rank sends about 2(W-1)/W of the tensor: 4 ranks x 1001 float32 (4004 bytes): about "
                "6006 bytes, not the whole tensor W-1 times (12012)",
                hint="send chunks, not the whole tensor: in each of the 2(W-1) steps a rank sends one chunk "
                     "of about n / W elements (reduce-scatter, then all-gather); passing the whole tensor "
                     "around the ring W-1 times costs W/2 times more"):
        if 4 not in done:
            t.fail("the 4-rank run did not finish")
        limit = 2 * 3 * math.ceil(1001 / 4) * 4 + 64  # a chunk of ceil(n / W) per step, a little to spare
        least = 2 * 3 * (1001 // 4) * 4  # no all-reduce sends less: 2(W-1)/W of the tensor
        for rank, trials in enumerate(done[4]):
            sent = sum(e["bytes"] for e in trials[0]["events"] if e["op"] == "send")
            if sent > limit:
                t.fail("", f"at most {limit} bytes sent by each rank", f"rank {rank} sent {sent} bytes")
            if sent < least:
                t.fail("every rank's values reach every other rank: in a ring each rank sends 2(W-1)/W of the "
                       "tensor, and no all-reduce can do with less", "about 6006 bytes sent by each rank",
                       f"rank {rank} sent {sent} bytes")


def ring_device(t, done: dict) -> None:
    with t.case("the buffers live on the input's device (tensors made without device= are checked as on a GPU)",
                hint="a buffer made without naming a device lands on the CPU: on a GPU rank NCCL refuses it; "
                     "every tensor the ring sends or receives must be on the input's device"):
        if 2 not in done:
            t.fail("the 2-rank run did not finish")
        for rank, trials in _own_first(done[2], lambda trials: trials[-1].get("error")):
            last = trials[-1]
            if not last["meta"]:
                t.fail("an earlier 2-rank tensor failed, so this one did not run", "a result", "none")
            if "error" in last:
                t.fail("", "sends and receives of tensors on the input's device", f"rank {rank}: {last['error']}")
            if last["result"]["type"] != "Tensor" or last["result"]["device"] != "cpu":
                t.fail("return a tensor on the input's device", "a tensor on cpu",
                       f"{last['result'].get('device', last['result']['type'])}")
            if last["result"]["values"] != last["expected"]:
                t.fail("", last["expected"], last["result"]["values"])
            if not any(e["op"] in ("send", "recv") for e in last["events"]):
                t.fail("not judged: this tensor was summed without a send or receive of yours, so no buffer of "
                       "yours was seen", "sends and receives of tensors on the input's device",
                       f"rank {rank}: no send or receive")


# -- MiniDDP ------------------------------------------------------------------------------
def mini_ran(t, runs, scenario: str = "plain") -> list:
    """The runs of one scenario, or the case fails with the first error."""
    if runs is None:
        t.fail("the ranks did not finish")
    hints = {"frozen": "a parameter that requires no gradient never gets one, so a bucket that holds it is never "
                       "complete: DDP leaves such parameters out of its buckets",
             "small_cap": "a parameter larger than the cap is no error: the bucket it falls in is full once it is "
                          "added, as DDP does"}
    for rank, run in _own_first([r[scenario] for r in runs], lambda run: run["error"]):
        if run["error"]:
            t.fail(hints.get(scenario, ""), "MiniDDP trains", f"rank {rank}: {run['error']}")
    return [r[scenario] for r in runs]


def same_start(t, runs) -> None:
    for rank, run in enumerate(mini_ran(t, runs)):
        for i, (mine, want) in enumerate(zip(run["start"], run["rank0"])):
            if not torch.equal(mine, want):
                what = (f"parameter {i}" if i < run["n_params"] else f"buffer {i - run['n_params']}")
                t.fail(f"the ranks started from different {'weights' if i < run['n_params'] else 'buffers'} and "
                       "still differ after MiniDDP(...): DDP makes every rank start from rank 0's parameters and "
                       "buffers when it wraps the model, or the ranks train different models",
                       f"rank {rank} holds rank 0's weights and buffers",
                       f"rank {rank}, {what} differs from rank 0's by {float((mine - want).abs().max()):.3g}")


def _grad_hint(mine, ref, local, step: int, world: int) -> str:
    ratio = float(mine.double().norm() / max(ref.double().norm(), 1e-12))
    if step > 0:  # step 0 was right: the checker judges the steps in order
        return ("the first step's gradients are right, a later step's are not: what tells a bucket that its "
                "gradients are all ready has to start over every step")
    if local is not None and torch.allclose(mine, local, atol=1e-6):
        return ("each rank's gradient is still its own, not the average: the all-reduced bucket never went back "
                "into the parameters' .grad (a bucket put together from the gradients is a copy of them)")
    if abs(ratio - world) < 0.05:
        return "the gradients are world_size times DDP's: the all-reduce sums, DDP averages over the ranks"
    if world != 2 and abs(ratio - world / 2) < 0.05:
        return (f"the gradients are {world}/2 times DDP's on {world} ranks: divided by 2, not by the number of "
                "ranks (dist.get_world_size())")
    return "after finish_gradient_sync every parameter's gradient is the average over the ranks, as DDP's"


def grads_equal(t, runs, scenario: str = "plain") -> None:
    done = mini_ran(t, runs, scenario)
    for rank, run in enumerate(done):
        for step, entry in enumerate(run["steps"]):
            for i, (mine, ref) in enumerate(zip(entry["mini"], entry["ref"])):
                if mine is None:
                    t.fail("after finish_gradient_sync every parameter that requires a gradient has one",
                           "a gradient", f"rank {rank}, step {step}, parameter {i}: None")
                if not torch.allclose(mine, ref, rtol=1e-4, atol=1e-6):
                    local = entry.get("local", [None] * len(entry["mini"]))[i]
                    t.fail(_grad_hint(mine, ref, local, step, len(done)), f"DDP's gradient (rank {rank}, step "
                           f"{step}, parameter {i})", f"max difference {float((mine - ref).abs().max()):.3g}")


def expected_buckets(sizes: list, cap: int) -> list:
    """Bytes of DDP's buckets, in the order they are all-reduced."""
    return [sum(sizes[i] for i in bucket) for bucket in torch_bucket_assignment(sizes, cap)]


def _reductions(entry) -> list:
    return [e for e in entry["events"] if e["op"] == "all_reduce"]


def _overlap_problem(entry, step: int, rank: int) -> tuple | None:
    """(hint, got) when an all-reduce was blocking or waited on before the next bucket's started, else None."""
    if not all(entry["async"]):
        return ("an all-reduce was blocking: each bucket's all-reduce is started asynchronously, so that backward "
                "goes on computing while it runs, and finish_gradient_sync waits for them",
                f"blocking ones in step {step} (rank {rank})")
    starts = [i for i, e in enumerate(entry["events"]) if e["op"] == "all_reduce"]
    for e_at, e in enumerate(entry["events"]):
        k = e.get("index")
        if e["op"] == "wait" and k is not None and k + 1 < len(starts) and e_at < starts[k + 1]:
            return ("an all-reduce was waited on at once, inside backward, before the next bucket's all-reduce "
                    "started: started asynchronously and then waited for, it blocks backward all the same, and "
                    "nothing overlaps; finish_gradient_sync is where the all-reduces are waited for",
                    f"all-reduce {k} waited on before all-reduce {k + 1} started (step {step}, rank {rank})")
    return None


def one_per_bucket(t, runs, cap: int) -> None:
    """One all-reduce per bucket and step, each asynchronous and left running while backward goes on; a
    failure says both what the count and what the overlap got wrong."""
    for rank, run in enumerate(mini_ran(t, runs)):
        want = expected_buckets(run["sizes"], cap)
        for step, entry in enumerate(run["steps"]):
            other = sorted({e["op"] for e in entry["events"] if e["op"] not in ("all_reduce", "mark", "wait")})
            if other:
                t.fail("DDP communicates gradients with all-reduces only", "all_reduce", ", ".join(other))
            got = len(_reductions(entry))
            overlap = _overlap_problem(entry, step, rank)
            hint, said = "", []
            if got != len(want):
                hint = ("one all-reduce per parameter: DDP groups the gradients into buckets, so that it pays a "
                        "message's latency once per bucket" if got == len(run["sizes"]) else
                        "one all-reduce for all the gradients: it cannot start before the last gradient exists"
                        if got == 1 else f"the cap of {cap} bytes makes {len(want)} buckets; each is all-reduced "
                        "once per step")
                said.append(f"{got} all-reduces (rank {rank}, step {step})")
            if overlap:
                hint = f"{hint}; also, {overlap[0]}" if hint else overlap[0]
                said.append(overlap[1])
            if said:
                t.fail(hint, f"{len(want)} asynchronous all-reduces in step {step}, each waited on in "
                       "finish_gradient_sync", "; ".join(said))


def bucket_sizes(t, runs, scenario: str = "plain") -> None:
    for rank, run in enumerate(mini_ran(t, runs, scenario)):
        sizes, cap = run["sizes"], run["cap"]
        want = expected_buckets(sizes, cap)
        forward = expected_buckets(sizes[::-1], cap)
        for step, entry in enumerate(run["steps"]):
            got = [e["bytes"] for e in _reductions(entry)]
            if got != want:
                hint = ("buckets filled from the first parameter: DDP fills them from the last one, whose "
                        "gradient backward computes first" if sorted(got) == sorted(forward) and got != want else
                        "DDP's rule: walk the parameters from the last to the first, add each to the open bucket, "
                        "close the bucket once its bytes reach the cap (a bucket exactly at the cap is full); "
                        "the all-reduces start in bucket order")
                t.fail(hint, f"all-reduces of {want} bytes for a cap of {cap}", f"{got} (rank {rank}, step {step})")


def during_backward(t, runs) -> None:
    for rank, run in enumerate(mini_ran(t, runs)):
        for step, entry in enumerate(run["steps"]):
            ops = [e["op"] if e["op"] != "mark" else e["at"] for e in entry["events"]]
            early = ops.index("first layer") if "first layer" in ops else len(ops)
            returned = ops.index("backward returned") if "backward returned" in ops else len(ops)
            if "all_reduce" not in ops[:early]:
                t.fail("no all-reduce started before backward reached the first layer: a bucket's all-reduce "
                       "starts as soon as its last gradient is ready, while backward goes on with earlier layers",
                       "bucket 0's all-reduce before the first layer's gradients exist",
                       f"{ops[:early].count('all_reduce')} all-reduces by then (rank {rank}, step {step})")
            late = ops[returned:].count("all_reduce")
            if late:
                t.fail("the last bucket is ready when backward computes its last gradient: its all-reduce "
                       "starts then too, not in finish_gradient_sync", "every all-reduce started during backward",
                       f"{late} started after backward returned (rank {rank}, step {step})")


# -- error_feedback_hook ---------------------------------------------------------------------
def _close(a, b) -> bool:
    scale = max(float(b.abs().max()), 1e-6)
    return torch.allclose(a.double(), b.double(), rtol=2e-2, atol=1e-2 * scale)


def hook_ran(t, results) -> list:
    if results is None:
        t.fail("the ranks did not finish")
    for rank, res in enumerate(results):
        if res["error"]:
            said = res["error"]
            hint = ("DDP rebuilds its buckets after the first iteration (section 4): a bucket index may then name "
                    "a bucket of another size, and a residual kept under it no longer fits"
                    if "size of tensor" in said or "shape" in said else
                    "a communication hook returns a Future whose value is one tensor of the bucket's shape")
            t.fail(hint, "DDP trains with the hook", f"rank {rank}: {said}")
    return results


def hook_reduced(t, results) -> None:
    for rank, res in enumerate(hook_ran(t, results)):
        calls, reduced = len(res["seen"]), sum(e["op"] == "all_reduce" for e in res["events"])
        if reduced < calls:
            t.fail("each bucket's average over the ranks comes from an all-reduce the hook starts",
                   f"an all-reduce for each of the {calls} buckets", f"{reduced} all-reduces (rank {rank})")


def sent_bf16(t, results) -> None:
    sent = sorted({e["dtype"] for res in hook_ran(t, results) for e in res["events"] if e["op"] == "all_reduce"})
    if sent != ["torch.bfloat16"]:
        t.fail("compress before the all-reduce: bfloat16 halves the bytes on the wire",
               "all_reduce of torch.bfloat16 tensors only", "all_reduce of " + (", ".join(sent) or "nothing"))


def hook_grads(t, results) -> None:
    done = hook_ran(t, results)
    for rank, res in enumerate(done):
        for step, (mine_all, ref_all) in enumerate(zip(res["hooked"], res["exact"])):
            for i, (mine, ref) in enumerate(zip(mine_all, ref_all)):
                if not _close(mine, ref):
                    ratio = float(mine.double().norm() / max(ref.double().norm(), 1e-12))
                    hint = ("the gradients are about world_size times DDP's: the all-reduce sums, DDP averages"
                            if abs(ratio - len(done)) < 0.2 else
                            "each step DDP gets the average over the ranks, to bfloat16 precision; a residual is "
                            "what this rank's compression lost, a rounding error, never more")
                    t.fail(hint, f"DDP's gradients within bfloat16 tolerance (rank {rank}, step {step}, "
                           f"parameter {i})", f"max difference {float((mine - ref).abs().max()):.3g}, "
                           f"norm ratio {ratio:.3f}")


def _hook_called(t, results) -> list:
    """The runs, or the case fails when DDP never called the hook (nothing to judge)."""
    done = hook_ran(t, results)
    for rank, res in enumerate(done):
        if not res["seen"]:
            t.fail("not judged: DDP never called your hook", "a call per bucket and step", f"rank {rank}: none")
    return done


def returned_like_bucket(t, results) -> None:
    for got in (r for res in _hook_called(t, results) for r in res["seen"]):
        if got.get("type") != "Tensor" or got["dtype"] != got["buffer_dtype"] or got["shape"] != got["buffer_shape"]:
            t.fail("DDP copies the future's value into the gradients: one tensor of the bucket's dtype and shape "
                   "(a bfloat16 value goes unnoticed there, but it is not what the hook promises)",
                   f"a tensor, {got['buffer_dtype']}, shape {got['buffer_shape']}",
                   f"{got.get('type')} {got.get('dtype', '')} {got.get('shape', '')}".strip())


def residuals_kept(t, results) -> None:
    for rank, res in enumerate(_hook_called(t, results)):
        last = {}
        for seen in res["seen"]:  # the last step's buckets: after DDP rebuilt them
            last[seen["index"]] = seen
        kept = res["residuals"]
        missing = sorted(set(last) - set(kept))
        if missing:
            t.fail("the hook keeps each bucket's residual in state under bucket.index(), and adds it back the next "
                   "time that bucket comes", f"residuals under keys {sorted(last)}",
                   f"state holds keys {res['keys']} (rank {rank})")
        for index, seen in last.items():
            got = kept[index]
            if got["type"] != "Tensor" or got["numel"] != seen["numel"]:
                t.fail("a bucket's residual is a tensor of the bucket's size", f"{seen['numel']} elements",
                       f"{got['type']} of {got['numel']} (rank {rank}, bucket {index})")
            if got["largest"] > seen["largest"] * 2 ** -7:
                t.fail("a residual is what this rank's own compression lost: bfloat16 keeps 8 significant bits, so "
                       "it is a few thousandths of the gradient at most (not the difference from the all-reduced "
                       "average, which holds the other ranks' gradients)",
                       f"at most {seen['largest'] * 2 ** -7:.3g}",
                       f"{got['largest']:.3g} (rank {rank}, bucket {index})")


def feedback_helps(t, results, steps: int) -> None:
    for rank, res in enumerate(hook_ran(t, results)):
        if res.get("long_error"):
            t.fail("", "the hook runs 20 steps", res["long_error"])
        sent = sorted(set(res["long_sent"]))
        if sent != ["torch.bfloat16"]:
            t.fail("over the 20 steps the hook all-reduces bfloat16 tensors: this case measures what "
                   "compression loses and what error feedback gives back", "all_reduce of torch.bfloat16",
                   "all_reduce of " + (", ".join(sent) or "nothing"))
        long = res["long"]
        ratio = long["hooked"] / max(long["plain"], 1e-30)
        if ratio > 0.5:
            hint = ("no better than plain bf16 compression: what compression lost in one step has to be added to "
                    "the same bucket's gradient the next step" if ratio > 0.8 else
                    "the error feedback helps, but not enough: the residual is the bucket as sent (gradient plus "
                    "the old residual) minus its bfloat16 value")
            if ratio > 1.3:
                hint = "worse than plain bf16 compression: the residual goes back with the wrong sign, or stale"
            t.fail(hint, f"summed error at most half of plain bf16's ({long['plain']:.3g})",
                   f"{long['hooked']:.3g} ({ratio:.2f} of plain bf16's, rank {rank}, {steps} steps)")

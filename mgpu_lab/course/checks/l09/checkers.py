"""Checks of lesson 09 (inside DDP): ring_allreduce, MiniDDP, error_feedback_hook.

The yardsticks are the real things: ``dist.all_reduce`` for the ring, torch's DDP (and
PyTorch's own bucketing function, the one DDP's reducer calls) for MiniDDP, DDP without a
hook and plain bf16 compression for the error-feedback hook. Everything runs in real
ranks with every send, recv and collective recorded (:mod:`mgpu_lab.comm.record`), so
"no collective", "only the neighbours", "2(W-1)/W of the tensor", "one all-reduce per
bucket, started during backward" and "the tensor sent is bfloat16" are judged from what
the ranks really did. What runs in the ranks is :mod:`.ranks`.
"""
from __future__ import annotations


from mgpu_lab.comm.record import P2P
from .._core import CaseFailed, exercise
from . import judges
from .judges import ring_events, ring_device, ring_result, ring_traffic
from .ranks import CAP, SMALL_CAP, WORLD, run_feedback, run_mini_all, run_ring

HOOKS = "torch.distributed.algorithms.ddp_comm_hooks."


# -- ring_allreduce ----------------------------------------------------------------------
RING_TRIALS = {
    2: [((7,), "float32", False), ((2,), "float32", False), ((3, 5), "float64", False), ((5,), "int64", False),
        ((6,), "float32", True)],
    3: [((10,), "float32", False), ((2,), "float32", False)],
    4: [((1001,), "float32", False), ((5,), "float32", False)],
}


SPLIT_HINT = ("cut the flat tensor with tensor_split(world_size): it always gives world_size chunks, some "
              "possibly empty (torch.chunk can give fewer), and every rank must cut the same way")


@exercise("09.ring_allreduce", points=8, description="ring_allreduce(tensor): the sum over ranks with send/recv "
          "only, around a ring, each rank sending 2(W-1)/W of the tensor",
          references=("mgpu_lab.comm.ring:all_reduce",))
def _ring_allreduce(t, ring_allreduce):
    runs = {}
    hint = ("every rank must end with the element-wise sum over all ranks: a reduce-scatter phase (W-1 steps: "
            "send a chunk right, add the chunk from the left) then an all-gather phase (W-1 steps: pass the "
            "finished chunks on); check which chunk index each rank sends and receives at each step")
    cases = [
        (2, [0, 1], "2 ranks, float32 tensors of 7 and 2 elements: every rank gets the sum, as dist.all_reduce "
                    "gives it", hint, False),
        (2, [2, 3], "2 ranks, a 3x5 float64 tensor and an int64 tensor: the sum, a new tensor in the input's shape "
                    "and dtype, the input left as it was", hint, True),
        (3, [0, 1], "3 ranks, 10 elements and 2 (fewer elements than ranks): the sum on every rank",
         f"{hint}; {SPLIT_HINT}", False),
        (4, [0, 1], "4 ranks, 1001 elements and 5: the sum on every rank", f"{hint}; {SPLIT_HINT}", False),
    ]
    runs = _run_worlds(t, ring_allreduce)
    said: set = set()  # a deadlock is said in full once, with every world size it happened at
    for world, picks, name, case_hint, fresh in cases:
        with t.case(name):
            if isinstance(runs.get(world), BaseException):
                failed, runs[world] = runs[world], None
                raise failed
            if runs.get(world) is None:
                t.fail("the ranks did not finish")
            ring_result(t, runs, world, picks, case_hint, said, fresh=fresh)
    stuck = judges.deadlocked_worlds(runs)  # a ring that deadlocked proves nothing about its messages
    done = {w: r for w, r in runs.items() if r is not None and not isinstance(r, BaseException) and w not in stuck}
    with t.case("only point-to-point calls (send/recv, isend/irecv): no collective",
                hint="the point is to build the all-reduce yourself: use dist.isend/dist.irecv (or send/recv) "
                     "between neighbours, not dist.all_reduce, broadcast, all_gather, reduce_scatter, ..."):
        if len(done) < 3:
            t.fail("not every world size ran to the end" + (f" (deadlocked with {judges.and_(stuck)} ranks)"
                                                            if stuck else ""), "3 runs", f"{len(done)}")
        used = sorted({e["call"] for *_, e in ring_events(done)
                       if e["call"] not in P2P + ("barrier",) and e["op"] != "wait"})
        if used:
            t.fail("", "only send/recv/isend/irecv", f"collectives used: {', '.join(used)}")
        judges.sends_something(t, done)
    with t.case("each rank talks only to its two ring neighbours (4 ranks: rank r with r-1 and r+1)",
                hint="in a ring rank r sends only to (r + 1) % world_size and receives only from "
                     "(r - 1) % world_size; name the peer (src=...) in every receive"):
        if 4 not in done:
            t.fail("the 4-rank run did not finish" + (" (it deadlocked)" if 4 in stuck else ""))
        judges.sends_something(t, {4: done[4]})
        for world, rank, trial, event in ring_events({4: done[4]}):
            if event["call"] in P2P and event["peer"] not in ((rank + 1) % world, (rank - 1) % world):
                peer = "any rank (src=None)" if event["peer"] is None else f"rank {event['peer']}"
                t.fail("", f"rank {rank} talks to ranks {(rank - 1) % world} and {(rank + 1) % world}",
                       f"rank {rank} did {event['call']} with {peer}")
    ring_traffic(t, done)
    ring_device(t, done)


def _run_worlds(t, ring_allreduce) -> dict:
    """Every world size's run, before any case is judged (so a deadlock can be told once, with every world size
    it happened at); a run that raised keeps its exception, for the first case of its world to fail with."""
    from mgpu_lab.launcher.errors import LaunchError, LaunchTimeout

    runs: dict = {}
    for world in RING_TRIALS:
        try:
            runs[world] = t.ranks(run_ring, world, ring_allreduce, RING_TRIALS[world], timeout=60)
        except (LaunchError, CaseFailed) as exc:  # LaunchTimeout included; a later world after a hang: skipped
            runs[world] = exc
            t._hung = t._hung or isinstance(exc, LaunchTimeout)
            if getattr(exc, "exc_type", None) == "NotImplementedError":
                break
    return runs


@exercise("09.MiniDDP", points=6, description="MiniDDP(module, bucket_cap_bytes): DDP by hand, gradients in buckets "
          "all-reduced asynchronously during backward; finish_gradient_sync() leaves DDP's gradients",
          references=("torch.nn.parallel:DistributedDataParallel", "torch.distributed._composable.replicate:replicate",
                      "mgpu_lab.comm.bucketing:torch_bucket_assignment"))
def _mini_ddp(t, MiniDDP):
    runs = None
    with t.case(f"{WORLD} ranks that start from different weights and buffers hold rank 0's after "
                "MiniDDP(model, cap), as under DDP"):
        runs = t.ranks(run_mini_all, WORLD, MiniDDP, timeout=90)
        judges.same_start(t, runs)
    with t.case(f"after finish_gradient_sync, 3 SGD steps of {WORLD} ranks: every gradient equals DDP's (the "
                "average)"):
        judges.grads_equal(t, runs)
    with t.case(f"one asynchronous all-reduce per bucket in every step: 3 for a cap of {CAP} bytes, none waited "
                "on before the next bucket's has started"):
        judges.one_per_bucket(t, runs, CAP)
    with t.case(f"DDP's buckets for a cap of {CAP} bytes: all-reduces of 1360, 1088 and 576 bytes, in this order; "
                f"for {SMALL_CAP} bytes, below the largest parameter: 272, 1088, 1088 and 576"):
        judges.bucket_sizes(t, runs)
        judges.bucket_sizes(t, runs, "small_cap")
    with t.case("all-reduces start during backward: bucket 0's before backward reaches the first layer, the "
                "last one before backward returns"):
        judges.during_backward(t, runs)
    with t.case(f"a parameter with requires_grad=False is in no bucket, and parameters larger than a cap of "
                f"{SMALL_CAP} bytes are all-reduced all the same: DDP's gradients"):
        judges.grads_equal(t, runs, "frozen")
        judges.grads_equal(t, runs, "small_cap")


@exercise("09.error_feedback_hook", points=6, description="error_feedback_hook(state, bucket): a DDP communication "
          "hook that all-reduces the bucket in bf16 and adds what compression lost back the next step",
          references=tuple(HOOKS + name for name in (
              "default_hooks:bf16_compress_hook", "default_hooks:fp16_compress_hook", "default_hooks:_compress_hook",
              "default_hooks:bf16_compress_wrapper", "default_hooks:fp16_compress_wrapper",
              "powerSGD_hook:powerSGD_hook", "powerSGD_hook:batched_powerSGD_hook")))
def _error_feedback_hook(t, error_feedback_hook):
    results = None
    with t.case("DDP trains with it in 2 ranks from its first iteration on, a dict registered as its state: "
                "every bucket all-reduced"):
        results = t.ranks(run_feedback, 2, error_feedback_hook, timeout=90)
        judges.hook_reduced(t, results)
    with t.case("the tensors it all-reduces are bfloat16 (half the bytes of float32)"):
        judges.sent_bf16(t, results)
    with t.case("each step's gradients equal DDP's within bfloat16 tolerance: the average over ranks"):
        judges.hook_grads(t, results)
    with t.case("the future's value is one tensor of the bucket's dtype (float32) and shape"):
        judges.returned_like_bucket(t, results)
    with t.case("state keeps each bucket's residual under bucket.index(): a tensor of the bucket's size, no larger "
                "than bfloat16's rounding"):
        judges.residuals_kept(t, results)
    with t.case("20 steps, the same batch on both ranks: the summed gradients differ from the exact ones by at "
                "most half of plain bf16 compression's difference"):
        judges.feedback_helps(t, results, 20)

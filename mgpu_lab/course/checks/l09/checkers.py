"""Checks of lesson 09 (inside DDP): ring_allreduce, bucket_assignment, bf16_compress_hook.

The references are the real things: ``dist.all_reduce`` for the ring, PyTorch's own
bucketing function (the one DDP's reducer calls) for the buckets, and DDP without a
hook for the hook. The ring and the hook run in real ranks with every send, recv and
collective recorded (:mod:`mgpu_lab.comm.record`), so "no collective", "only the
neighbours", "2(W-1)/W of the tensor" and "the tensor sent is bfloat16" are judged
from what the ranks really did. What runs in the ranks is :mod:`.ranks`.
"""
from __future__ import annotations

import random

from mgpu_lab.comm.record import P2P
from .._core import exercise
from .judges import ring_events, grads_match, judge_buckets, ring_device, ring_result, ring_traffic
from .ranks import call_all, run_hook, run_ring


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
          "only, around a ring, each rank sending 2(W-1)/W of the tensor")
def _ring_allreduce(t, ring_allreduce):
    runs = {}
    hint = ("every rank must end with the element-wise sum over all ranks: a reduce-scatter phase (W-1 steps: "
            "send a chunk right, add the chunk from the left) then an all-gather phase (W-1 steps: pass the "
            "finished chunks on); check which chunk index each rank sends and receives at each step")
    cases = [
        (2, [0, 1], "2 ranks, float32 tensors of 7 and 2 elements: every rank gets the sum, as dist.all_reduce "
                    "gives it", hint),
        (2, [2, 3], "2 ranks, a 3x5 float64 tensor and an int64 tensor: the sum, in the input's shape and dtype",
         hint),
        (3, [0, 1], "3 ranks, 10 elements and 2 (fewer elements than ranks): the sum on every rank",
         f"{hint}; {SPLIT_HINT}"),
        (4, [0, 1], "4 ranks, 1001 elements and 5: the sum on every rank", f"{hint}; {SPLIT_HINT}"),
    ]
    for world, picks, name, case_hint in cases:
        with t.case(name):
            if world not in runs:
                runs[world] = None
                runs[world] = t.ranks(run_ring, world, ring_allreduce, RING_TRIALS[world], timeout=60)
            if runs[world] is None:
                t.fail("the ranks did not finish")
            ring_result(t, runs, world, picks, case_hint)
    done = {w: r for w, r in runs.items() if r is not None}
    with t.case("only point-to-point calls (send/recv, isend/irecv): no collective",
                hint="the point is to build the all-reduce yourself: use dist.isend/dist.irecv (or send/recv) "
                     "between neighbours, not dist.all_reduce, broadcast, all_gather, reduce_scatter, ..."):
        if len(done) < 3:
            t.fail("not every world size ran to the end", "3 runs", f"{len(done)}")
        used = sorted({e["call"] for *_, e in ring_events(done)
                       if e["call"] not in P2P + ("barrier",) and e["op"] != "wait"})
        if used:
            t.fail("", "only send/recv/isend/irecv", f"collectives used: {', '.join(used)}")
    with t.case("each rank talks only to its two ring neighbours (4 ranks: rank r with r-1 and r+1)",
                hint="in a ring rank r sends only to (r + 1) % world_size and receives only from "
                     "(r - 1) % world_size; name the peer (src=...) in every receive"):
        if 4 not in done:
            t.fail("the 4-rank run did not finish")
        for world, rank, trial, event in ring_events({4: done[4]}):
            if event["call"] in P2P and event["peer"] not in ((rank + 1) % world, (rank - 1) % world):
                peer = "any rank (src=None)" if event["peer"] is None else f"rank {event['peer']}"
                t.fail("", f"rank {rank} talks to ranks {(rank - 1) % world} and {(rank + 1) % world}",
                       f"rank {rank} did {event['call']} with {peer}")
    ring_traffic(t, done)
    ring_device(t, done)


@exercise("09.bucket_assignment", points=7, description="bucket_assignment(param_bytes, cap_bytes): DDP's gradient "
          "buckets, filled from the last parameter, each closed once it reaches the cap")
def _bucket_assignment(t, bucket_assignment):
    groups = [
        ("5 parameters of 400 bytes, cap 800: [[4, 3], [2, 1], [0]]", [([400] * 5, 800)],
         "walk the parameters from the last one to the first; add each to the open bucket and close the bucket "
         "as soon as its bytes reach cap_bytes"),
        ("filled from the last parameter: sizes [100, 900, 100], cap 1000", [([100, 900, 100], 1000)],
         "DDP fills buckets in reverse order of registration (gradients of the last layers are ready first): "
         "start at index len(param_bytes) - 1, and bucket 0 is the one holding the last parameters"),
        ("a bucket may go past the cap: it closes only once it has reached it",
         [([1600, 16000, 160, 16000, 1600, 160], 20000)],
         "add the parameter first, then close the bucket if its size is >= cap_bytes; a bucket is not kept "
         "below the cap (don't close it before adding a parameter that would overflow it)"),
        ("exactly at the cap: a bucket of 700 bytes with cap 700 is closed", [([300, 300, 400], 700)],
         "close when size >= cap_bytes, not only when size > cap_bytes"),
        ("a parameter larger than the cap, and a last bucket below the cap", [([40, 5000, 60, 60], 100)],
         "after the loop, the open bucket (smaller than the cap) is the last bucket: don't drop it; a parameter "
         "larger than the cap closes its bucket at once"),
        ("one parameter; no parameters at all", [([123], 10), ([], 10)],
         "one parameter makes one bucket; no parameters make no buckets (an empty list, not [[]])"),
    ]
    rng = random.Random(9)
    sweep = [([4 * rng.randint(1, 3000) for _ in range(rng.randint(1, 9))], 4 * rng.randint(1, 6000))
             for _ in range(40)]
    cases = [c for _, group, _ in groups for c in group] + sweep
    got = None
    with t.case(groups[0][0], hint=groups[0][2]):
        got = t.call(call_all, bucket_assignment, cases)
        judge_buckets(t, groups[0][1], got[:1], groups[0][2])
    start = 1
    for name, group, hint in groups[1:]:
        with t.case(name):
            if got is None:
                t.fail("the first case did not finish")
            judge_buckets(t, group, got[start:start + len(group)], hint)
        start += len(group)
    with t.case("40 random sizes and caps: PyTorch's own buckets", hidden=True):
        if got is None:
            t.fail("the first case did not finish")
        judge_buckets(t, sweep, got[start:], "")


@exercise("09.bf16_compress_hook", points=5, description="bf16_compress_hook(state, bucket): a DDP communication "
          "hook that all-reduces the bucket in bfloat16 and returns the average in the bucket's dtype")
def _bf16_compress_hook(t, bf16_compress_hook):
    results = None
    with t.case("registered on DDP in 2 ranks, DDP trains with it (it returns a Future whose value is one tensor)",
                hint="return the future of an asynchronous all-reduce: "
                     "dist.all_reduce(compressed, async_op=True).get_future().then(decompress), where decompress "
                     "takes fut.value()[0] (the value is a list) and returns one tensor; state is the process "
                     "group, or None for the default group"):
        results = t.ranks(run_hook, 2, bf16_compress_hook, "float32", timeout=60)
        errors = [res["error"] for res in results if res["error"]]
        if errors:
            t.fail("", "DDP accepts the hook's future", errors[0])
    with t.case("the tensor all-reduced is bfloat16 (half the bytes of float32)",
                hint="compress before the all-reduce: bucket.buffer().to(torch.bfloat16)"):
        if results is None or any(res["error"] for res in results):
            t.fail("the previous case did not finish")
        sent = sorted({e["dtype"] for res in results for e in res["events"] if e["op"] != "barrier"})
        if sent != ["torch.bfloat16"]:
            t.fail("", "all_reduce of torch.bfloat16 tensors only", "all_reduce of " + (", ".join(sent) or
                                                                                          "nothing (no all_reduce)"))
    with t.case("the gradients equal DDP's own within bfloat16 tolerance: the average over ranks, not the sum"):
        if results is None or any(res["error"] for res in results):
            t.fail("the previous case did not finish")
        grads_match(t, results, "float32")
    with t.case("the future's value has the bucket's dtype (float32) and shape",
                hint="decompress: copy the all-reduced bfloat16 tensor back into bucket.buffer() (copy_ casts), "
                     "or .to(bucket.buffer().dtype), and return it; DDP copies whatever it gets into the "
                     "gradients, so a bfloat16 value goes unnoticed there"):
        if results is None or any(res["error"] for res in results):
            t.fail("the previous case did not finish")
        for got in (r for res in results for r in res["returned"]):
            if got.get("type") != "Tensor" or got["dtype"] != got["buffer_dtype"] or \
                    got["shape"] != got["buffer_shape"]:
                t.fail("", "a tensor of the bucket's dtype and shape",
                       f"{got.get('type')} {got.get('dtype', '')} {got.get('shape', '')}".strip())
    with t.case("a float64 model: float64 gradients, equal to DDP's within bfloat16 tolerance",
                hint="cast back to the bucket's own dtype (bucket.buffer().dtype), not to float32"):
        results = t.ranks(run_hook, 2, bf16_compress_hook, "float64", timeout=60)
        errors = [res["error"] for res in results if res["error"]]
        if errors:
            t.fail("", "DDP accepts the hook's future", errors[0])
        grads_match(t, results, "float64")
        for got in (r for res in results for r in res["returned"]):
            if got.get("dtype") != got.get("buffer_dtype"):
                t.fail("", f"{got.get('buffer_dtype')} values from the future", got.get("dtype"))

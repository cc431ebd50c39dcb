"""Lesson 09's verdicts: the evidence of :mod:`.ranks`, in the words of each case."""
from __future__ import annotations

import math
import torch

from mgpu_lab.comm.ddp_buckets import torch_bucket_assignment
from ..sim.outcome import in_words


def ring_result(t, runs, world, picks, hint):
    for k in picks:
        for rank, trials in enumerate(runs[world]):
            if k >= len(trials):
                t.fail("the ranks stopped before this tensor: an earlier one failed", "a result", "none")
            trial = trials[k]
            call = f"{world} ranks, rank {rank}, a {trial['dtype']} tensor of shape {tuple(trial['shape'])}"
            if "error" in trial:
                t.fail(f"{call}: {hint}", "the sum over ranks", f"raised {trial['error']}")
            got = trial["result"]
            if got["type"] != "Tensor":
                t.fail(f"{call}: return the summed tensor", "a Tensor", got["type"])
            if got["shape"] != trial["shape"] or got["dtype"] != f"torch.{trial['dtype']}":
                t.fail(f"{call}: return a tensor of the input's shape and dtype (flatten with reshape(-1) for "
                       "the ring, view the result back as the input; make buffers with torch.empty_like or "
                       "zeros_like, which keep the dtype)", f"shape {trial['shape']}, torch.{trial['dtype']}",
                       f"shape {got['shape']}, {got['dtype']}")
            if got["values"] != trial["expected"]:
                wrong = sum(a != b for a, b in zip(got["values"], trial["expected"]))
                t.fail(f"{call}: {hint}", trial["expected"], f"{got['values']} ({wrong} elements differ)")


def ring_events(runs):
    for world, ranks in runs.items():
        for rank, trials in enumerate(ranks):
            for trial in trials:
                for event in trial["events"]:
                    yield world, rank, trial, event


def ring_traffic(t, done: dict) -> None:
    with t.case("each rank sends about 2(W-1)/W of the tensor: 4 ranks x 1001 float32 (4004 bytes): about "
                "6006 bytes, not the whole tensor W-1 times (12012)",
                hint="send chunks, not the whole tensor: in each of the 2(W-1) steps a rank sends one chunk "
                     "of about n / W elements (reduce-scatter, then all-gather); passing the whole tensor "
                     "around the ring W-1 times costs W/2 times more"):
        if 4 not in done:
            t.fail("the 4-rank run did not finish")
        limit = 2 * 3 * math.ceil(1001 / 4) * 4 + 64  # a chunk of ceil(n / W) per step, a little to spare
        for rank, trials in enumerate(done[4]):
            sent = sum(e["bytes"] for e in trials[0]["events"] if e["op"] == "send")
            if sent > limit:
                t.fail("", f"at most {limit} bytes sent by each rank", f"rank {rank} sent {sent} bytes")


def ring_device(t, done: dict) -> None:
    with t.case("the buffers live on the input's device (tensors made without device= are checked as on a GPU)",
                hint="create every buffer from the input (torch.empty_like(chunk), chunk.new_empty(n), "
                     "tensor.clone()) or with device=tensor.device: on a GPU rank, torch.zeros(n) is a CPU "
                     "tensor and NCCL refuses it"):
        if 2 not in done:
            t.fail("the 2-rank run did not finish")
        for rank, trials in enumerate(done[2]):
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


# -- bucket_assignment -------------------------------------------------------------------
def judge_buckets(t, cases, got, hint):
    for (sizes, cap), answer in zip(cases, got):
        want = torch_bucket_assignment(sizes, cap)
        call = f"bucket_assignment({sizes}, cap_bytes={cap})"
        if answer[0] != "ok":
            t.fail(f"{call} raised: {hint}", want, in_words(answer, raised=""))
        if [sorted(b) for b in answer[1]] != [sorted(b) for b in want]:
            t.fail(f"{call}: {hint}", want, answer[1])


# -- bf16_compress_hook ------------------------------------------------------------------
def _close(a, b) -> bool:
    scale = max(float(b.abs().max()), 1e-6)
    return torch.allclose(a.double(), b.double(), rtol=2e-2, atol=1e-2 * scale)


def grads_match(t, results, dtype_name):
    for rank, res in enumerate(results):
        for step, grads in enumerate(res["steps"]):
            for i, (mine, ref) in enumerate(zip(grads["hooked"], grads["plain"])):
                if str(mine.dtype) != f"torch.{dtype_name}":
                    t.fail("", f"torch.{dtype_name} gradients", f"{mine.dtype}")
                if not _close(mine, ref):
                    ratio = float(mine.double().norm() / max(ref.double().norm(), 1e-12))
                    hint = ("the gradients are about world_size times DDP's: divide by the world size (the "
                            "group's size()) to average, before or after the all-reduce"
                            if abs(ratio - len(results)) < 0.2 else
                            "return the all-reduced bucket divided by the world size: the mean of every "
                            "rank's gradient, as DDP computes it")
                    t.fail(hint, f"DDP's gradients within bfloat16 tolerance (rank {rank}, step {step}, "
                           f"parameter {i})", f"max difference {float((mine - ref).abs().max()):.3g}, "
                           f"norm ratio {ratio:.3f}")

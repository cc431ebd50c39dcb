"""Checks of lesson 11 (tensor parallelism): tp_mlp, tp_plan, sp_mlp, parallelize_2d, tp_bytes.

The yardsticks are one process: the unsplit MLP and block, and the same training on the
whole batch. Everything runs in real ranks with every collective recorded
(:mod:`mgpu_lab.comm.record`, which also tells each collective's group), so "one
all-reduce forward and one backward", "no all-reduce with sequence parallelism", "TP's
collectives inside the TP groups", sequence parallelism's two collectives each way and the
bytes of a block are judged from what the ranks really did. What runs in the ranks is
:mod:`.ranks`; this module judges, in the kernel.
"""
from __future__ import annotations

import functools

from .._core import exercise
from ..sim.scenarios import launch_scenarios
from . import judges
from .ranks import (MLP_SHAPES, SP_SHAPES, STEPS_2D, call_tp_bytes, measure_tp_bytes, run_2d, run_plan, run_sp_mlp,
                    run_tp_mlp)

PLANS = "mgpu_lab.tensor_parallel.plans:"


# -- tp_mlp ---------------------------------------------------------------------------------
# torch's own TP: DTensors made from the shards give the same outputs, gradients and single all-reduce each way
# (tried: 6/6 before these were listed), with the conjugate operators done by DTensor instead of the learner.
DTENSOR_TP = ("torch.distributed.tensor:DTensor.from_local", "torch.distributed.tensor:distribute_tensor",
              "torch.distributed.tensor.parallel:parallelize_module")


@exercise("11.tp_mlp", points=6, description="tp_mlp(x, w1_shard, b1_shard, w2_shard, b2) with CopyToTP and "
          "ReduceFromTP: the MLP split over TP ranks, column- then row-parallel, one all-reduce each way",
          references=DTENSOR_TP)
def _tp_mlp(t, tp_mlp, CopyToTP, ReduceFromTP):
    @functools.cache  # one launch per world size, made when the first case needs it
    def get(world):
        scenarios = ([("copy",), ("reduce",)] if world == 2 else []) + [("mlp", *s) for s in MLP_SHAPES[world]]
        return launch_scenarios(t, run_tp_mlp, world, (tp_mlp, CopyToTP, ReduceFromTP), scenarios, 90)

    with t.case("CopyToTP, 2 ranks: forward returns x unchanged with no collective; backward gives every rank the "
                "sum of the ranks' gradients (one all-reduce)"):
        judges.copy_case(t, get(2))
    with t.case("ReduceFromTP, 2 ranks: forward returns the sum over the ranks (one all-reduce); backward hands on "
                "the incoming gradient, with no collective"):
        judges.reduce_case(t, get(2))
    with t.case("2 ranks, x of shape [4, 8] and [2, 3, 8]: tp_mlp's output equals the unsplit MLP's, "
                "fc2(gelu(fc1(x))), on every rank"):
        judges.mlp_output(t, get(2), [2, 3])
    with t.case("2 ranks: the gradients of x, w1_shard, b1_shard, w2_shard and b2 equal the unsplit MLP's "
                "(the matching slices for the shards)"):
        judges.mlp_grads(t, get(2), [2, 3])
    with t.case("4 ranks, hidden 32 split in 4: the output and every gradient equal the unsplit MLP's"):
        judges.mlp_output(t, get(4), [0])
        judges.mlp_grads(t, get(4), [0])
    with t.case("exactly one all-reduce forward (the output, batch x d) and one backward (x's gradient), no other "
                "collective, on 2 and 4 ranks"):
        judges.mlp_collectives(t, get(2), [2, 3])
        judges.mlp_collectives(t, get(4), [0])


# -- tp_plan --------------------------------------------------------------------------------
@exercise("11.tp_plan", points=4, description="tp_plan(block, sequence_parallel): the parallelize_module plan of "
          "lesson 11's transformer block, with and without sequence parallelism",
          references=(PLANS + "block_plan", PLANS + "shard_2d"))
def _tp_plan(t, tp_plan):
    @functools.cache  # one launch, made when the first case needs it
    def get():
        return launch_scenarios(t, run_plan, 2, tp_plan, [False, True], 90)

    with t.case("without SP, 2 ranks: each rank holds half of every linear layer (wq, wk, wv, wo, fc1, fc2); the "
                "block's output and, after one SGD step, every weight equal one process's"):
        judges.plan_output(t, get(), 0)
        judges.plan_weights(t, get(), 0)
    with t.case("without SP: forward all-reduces the activation twice (after attention, after the MLP), backward "
                "twice too (attention's input gradient once: wq, wk and wv share it), nothing else"):
        judges.plan_collectives(t, get(), 0, "fwd")
        judges.plan_collectives(t, get(), 0, "bwd")
    with t.case("with SP, 2 ranks: a rank's slice of the sequence in, the block's output for that slice out, and "
                "after one SGD step every weight (the norms' included) equal to one process's"):
        judges.plan_output(t, get(), 1)
        judges.plan_weights(t, get(), 1)
    with t.case("with SP: no all-reduce in forward or backward, each way 2 all-gathers and 2 reduce-scatters of "
                "the activation; the norms save 1/tp of the activations one process's norms save"):
        judges.plan_collectives(t, get(), 1, "fwd")
        judges.plan_collectives(t, get(), 1, "bwd")
        judges.plan_saved(t, get())


# -- sp_mlp ---------------------------------------------------------------------------------
# torch's own SP: the styles and DTensor conversions that do it, and the collectives that come with autograd
SP_REFERENCES = DTENSOR_TP + (
    "torch.distributed.tensor.parallel:SequenceParallel", "torch.distributed.tensor:DTensor.redistribute",
    "torch.distributed.nn.functional:all_gather", "torch.distributed.nn.functional:reduce_scatter",
    "torch.distributed.nn.functional:all_reduce", "torch.distributed.nn.functional:_all_gather_base",
    "torch.distributed._functional_collectives:all_gather_tensor_autograd",
    "torch.distributed._functional_collectives:reduce_scatter_tensor_autograd")


@exercise("11.sp_mlp", points=14, description="sp_mlp(x_shard, norm, w1_shard, b1_shard, w2_shard, b2): a "
          "pre-norm MLP block with sequence parallelism by hand, on each rank's slice of the sequence",
          references=SP_REFERENCES)
def _sp_mlp(t, sp_mlp):
    @functools.cache  # one launch per world size, made when the first case needs it
    def get(world):
        return launch_scenarios(t, run_sp_mlp, world, sp_mlp, SP_SHAPES[world], 90)

    def on_four():  # 4 ranks are launched only for an answer right on 2: a wrong one learns as much a launch sooner
        if not all(c.passed for c in t.cases[:9]):  # the 9 cases above, on 2 ranks
            t.fail("not judged on 4 ranks while a 2-rank case fails (above): 4 ranks are judged once 2 are right",
                   got="not run")
        return get(4)

    two, four = [0, 1], [0]
    with t.case("2 ranks, sequences [2, 8, 6] and [3, 4, 8]: the output is this rank's slice of the unsplit "
                "block's, x + fc2(gelu(fc1(norm(x))))"):
        judges.sp_output(t, get(2), two)
    with t.case("2 ranks: x_shard's gradient equals the unsplit block's for this slice"):
        judges.sp_grads(t, get(2), two, ["x"])
    with t.case("2 ranks: the gradients of w1_shard, b1_shard and w2_shard equal the slices of the unsplit "
                "weights' gradients"):
        judges.sp_grads(t, get(2), two, ["w1", "b1", "w2"])
    with t.case("2 ranks: norm's weight and bias gradients equal the whole sequence's gradient, on every rank"):
        judges.sp_grads(t, get(2), two, ["norm.weight", "norm.bias"])
    with t.case("2 ranks: b2's gradient equals the whole sequence's gradient, on every rank"):
        judges.sp_grads(t, get(2), two, ["b2"])
    with t.case("forward: the activations cross ranks in exactly two collectives, with the bytes of an all-gather "
                "and a reduce-scatter of the sequence (no all-reduce)"):
        judges.sp_forward(t, get(2), two)
    with t.case("backward: the conjugates of forward's two collectives, besides all-reduces of the replicated "
                "weights' gradients"):
        judges.sp_backward(t, get(2), two)
    with t.case("the block right, and its norm working on this rank's slice of the sequence: it saves 1/tp of what "
                "one process's saves"):
        judges.sp_norm_slice(t, get(2), two)
    with t.case("every tensor it communicates is on the input's device (a call with torch's default device set to "
                "meta: a tensor made without device= is not on it, as a CPU tensor on a GPU rank)"):
        judges.sp_device(t, get(2), 2)
    with t.case("4 ranks: the output is this rank's slice of the unsplit block's"):
        judges.sp_output(t, on_four(), four)
    with t.case("4 ranks: the gradients of x_shard and of the shards equal the unsplit block's"):
        judges.sp_grads(t, on_four(), four, ["x", "w1", "b1", "w2"])
    with t.case("4 ranks: norm's and b2's gradients equal the whole sequence's, on every rank"):
        judges.sp_grads(t, on_four(), four, ["norm.weight", "norm.bias", "b2"])
    with t.case("4 ranks: two collectives forward, their conjugates backward, each of the sequence's bytes"):
        judges.sp_forward(t, on_four(), four)
        judges.sp_backward(t, on_four(), four)
    with t.case("4 ranks: the block right, its norm working on this rank's slice of the sequence"):
        judges.sp_norm_slice(t, on_four(), four)


# -- parallelize_2d -------------------------------------------------------------------------
@exercise("11.parallelize_2d", points=2, description="parallelize_2d(model, mesh): TP over mesh['tp'] in every "
          "block, then FSDP over mesh['dp']; 4 ranks train like one process",
          references=(PLANS + "shard_2d", PLANS + "block_plan"))
def _parallelize_2d(t, parallelize_2d):
    @functools.cache
    def get():
        return launch_scenarios(t, run_2d, 4, parallelize_2d, ["2d"], 120)

    # evidence of its own per case: the calls, placements and groups the ranks recorded; the weights after training
    with t.case("TP first, over mesh[\"tp\"], then FSDP over mesh[\"dp\"], each block a unit of its own: every "
                "parameter a DTensor on (\"dp\", \"tp\"), TP's collectives inside the TP groups ([0, 1], [2, 3]), "
                "FSDP's inside the DP groups ([0, 2], [1, 3]), gathered block by block"):
        judges.twod_order(t, get())
        judges.twod_params(t, get())
        judges.twod_groups(t, get())
        judges.twod_units(t, get())
    with t.case(f"4 ranks as (dp=2, tp=2), {STEPS_2D} SGD steps: the weights equal one process's on the whole "
                "batch"):
        judges.twod_weights(t, get(), STEPS_2D)


# -- tp_bytes -------------------------------------------------------------------------------
BYTES_SHAPES = [(3, 4, 8, 4, False), (2, 8, 16, 2, False), (1, 8, 32, 4, True), (2, 8, 16, 2, True),
                (2, 4, 16, 1, False), (2, 4, 16, 1, True), (5, 2, 8, 2, True), (4, 4, 24, 4, False)]
_MEASURED: dict = {}  # the recorder's counts for BYTES_SHAPES: the same in every check, measured once


@exercise("11.tp_bytes", points=2, description="tp_bytes(batch, seq, hidden, tp, sequence_parallel): the bytes of "
          "fp32 tensors one rank hands to collectives per block, forward plus backward")
def _tp_bytes(t, tp_bytes):
    answers = None
    with t.case("without SP, tp=1, 2 and 4: the bytes the recorder counted in a block's forward and backward (none "
                "on one rank)"):
        answers = t.call(call_tp_bytes, tp_bytes, BYTES_SHAPES)
        if "all" not in _MEASURED:
            _MEASURED["all"] = t.ranks(measure_tp_bytes, 4, BYTES_SHAPES, timeout=120)[0]
        judges.bytes_case(t, BYTES_SHAPES, answers, _MEASURED["all"], [0, 1, 4, 7])
    with t.case("with SP, tp=1, 2 and 4, several shapes: the recorder's count"):
        if answers is None or "all" not in _MEASURED:
            t.fail("the first case did not run to the end")
        judges.bytes_case(t, BYTES_SHAPES, answers, _MEASURED["all"], [2, 3, 5, 6])

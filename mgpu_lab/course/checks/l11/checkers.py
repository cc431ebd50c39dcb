"""Checks of lesson 11 (tensor parallelism): tp_mlp, tp_plan, parallelize_2d, tp_bytes.

The yardsticks are one process: the unsplit MLP and block, and the same training on the
whole batch. Everything runs in real ranks with every collective recorded
(:mod:`mgpu_lab.comm.record`, which also tells each collective's group), so "one
all-reduce forward and one backward", "no all-reduce with sequence parallelism", "TP's
collectives inside the TP groups" and the bytes of a block are judged from what the ranks
really did. What runs in the ranks is :mod:`.ranks`; this module judges, in the kernel.
"""
from __future__ import annotations

import functools

from .._core import exercise
from ..sim.scenarios import launch_scenarios
from . import judges
from .ranks import MLP_SHAPES, STEPS_2D, call_tp_bytes, measure_tp_bytes, run_2d, run_plan, run_tp_mlp

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
@exercise("11.tp_plan", points=8, description="tp_plan(block, sequence_parallel): the parallelize_module plan of "
          "lesson 11's transformer block, with and without sequence parallelism",
          references=(PLANS + "block_plan", PLANS + "shard_2d"))
def _tp_plan(t, tp_plan):
    @functools.cache  # one launch, made when the first case needs it
    def get():
        return launch_scenarios(t, run_plan, 2, tp_plan, [False, True], 90)

    with t.case("without SP, 2 ranks: each rank holds half of every linear layer (wq, wk, wv, wo, fc1, fc2) and "
                "the block's output equals one process's"):
        judges.plan_output(t, get(), 0)
    with t.case("without SP: after one SGD step every rank's weights equal one process's (the matching slices)"):
        judges.plan_weights(t, get(), 0)
    with t.case("without SP: forward all-reduces the activation twice (after attention, after the MLP), nothing "
                "else"):
        judges.plan_collectives(t, get(), 0, "fwd")
    with t.case("without SP: backward all-reduces twice too: the gradient of attention's input once (wq, wk and "
                "wv share it), the MLP's once"):
        judges.plan_collectives(t, get(), 0, "bwd")
    with t.case("with SP, 2 ranks: a rank's slice of the sequence in, the block's output for that slice out, "
                "equal to one process's, with the linear layers split"):
        judges.plan_output(t, get(), 1)
    with t.case("with SP: after one SGD step every weight equals one process's, the norms' included"):
        judges.plan_weights(t, get(), 1)
    with t.case("with SP: no all-reduce in forward or backward; each way 2 all-gathers and 2 reduce-scatters of "
                "the activation"):
        judges.plan_collectives(t, get(), 1, "fwd")
        judges.plan_collectives(t, get(), 1, "bwd")
    with t.case("with SP: the block right and its norms saving 1/tp of the activations one process's norms save"):
        judges.plan_saved(t, get())


# -- parallelize_2d -------------------------------------------------------------------------
@exercise("11.parallelize_2d", points=5, description="parallelize_2d(model, mesh): TP over mesh['tp'] in every "
          "block, then FSDP over mesh['dp']; 4 ranks train like one process",
          references=(PLANS + "shard_2d", PLANS + "block_plan"))
def _parallelize_2d(t, parallelize_2d):
    @functools.cache
    def get():
        return launch_scenarios(t, run_2d, 4, parallelize_2d, ["2d"], 120)

    with t.case("TP first, over mesh[\"tp\"], then FSDP over mesh[\"dp\"] (the order of the calls and their meshes)"):
        judges.twod_order(t, get())
    with t.case("every parameter is a DTensor on the (\"dp\", \"tp\") mesh, the linear layers split over \"tp\""):
        judges.twod_params(t, get())
    with t.case(f"4 ranks as (dp=2, tp=2), {STEPS_2D} SGD steps: the weights equal one process's on the whole "
                "batch"):
        judges.twod_weights(t, get(), STEPS_2D)
    with t.case("TP's collectives run inside the TP groups ([0, 1], [2, 3]), FSDP's inside the DP groups ([0, 2], "
                "[1, 3]), none over all 4 ranks"):
        judges.twod_groups(t, get())
    with t.case("each block is an FSDP unit of its own: gathered over \"dp\" block by block, forward and backward"):
        judges.twod_units(t, get())


# -- tp_bytes -------------------------------------------------------------------------------
BYTES_SHAPES = [(3, 4, 8, 4, False), (2, 8, 16, 2, False), (1, 8, 32, 4, True), (2, 8, 16, 2, True),
                (2, 4, 16, 1, False), (2, 4, 16, 1, True), (5, 2, 8, 2, True), (4, 4, 24, 4, False)]
_MEASURED: dict = {}  # the recorder's counts for BYTES_SHAPES: the same in every check, measured once


@exercise("11.tp_bytes", points=4, description="tp_bytes(batch, seq, hidden, tp, sequence_parallel): the bytes of "
          "fp32 tensors one rank hands to collectives per block, forward plus backward")
def _tp_bytes(t, tp_bytes):
    answers = None
    with t.case("without SP, tp=2 and tp=4: the bytes the recorder counted in a block's forward and backward"):
        answers = t.call(call_tp_bytes, tp_bytes, BYTES_SHAPES)
        if "all" not in _MEASURED:
            _MEASURED["all"] = t.ranks(measure_tp_bytes, 4, BYTES_SHAPES, timeout=120)[0]
        judges.bytes_case(t, BYTES_SHAPES, answers, _MEASURED["all"], [0, 1])
    for name, picks, hidden in (("with SP, tp=2 and tp=4: the recorder's count", [2, 3], False),
                                ("tp=1, with and without SP: a block on one rank hands nothing to collectives",
                                 [4, 5], False),
                                ("two more shapes", [6, 7], True)):
        with t.case(name, hidden=hidden):
            if answers is None or "all" not in _MEASURED:
                t.fail("the first case did not run to the end")
            judges.bytes_case(t, BYTES_SHAPES, answers, _MEASURED["all"], picks)

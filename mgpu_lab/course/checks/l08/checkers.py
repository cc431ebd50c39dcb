"""Checks of lesson 08 (sharding): sharded_sgd_step, ShardedAdam, build_sharded, load_full_into_sharded.

The references are the real thing: SGD on the mean gradient and the collectives
the learner's step issued (sharded_sgd_step); DDP + ``torch.optim.Adam`` in the
same ranks, the Adam state each rank keeps and what a step moves (ShardedAdam);
``model_fn()`` on one process, the parameter storage live on each rank while it
builds, the all-gathers of a step and single-process training (build_sharded);
the file's tensors, the files each rank opened and the storage it allocated
(load_full_into_sharded). What runs in the ranks is :mod:`.ranks`; this module
judges, in the kernel.
"""
from __future__ import annotations

from .._core import exercise
from .judges import (judge_adam, judge_adam_state, judge_adam_traffic, judge_built_sharded, judge_collectives,
                     judge_gathers, judge_init, judge_live, judge_loaded, judge_not_full, judge_opened,
                     judge_own_shard, judge_own_shards, judge_pair, judge_replicas, judge_result, judge_sharding, need,
                     judge_mini_gathers, judge_mini_half, judge_mini_held, judge_mini_peak, judge_mini_reduce,
                     judge_mini_shards, judge_mini_dtypes, judge_mini_weights, SGD_CASES, SGD_LR)
from .ranks import (ADAM_WORLD, BUILD_STEPS, run_adam_state, run_build_sharded, run_load_full, run_sgd_cases,
                    run_minifsdp, run_sharded_adam)

FLAT = ("mgpu_lab.sharding.flat:FlatZero", "mgpu_lab.sharding.flat:FlatZero.step")


# -- sharded_sgd_step ----------------------------------------------------------------------
@exercise("08.sharded_sgd_step", points=7, references=FLAT,
          description="sharded_sgd_step(param, grad, lr): one SGD step of a flat parameter, ZeRO's way: each rank "
                      "receives the summed gradient of its own block only, updates that block, and every rank ends "
                      "with the whole new parameter")
def _sharded_sgd_step(t, sharded_sgd_step):
    results = None
    with t.case("3 ranks, 12 elements: every rank returns param - lr x the mean of the 3 ranks' gradients"):
        results = t.ranks(run_sgd_cases, 3, sharded_sgd_step, SGD_CASES, SGD_LR, timeout=90)
        judge_result(t, results, 0)
    cases = [
        ("3 ranks, 10 elements (not a multiple of 3): the collectives move 12, the result has 10", judge_result, 1,
         "a reduce-scatter cuts its input into world_size equal blocks: 10 elements on 3 ranks cannot be cut so, "
         "and the collective refuses them; the parameter is padded for the collectives and the padding is not "
         "part of the result"),
        ("its collectives: one reduce-scatter and one all-gather of the padded size (12), no all-reduce",
         judge_collectives, 1, ""),
        ("each rank updates only its own block: rank r all-gathers param[4r:4r+4] - lr x its mean gradient",
         judge_own_shard, 1, ""),
        ("3 ranks, 2 elements: the last rank's shard is all padding", judge_result, 2,
         "with fewer elements than ranks a shard is 1 element and some ranks hold only padding"),
        ("float64 inputs: the buffers and the result are float64 too", judge_result, 3,
         "a buffer your step made has torch's default dtype (float32) beside float64 data: the collective "
         "refuses the mix; every tensor your step makes takes the dtype of the inputs"),
        ("buffers made on the inputs' device: run with torch's default device set to 'meta'", judge_result, 4,
         "a tensor your step made landed on torch's default device ('meta' here), not on the inputs' device: on a "
         "GPU machine the same tensor is a CPU tensor beside cuda ones, and NCCL refuses it; every tensor your "
         "step makes takes the device of the inputs"),
    ]
    for name, judge, k, hint in cases:
        with t.case(name, hint=hint):
            need(t, results)
            judge(t, results, k)


# -- ShardedAdam ---------------------------------------------------------------------------
@exercise("08.ShardedAdam", points=6, references=(
    "torch.distributed.optim:ZeroRedundancyOptimizer", "mgpu_lab.sharding.flat:FlatZero",
    "mgpu_lab.sharding.flat:FlatZero.step"),
    description="ShardedAdam(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0): ZeRO-1 after DDP, "
                "each rank keeping Adam state for the parameters it owns only and sharing the updated ones")
def _sharded_adam(t, ShardedAdam):
    ranks = None
    with t.case(f"{ADAM_WORLD} ranks, DDP, 5 steps at lr=1e-2: every rank's weights equal DDP + torch.optim.Adam's "
                "(to 1e-6)"):
        ranks = t.ranks(run_sharded_adam, ADAM_WORLD, ShardedAdam, timeout=120)
        judge_adam(t, ranks, 0)
    first_passed = t.cases[-1].passed
    with t.case("betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1: equal to torch.optim.Adam's with them (to 1e-6)"):
        need(t, ranks)
        judge_adam(t, ranks, 1, hint="the default settings passed: a setting given to the constructor is not used "
                   "as torch.optim.Adam uses it" if first_passed else "")
    with t.case("two ShardedAdams alive at once, stepped in turn, the second over two parameter groups with their "
                "own lr, betas and weight_decay: each equal to torch.optim.Adam's (to 1e-6)"):
        need(t, ranks)
        judge_pair(t, ranks)
    with t.case("the replicas stay equal: after the steps every rank holds the same weights"):
        need(t, ranks)
        judge_replicas(t, ranks)
    with t.case("each rank keeps Adam state only for the parameters it owns: at most its share of the elements "
                "plus one parameter, each parameter's state on one rank"):
        need(t, ranks)
        judge_adam_state(t, ranks)
        judge_adam_state(t, t.ranks(run_adam_state, 2, ShardedAdam, timeout=120))
    with t.case("a step moves only the updated parameters, once: no all-reduce (DDP has averaged the gradients)"):
        need(t, ranks)
        judge_adam_traffic(t, ranks)


# -- build_sharded -------------------------------------------------------------------------
@exercise("08.build_sharded", points=5, references=("mgpu_lab.sharding.wrap:shard_model",),
          description="build_sharded(model_fn, mesh): the model of model_fn() sharded with FSDP2 block by block, "
                      "its weights those of model_fn() on one process, without any rank ever holding the whole model")
def _build_sharded(t, build_sharded):
    ranks = None
    with t.case("returns the model sharded over the mesh passed in: each block of model.blocks and the root FSDP "
                "modules, every parameter a DTensor Shard(dim=0) on that mesh"):
        ranks = t.ranks(run_build_sharded, 2, build_sharded, timeout=120)
        judge_sharding(t, ranks[0], ["(root)"] + [f"blocks.{i}" for i in range(ranks[0]["sizes"]["blocks"])])
        judge_built_sharded(t, ranks)
    with t.case("no rank ever holds the whole model: the parameter storage live on each rank peaks at its shards "
                "plus room for three blocks"):
        need(t, ranks)
        judge_live(t, ranks)
    with t.case("the weights, gathered, equal model_fn()'s on one process (to 1e-6), also for a model that makes "
                "its head first and registers it last"):
        need(t, ranks)
        if "diff" not in ranks[0]:
            t.fail("", "a model", ranks[0]["returned"])
        judge_init(t, ranks[0])
    with t.case("a forward all-gathers block by block: one all-gather per block and one for the root's own "
                "parameters, none of the whole model"):
        need(t, ranks)
        if "forward" not in ranks[0]:
            t.fail("", "a model", ranks[0]["returned"])
        judge_gathers(t, ranks[0]["forward"], "all_gather", ranks[0]["sizes"])
        judge_built_sharded(t, ranks)
    with t.case(f"{BUILD_STEPS} SGD steps on 2 ranks x 4 samples end with the weights of 1 process x 8 samples "
                "from model_fn() (to 1e-5)",
                hint="the sharded model does not train like the one process: parameters registered after "
                     "fully_shard, or values written outside the shards FSDP2 manages, are not what it gathers"):
        need(t, ranks)
        if "trained" not in ranks[0]:
            t.fail("", "a model", ranks[0]["returned"])
        worst = max(ev["trained"] for ev in ranks)
        if worst > 1e-5:
            t.fail("", "max difference <= 1e-05", f"max difference {worst:.3g}")
        judge_built_sharded(t, ranks)


# -- load_full_into_sharded ----------------------------------------------------------------
@exercise("08.load_full_into_sharded", points=2,
          description="load_full_into_sharded(model, path): a full torch.save checkpoint into an FSDP2-sharded "
                      "model; only rank 0 reads the file, every rank ends with its shards, no other rank holds the "
                      "full state")
def _load_full_into_sharded(t, load_full_into_sharded):
    path = t.scratch("mgpu-lab-08-full-")  # where the ranks run (a grader's sandbox)
    ranks = None
    with t.case("2 ranks: after loading, every parameter (gathered) equals the file's, and every rank holds exactly "
                "its shards: DTensors Shard(dim=0) on the model's mesh, rank r's rows chunk r of the file's tensor"):
        ranks = t.ranks(run_load_full, 2, load_full_into_sharded, f"{path}/full.pt", timeout=120)
        judge_loaded(t, ranks)
        judge_own_shards(t, ranks)
    with t.case("only rank 0 opens the file, and no rank but 0 ever holds the full state (rank 1's live storage "
                "stays under half of it)"):
        need(t, ranks)
        judge_opened(t, ranks)
        judge_not_full(t, ranks)


# -- MiniFSDP ------------------------------------------------------------------------------
@exercise("08.MiniFSDP", points=20, references=(
    "torch.distributed.fsdp:fully_shard", "torch.distributed.fsdp:FullyShardedDataParallel",
    "torch.distributed.optim:ZeroRedundancyOptimizer", "mgpu_lab.sharding.flat:FlatZero",
    "mgpu_lab.sharding.flat:FlatZero.step", "mgpu_lab.sharding.wrap:shard_model"),
    description="MiniFSDP(module, compute_dtype=None): ZeRO-3 by hand, each rank holding a shard of every "
                "parameter, full weights only for the unit computing, gradients reduce-scattered to the shards")
def _mini_fsdp(t, MiniFSDP):
    # Every case of 2 ranks is judged on their launch before the 3 ranks are launched: an answer wrong on 2 ranks
    # is told so by the cases of 2 ranks alone, and the cases of 3 ranks (sizes 3 does not divide) say what only
    # an uneven split shows.
    two = three = None
    with t.case("2 ranks, 2 steps of SGD (momentum 0.9), default device 'meta' in forward and backward: "
                "gather_full_params() equals one process on the whole batch (1e-5)", points=2):
        two = t.ranks(run_minifsdp, 2, MiniFSDP, timeout=240)
        judge_mini_weights(t, two, "SGD", tol=1e-5)
    with t.case("2 ranks, Adam and AdamW: equal to one process within 2x the distance fully_shard meets "
                "(measured in the same ranks)", points=2):
        _ran(t, two, 2)
        judge_mini_weights(t, two, "AdamW", factor=2.0)
        judge_mini_weights(t, two, "Adam", factor=2.0, measured="AdamW")
    _mini_dtype_cases(t, two, 2, "bfloat16")
    _mini_layout_cases(t, two, 2)
    with t.case("3 ranks, sizes 3 does not divide, SGD and AdamW: equal to one process", points=2):
        three = t.ranks(run_minifsdp, 3, MiniFSDP, timeout=240)
        judge_mini_weights(t, three, "SGD", tol=1e-5)
        judge_mini_weights(t, three, "AdamW", factor=2.0)
    _mini_dtype_cases(t, three, 3, "float16")
    _mini_layout_cases(t, three, 3)


def _mini_dtype_cases(t, ranks, world: int, dtype: str) -> None:
    with t.case(f"{world} ranks, compute_dtype {dtype}: equal to one process computing every layer in {dtype} on "
                f"fp32 master weights, within 4x fully_shard's distance with that MixedPrecisionPolicy; every "
                f"all-gather in {dtype} (half the bytes of fp32)"):
        _ran(t, ranks, world)
        judge_mini_weights(t, ranks, dtype, factor=4.0)
        judge_mini_half(t, ranks, dtype, dtype)
    with t.case(f"{world} ranks, gather_full_params(): every parameter of the module by its name there, whole, in "
                f"fp32 (also with compute_dtype {dtype})"):
        _ran(t, ranks, world)
        for name in (("SGD", dtype) if world == 2 else (dtype,)):
            judge_mini_dtypes(t, ranks, name)


def _mini_layout_cases(t, ranks, world: int) -> None:
    """Where the weights and gradients are, and how they travel, on ``world`` ranks."""
    with t.case(f"{world} ranks, parameters() are this rank's shards: about 1/{world} of the elements"):
        _ran(t, ranks, world)
        judge_mini_shards(t, ranks)
    with t.case(f"{world} ranks, between steps the storage alive on each rank is its shards (about 1/{world} of the "
                "model), never the whole"):
        _ran(t, ranks, world)
        judge_mini_held(t, ranks)
    with t.case(f"{world} ranks, during forward and backward, beyond the shards and the activations, at most one "
                "unit's full weights (with their gradients and a collective's buffers)"):
        _ran(t, ranks, world)
        judge_mini_peak(t, ranks, "AdamW")
    with t.case(f"{world} ranks, weights all-gathered in units of at most a layer, in forward and again in backward"):
        _ran(t, ranks, world)
        judge_mini_gathers(t, ranks, "AdamW")
    with t.case(f"{world} ranks, gradients reach the shards by reduce-scatter, about the model's size per step, no "
                "all-reduce"):
        _ran(t, ranks, world)
        judge_mini_reduce(t, ranks, "AdamW")


def _ran(t, ranks, world: int) -> None:
    if ranks is None:
        t.fail(f"not judged: the case that ran the {world} ranks did not finish (see it above)")

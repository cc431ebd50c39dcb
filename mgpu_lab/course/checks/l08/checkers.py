"""Checks of lesson 08 (sharding): zero_memory, sharded_sgd_step, shard_model, dcp_checkpoint.

The references are the real thing: the bytes real ranks hold (zero_memory),
SGD on the mean gradient and the collectives the learner's step issued
(sharded_sgd_step), single-process training and the all-gathers FSDP2 issues
(shard_model), the tensors a checkpoint held before it was saved and the
slices DCP wrote (dcp_checkpoint). What runs in the ranks is :mod:`.ranks`;
this module judges, in the kernel.
"""
from __future__ import annotations

import functools

from mgpu_lab.sharding import fsdp
from .._core import exercise
from .judges import (zero_groups, judge_collectives, judge_dcp, judge_gathers, judge_measured, judge_own_shard,
                     judge_raises, judge_result, judge_values, need, SGD_CASES, SGD_LR)
from .ranks import (evaluate_calls, measure_zero, reference_shard_model, run_dcp_load, run_dcp_save, run_sgd_cases,
                    run_shard_model)


# -- zero_memory ---------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def measured_zero() -> dict:
    """What 4 real ranks hold under DDP, ZeRO-1, ZeRO-2 (by hand) and FSDP2 (rank 0's numbers); cached."""
    from mgpu_lab.launcher.launch import run

    return run(measure_zero, 4, backend="gloo", quiet=True, echo=False, timeout=180)[0]


BAD = [((1000, 4, 4), {}), ((1000, 4, -1), {}), ((0, 4, 1), {}), ((1000, 0, 2), {}), ((-8, 2, 0), {}),
       ((10, 4, 3), {"param_bytes": 0}), ((10, 4, 2), {"optim_bytes": -8})]


@exercise("08.zero_memory", points=9, description="zero_memory(n_params, world_size, stage, param_bytes=4, "
          "grad_bytes=4, optim_bytes=8): bytes one rank holds under ZeRO stage 0-3, shards rounded up")
def _zero_memory(t, zero_memory):
    n_measured = fsdp.BlockNet.count(features=6, width=9, depth=2, classes=3)
    groups = zero_groups(n_measured)
    calls = [c for _, cs, _ in groups if cs for c in cs] + BAD
    results, start = None, 0
    for name, cs, hint in groups:
        with t.case(name, hidden=hint == "hidden", hint="" if hint in ("hidden", "measured") else hint):
            if results is None:
                results = t.call(evaluate_calls, zero_memory, calls)
            if cs is None:
                judge_raises(t, BAD, results[-len(BAD):])
            elif hint == "measured":
                judge_measured(t, cs, results[start:start + len(cs)], measured_zero())
            else:
                judge_values(t, cs, results[start:start + len(cs)], hint if hint != "hidden" else "")
        start += len(cs or [])


# -- sharded_sgd_step ----------------------------------------------------------------------
@exercise("08.sharded_sgd_step", points=7, description="sharded_sgd_step(param, grad, lr): reduce-scatter the "
          "padded gradient, SGD on this rank's shard, all-gather the full parameter")
def _sharded_sgd_step(t, sharded_sgd_step):
    results = None
    with t.case("3 ranks, 12 elements: every rank returns param - lr x the mean of the 3 ranks' gradients",
                hint="reduce-scatter the gradient, divide by world_size, update your block of the parameter, "
                     "all-gather the blocks"):
        results = t.ranks(run_sgd_cases, 3, sharded_sgd_step, SGD_CASES, SGD_LR, timeout=90)
        judge_result(t, results, 0)
    cases = [
        ("3 ranks, 10 elements (not a multiple of 3): the gradient padded to 12 for the collectives, "
         "the result 10 elements", judge_result, 1,
         "pad to a multiple of world_size first (F.pad(grad, (0, pad))): a reduce-scatter needs world_size equal "
         "blocks; cut the padding off the result"),
        ("its collectives: one reduce-scatter and one all-gather of the padded size (12), no all-reduce",
         judge_collectives, 1, ""),
        ("each rank updates only its own block: rank r all-gathers param[4r:4r+4] - lr x its mean gradient",
         judge_own_shard, 1, ""),
        ("3 ranks, 2 elements: the last rank's shard is all padding", judge_result, 2,
         "with n < world_size a shard is 1 element and some ranks hold only padding"),
        ("float64 inputs: the buffers and the result are float64 too", judge_result, 3,
         "make buffers like the inputs: torch.empty(shard, dtype=grad.dtype, device=grad.device), "
         "grad.new_empty(shard) or torch.empty_like; a float32 buffer beside float64 data fails in the collective"),
        ("buffers made on the inputs' device: run with torch's default device set to 'meta'", judge_result, 4,
         "every new tensor needs device=grad.device (or grad.new_empty, torch.empty_like, F.pad): here a tensor "
         "made without it lands on 'meta' instead of the CPU, as on a GPU it lands on the CPU beside cuda "
         "tensors, and NCCL refuses it"),
    ]
    for name, judge, k, hint in cases:
        with t.case(name, hint=hint):
            if results is None:
                t.fail("the first case did not finish")
            judge(t, results, k)


# -- shard_model ---------------------------------------------------------------------------
SHARD_STEPS, SHARD_LR = 3, 0.5


@exercise("08.shard_model", points=5, description="shard_model(model, mesh): fully_shard every block of "
          "model.blocks, then the root; DTensor parameters, block-by-block all-gathers, single-process training")
def _shard_model(t, shard_model):
    ev = None
    with t.case("returns the model; each block of model.blocks and the model itself are FSDP modules",
                hint="for block in model.blocks: fully_shard(block, mesh=mesh); then fully_shard(model, mesh=mesh) "
                     "(bottom-up: the blocks first); return model"):
        ev = t.ranks(run_shard_model, 2, shard_model, SHARD_STEPS, SHARD_LR, timeout=90)[0]
        want = ["(root)", "blocks.0", "blocks.1", "blocks.2"]
        if not ev["is_model"]:
            t.fail("", "the model passed in", f"a {ev['returned']}")
        if ev["fsdp"] != want:
            t.fail("", want, ev["fsdp"])
    with t.case("every parameter is a DTensor sharded Shard(dim=0) over the mesh passed in",
                hint="pass mesh=mesh to every fully_shard call: without it fully_shard builds its own mesh on "
                     "the accelerator (CUDA on a GPU machine, even when the ranks run gloo on the CPU)"):
        need(t, ev)
        for name, p in ev["params"].items():
            if not p["dtensor"]:
                t.fail(f"{name} is a plain {p['type']}: call fully_shard(model, mesh=mesh) after the blocks, so "
                       "the root's own parameters (inp, head) are sharded too", "DTensor", p["type"])
            if not p["shard0"] or not p["given_mesh"]:
                t.fail("", f"{name}: [Shard(dim=0)] on the mesh passed in", f"{p['placements']} on {p['mesh']}")
    with t.case("a forward all-gathers block by block: one all-gather per block and one for the root's own "
                "parameters, none of the whole model",
                hint="fully_shard each block before the root: the root alone is one all-gather of everything, "
                     "so every rank holds the whole model at once"):
        need(t, ev)
        judge_gathers(t, ev["forward"], "all_gather", ev["sizes"])
    with t.case("backward reduce-scatters the gradients block by block", hint="the same grouping: one "
                "reduce-scatter per fully_shard call"):
        need(t, ev)
        judge_gathers(t, ev["backward"], "reduce_scatter", ev["sizes"])
    with t.case(f"{SHARD_STEPS} SGD steps on 2 ranks x 4 samples end with the weights of 1 process x 8 samples "
                "(to 1e-5)", hint="shard with the defaults (fp32 parameters): a mixed-precision policy changes the "
                                  "numbers; no copies of the model"):
        need(t, ev)
        ref = reference_shard_model(SHARD_STEPS, SHARD_LR)
        worst = max((ev["trained"][k] - v).abs().max().item() for k, v in ref.items())
        if worst > 1e-5:
            t.fail("", "max difference <= 1e-05", f"max difference {worst:.3g}")


# -- dcp_checkpoint ------------------------------------------------------------------------
@exercise("08.dcp_checkpoint", points=5, description="save_checkpoint(model, optimizer, path) and "
          "load_checkpoint(model, optimizer, path) with torch.distributed.checkpoint: saved by 4 ranks, "
          "loaded by 2 and 4, no rank gathers the full state")
def _dcp_checkpoint(t, save_checkpoint, load_checkpoint):
    path = t.scratch("mgpu-lab-08-dcp-")  # where the ranks run (a grader's sandbox)
    saved = loaded2 = None
    with t.case("4 ranks save: a DCP checkpoint in path, a .metadata file and one __<rank>_0.distcp per rank",
                hint="in every rank: model_state, optim_state = get_state_dict(model, optimizer); "
                     "dcp.save({'model': model_state, 'optim': optim_state}, checkpoint_id=path)"):
        saved = t.ranks(run_dcp_save, 4, save_checkpoint, load_checkpoint, path, timeout=150)
        judge_dcp(t, "files", saved)
    for name, what, hint in [
        ("no rank gathered the full state: every tensor of 4+ rows is stored as 4 slices, one in each rank's "
         "file", "sharded", "get_state_dict(model, optimizer) with the default options: each rank keeps its "
         "shards (DTensors); StateDictOptions(full_state_dict=True) gathers every tensor first"),
        ("the optimizer state is saved: exp_avg and exp_avg_sq of every parameter", "optim",
         "save both state dicts get_state_dict returns: the model's and the optimizer's"),
        ("loaded into 4 fresh ranks: every model and optimizer tensor equals the saved one", "load4",
         "in every rank: state = {'model': ..., 'optim': ...} from get_state_dict(model, optimizer) (the "
         "optimizer's own state_dict() is keyed by numbers and empty before its first step), with the keys "
         "you saved; dcp.load(state, checkpoint_id=path); set_state_dict(model, optimizer, "
         "model_state_dict=state['model'], optim_state_dict=state['optim'])"),
    ]:
        with t.case(name, hint=hint):
            need(t, saved)
            judge_dcp(t, what, saved)
    with t.case("loaded into 2 ranks (resharded from 4): every tensor equals the saved one",
                hint="DCP reshards when every rank loads into its own sharded state dict: no path per rank, "
                     "no torch.load"):
        need(t, saved)
        if saved[0].get("layout") is None or "load_error" in saved[0] or saved[0].get("loaded") is None:
            t.fail("not run: saving and loading on 4 ranks must work first")
        loaded2 = t.ranks(run_dcp_load, 2, load_checkpoint, path, timeout=150)
        judge_dcp(t, "load2", saved, loaded2)

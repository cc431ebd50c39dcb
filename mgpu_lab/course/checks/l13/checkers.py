"""Checks of lesson 13 (where the time and the memory go): exposed_comm, saved_bytes, checkpoint_under, find_straggler.

``13.exposed_comm`` reads real traces: the check records profiled DDP steps in 2 real ranks
once per check (several buckets, one bucket, ``no_sync``, a helper thread) and runs the
learner's function on every trace in the same ranks; each answer is judged against the
reference computed on the same trace, since no two profiled runs on a shared machine take the
same time. ``13.saved_bytes`` and ``13.checkpoint_under`` run in one fresh process each, on
known models, against the references in :mod:`.ranks`. ``13.find_straggler`` is judged on DDP runs
recorded at check time, all of one world size in one launch (2 ranks, then 4): a slow loader,
extra compute and a larger batch on a rank drawn at random, and balanced ranks; each recording
is judged only once the reference reads its design in it with a margin (else it is recorded
again), and the answers run in one fresh process on all recordings.
"""
from __future__ import annotations

from .._core import exercise
from . import judges
from .ranks import (REFERENCES, cached_stragglers, record_stragglers, run_checkpoint, run_exposed, run_find_straggler,
                    run_saved, straggler_plan)


@exercise("13.exposed_comm", points=2, description="exposed_comm(trace, rank_thread=None): milliseconds of "
          "communication in a Chrome trace that the main thread's computing does not hide",
          references=("mgpu_lab.course.checks.l13.judges:reference_exposed_comm",))
def _exposed_comm(t, exposed_comm):
    runs, said = None, set()  # said: the hints given so far, each given once
    with t.case("DDP in 2 ranks: buckets whose all-reduces overlap backward, one bucket all-reduced after backward, "
                "no_sync accumulation: each rank's trace as the reference reads it; and 0.0 for a step with no "
                "collective"):
        runs = t.ranks(run_exposed, 2, exposed_comm, timeout=120)
        judges.exposed_case(t, runs, {"overlap", "no collective"}, said=said)
        judges.exposed_case(t, runs, {"one bucket"}, said=said)
        judges.exposed_case(t, runs, {"no_sync"}, said=said)
    with t.case("a helper thread computes beside the training loop: without rank_thread, the main thread is the "
                "one with the most operator time; with rank_thread (the training loop's thread, then the helper's), "
                "only that thread's operators hide communication"):
        judges.exposed_case(t, runs, {"helper"}, said=said)
        judges.exposed_case(t, runs, {"helper"}, "training", said)
        judges.exposed_case(t, runs, {"helper"}, "helper", said)
        judges.threads_matter(t, runs)


@exercise("13.saved_bytes", points=2, description="saved_bytes(model, x): bytes autograd saves for backward per "
          "top-level module, each storage once, for the first module that saves it",
          references=REFERENCES)
def _saved_bytes(t, saved_bytes):
    runs = None
    cases = [
        (("mlp", "bf16", "blocks"), "Linear, ReLU, Flatten, Linear: inputs, weights and ReLU's output, each storage "
                                    "once, 0 for Flatten; a bfloat16 model: bytes, 2 per element; two transformer "
                                    "blocks: per block, as the reference counts"),
        (("views", "tied"), "slices and a transpose of one tensor saved: its whole storage, once; an encoder and a "
                            "decoder sharing one weight: counted once, for the encoder"),
    ]
    for names, title in cases:
        with t.case(title):
            if runs is None:
                runs = t.call(run_saved, saved_bytes, timeout=90)
            for name in names:
                judges.saved_case(t, runs, name)


@exercise("13.checkpoint_under", points=4, description="checkpoint_under(model, x, budget_bytes): checkpoint the "
          "fewest of model.blocks so the saved bytes fit the budget; ValueError when no choice can",
          references=REFERENCES)
def _checkpoint_under(t, checkpoint_under):
    runs = None
    with t.case("a budget the model meets already: no block checkpointed; a budget one block meets: that block, "
                "the one that saves most"):
        runs = t.call(run_checkpoint, checkpoint_under, timeout=120)
        judges.ckpt_fits(t, runs, "met already")
        judges.ckpt_fits(t, runs, "one block")
    with t.case("a budget exactly equal to the saved bytes with two blocks checkpointed: it fits, with two blocks"):
        judges.ckpt_fits(t, runs, "two blocks, exactly")
    with t.case("after checkpointing, the output and every gradient equal the unmodified model's (the first "
                "block's too, whose input needs no gradient)"):
        judges.ckpt_grads(t, runs, ("one block", "two blocks, exactly"))
    with t.case("a budget below what every block checkpointed saves: ValueError naming that smallest size"):
        judges.ckpt_unreachable(t, runs)


def _stragglers(t, find_straggler) -> dict:
    """Record every scenario of 2 ranks in one launch, then of 4 ranks in another (or take the tests' cached
    recordings), and run the answer on each recording in one fresh process."""
    recorded = {}
    for world in (2, 4):
        recorded[world] = t.local(cached_stragglers, world) or t.ranks(
            record_stragglers, world, find_straggler, straggler_plan(world), t.scratch("mgpu-lab-l13-stragglers-"),
            timeout=300)[0]
    answers = t.call(run_find_straggler, find_straggler, {w: [{"paths": s["paths"]} for s in r]
                                                          for w, r in recorded.items()}, timeout=120)
    return {w: {"recorded": recorded[w], "answers": answers[w]} for w in recorded}


@exercise("13.find_straggler", points=8, description="find_straggler(traces): from every rank's Chrome trace of a "
          "few DDP steps, the rank that slows the job and whether its data loading or its forward/backward is the "
          "cause, or None", references=("mgpu_lab.course.checks.l13.judges:reference_find_straggler",
                                        "mgpu_lab.course.checks.l13.judges:straggler_reading",
                                        "mgpu_lab.course.checks.l13.judges:rank_rows",
                                        "mgpu_lab.course.checks.l13.judges:step_times"))
def _find_straggler(t, find_straggler):
    evidence, said = None, set()
    for world in (2, 4):
        for kind, title in (("loader", "a slow loader on one rank: that rank, \"data\""),
                            ("compute", "extra compute in one rank's forward and backward: that rank, \"compute\""),
                            ("batch", "a larger batch on one rank: that rank, \"compute\""),
                            ("balanced", "balanced ranks: None, None")):
            with t.case(f"{world} ranks, {title}"):
                if evidence is None:
                    evidence = _stragglers(t, find_straggler)
                judges.straggler_case(t, evidence, world, kind, said)

"""Checks of lesson 13 (where the time and the memory go): exposed_comm, saved_bytes, checkpoint_under.

``13.exposed_comm`` reads real traces: the check records profiled DDP steps in 2 real ranks
once per check (several buckets, one bucket, ``no_sync``, a helper thread) and runs the
learner's function on every trace in the same ranks; each answer is judged against the
reference computed on the same trace, since no two profiled runs on a shared machine take the
same time. ``13.saved_bytes`` and ``13.checkpoint_under`` run in one fresh process each, on
known models, against the references in :mod:`.ranks`.
"""
from __future__ import annotations

from .._core import exercise
from . import judges
from .ranks import REFERENCES, run_checkpoint, run_exposed, run_saved


@exercise("13.exposed_comm", points=5, description="exposed_comm(trace, rank_thread=None): milliseconds of "
          "communication in a Chrome trace that the main thread's computing does not hide",
          references=("mgpu_lab.course.checks.l13.judges:reference_exposed_comm",))
def _exposed_comm(t, exposed_comm):
    runs, said = None, set()  # said: the hints given so far, each given once
    with t.case("DDP in 2 ranks, buckets whose all-reduces overlap backward: each rank's trace as the reference "
                "reads it; and 0.0 for a step with no collective"):
        runs = t.ranks(run_exposed, 2, exposed_comm, timeout=120)
        judges.exposed_case(t, runs, {"overlap", "no collective"}, said=said)
    with t.case("DDP with one bucket, all-reduced after backward: mostly exposed"):
        judges.exposed_case(t, runs, {"one bucket"}, said=said)
    with t.case("no_sync accumulation, then a synchronised micro-batch"):
        judges.exposed_case(t, runs, {"no_sync"}, said=said)
    with t.case("a helper thread computes beside the training loop: without rank_thread, the main thread is the "
                "one with the most operator time"):
        judges.exposed_case(t, runs, {"helper"}, said=said)
    with t.case("rank_thread given (the training loop's thread, then the helper's): only that thread's operators "
                "hide communication"):
        judges.exposed_case(t, runs, {"helper"}, "training", said)
        judges.exposed_case(t, runs, {"helper"}, "helper", said)
        judges.threads_matter(t, runs)


@exercise("13.saved_bytes", points=5, description="saved_bytes(model, x): bytes autograd saves for backward per "
          "top-level module, each storage once, for the first module that saves it",
          references=REFERENCES)
def _saved_bytes(t, saved_bytes):
    runs = None
    cases = [
        ("mlp", "Linear, ReLU, Flatten, Linear: inputs, weights and ReLU's output, each storage once; 0 for "
                "Flatten"),
        ("views", "slices and a transpose of one tensor saved: its whole storage, once"),
        ("tied", "an encoder and a decoder sharing one weight: counted once, for the encoder"),
        ("bf16", "a bfloat16 model: bytes, 2 per element"),
        ("blocks", "two transformer blocks: per block, as the reference counts"),
    ]
    for name, title in cases:
        with t.case(title):
            if runs is None:
                runs = t.call(run_saved, saved_bytes, timeout=90)
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

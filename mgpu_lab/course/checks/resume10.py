"""Check of lesson 10's resumable_train: real ranks killed with SIGKILL, restarted, compared step by step.

The reference is an uninterrupted run of :func:`mgpu_lab.failures.snapshot.resumable_train`
in real ranks. Every run, the learner's and the reference's, trains a model
whose forward pass logs the batch, the RNG state and the weights (see
:func:`.probes10.run_resumable`), so a restarted run that ends with other
weights is compared step by step with the uninterrupted one, and the first
thing that differs names the bug: the weights it resumed from, the samples,
the random state, or the optimizer's state. Restarts are done here the way
torchrun does them (every rank stopped and started again); the last case
runs real ``torchrun --max-restarts``.
"""
from __future__ import annotations

import math
import os
import shutil
import tempfile

from mgpu_lab.failures import snapshot
from mgpu_lab.launcher import elastic
from mgpu_lab.parallel import ddp
from mgpu_lab.launcher.errors import LaunchError, LaunchTimeout
from ._core import CaseFailed, _error_text, exercise
from .probes10 import read_log, run_resumable

CFG = {"n": 48, "epochs": 3, "batch_size": 4, "lr": 0.1, "every": 4}
WORLD = 2
PER_EPOCH = CFG["n"] // WORLD // CFG["batch_size"]
STEPS = PER_EPOCH * CFG["epochs"]
RUN_TIMEOUT = 90.0
_reference: dict = {}
ATOMIC = ("a rank killed while writing the snapshot left it torn: write it with atomic_save (a temporary file "
          "in the same directory, then os.replace)")


def reference() -> dict:
    """The uninterrupted run of the library's resumable_train: final weights and each rank's per-step log."""
    if not _reference:
        from mgpu_lab.launcher.launch import run

        work = tempfile.mkdtemp(prefix="mgpu-lab-10-ref-")
        try:
            res = run(run_resumable, WORLD, (snapshot.resumable_train, CFG, os.path.join(work, "s.pt"), work, 0,
                                             None), quiet=True, echo=False, timeout=RUN_TIMEOUT)
            _reference.update(state=res[0]["state"], trace=[_steps(read_log(work, 0, r)) for r in range(WORLD)])
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return _reference


def _steps(records: list) -> list:
    return [r for r in records if "f" in r]


def _close(a, b, rel=1e-7) -> bool:
    return all(math.isclose(x, y, rel_tol=rel, abs_tol=1e-9) for x, y in zip(a, b))


def resumed_from(schedule: list) -> int:
    """The step of the last complete snapshot when the final attempt of ``schedule`` starts."""
    every, snap = CFG["every"], 0
    for kill in schedule[:-1]:
        if kill[0] == "step":
            done = snap + kill[3] - 1
            snap = done // every * every
        else:  # killed while writing its m-th snapshot of this attempt: the one before survives
            due = [s for s in range(snap + 1, STEPS + 1) if s % every == 0]
            snap = due[kill[3] - 2] if kill[3] >= 2 else snap
    return snap


def first_difference(steps: list, ref: list, start: int, rank: int) -> str | None:
    """Why a run's per-step log (starting at step ``start + 1``) is not the uninterrupted run's; None if it is."""
    resumed = start > 0
    after = f"after resuming from the snapshot of step {start}, " if resumed else ""
    if not steps:
        return f"{after}rank {rank} did no training step"
    for j, rec in enumerate(steps):
        i = start + j
        if i >= len(ref):
            return (f"{after}rank {rank} did {len(steps)} steps; {len(ref) - start} were left: resume at the step "
                    "the snapshot was taken, in the middle of its epoch, instead of redoing steps")
        exp = ref[i]
        if not _close(rec["w"], exp["w"]):
            if j == 0 and resumed:
                match = [s for s in range(len(ref)) if _close(rec["w"], ref[s]["w"])]
                if match:
                    return (f"the restart began from the weights after step {match[0]}, expected those after step "
                            f"{start} (the last snapshot before the kill; one every {CFG['every']} steps): "
                            "snapshot every snapshot_every steps and load the model's state_dict from it")
                return ("the weights the restart began from are none of the uninterrupted run's: load the "
                        "model's state_dict from the snapshot")
            if j == 0:
                return "the initial weights differ: use model_fn() as given (DDP broadcasts rank 0's weights)"
            return (f"step {i} changed the weights differently from the uninterrupted run although its batch and "
                    "random state were the same: " + ("restore the optimizer's state from the snapshot "
                    "(optimizer.load_state_dict: SGD's momentum buffers)" if resumed else
                    "train with SGD(lr, momentum=0.9), mean CrossEntropyLoss, DDP, one step per batch"))
        if not math.isclose(rec["x"], exp["x"], rel_tol=1e-9, abs_tol=1e-9):
            epoch = i // PER_EPOCH
            if resumed:
                return (f"after resuming, rank {rank} trained step {i + 1} on other samples than the uninterrupted "
                        f"run: resume at the snapshot's position in epoch {epoch} (sampler.set_epoch(epoch), then "
                        "skip the batches already done)")
            return (f"rank {rank} trained step {i + 1} (epoch {epoch}) on other samples than the reference: "
                    + ("call sampler.set_epoch(epoch) at the start of every epoch" if epoch else
                       "use DataLoader(dataset, batch_size, sampler=DistributedSampler(dataset))"))
        if rec["rng"] != exp["rng"]:
            return (f"at step {i + 1} rank {rank}'s random state (dropout's) differs from the uninterrupted run's: "
                    "save every rank's torch.get_rng_state() in the snapshot and restore it with "
                    "torch.set_rng_state after iter(loader), which draws a seed from it")
    if start + len(steps) != len(ref):
        return f"rank {rank} stopped after step {start + len(steps)} of {len(ref)}"
    return None


def _judge_run(t, final_logs: list, final: int, start: int, results) -> None:
    """Judge the final attempt: ``final_logs`` are its ranks' logs, ``results`` their return values."""
    ref = reference()
    for r in range(WORLD):
        why = first_difference(_steps(final_logs[r]), ref["trace"][r], start, r)
        if why:
            t.fail(why, "the uninterrupted run's weights, step by step", "see hint")
    states = [res["state"] for res in results]
    if any(s is None for s in states):
        t.fail("return model.state_dict() (of the module inside DDP)", "dict[str, Tensor]",
               next(res["type"] for res in results if res["state"] is None))
    worst = ddp.max_diff(states[0], ref["state"])
    if worst > 1e-6:
        t.fail("return the trained model's state_dict() on every rank", "max difference <= 1e-06",
               f"max difference {worst:.3g}")


def _attempts(t, resumable_train, schedule: list, work: str) -> tuple[list, int]:
    """Run attempt after attempt (each killed as ``schedule`` says, the last one not); its results."""
    path, logs = os.path.join(work, "snapshot.pt"), os.path.join(work, "logs")
    t.local(os.makedirs, logs, 0o777, True)
    for a, kill in enumerate(schedule):
        try:
            results = t.ranks(run_resumable, WORLD, resumable_train, CFG, path, logs, a, kill, timeout=RUN_TIMEOUT)
        except LaunchTimeout:
            raise
        except LaunchError as exc:
            if exc.exc_type == "NotImplementedError" or kill is None:
                said = (exc.traceback or "") + str(exc)
                if a and any(w in said for w in ("torch.load", "serialization.py", "PytorchStreamReader")):
                    raise CaseFailed(f"attempt {a} could not load the snapshot: {ATOMIC}", got=_error_text(exc))
                raise
            continue
        if kill is not None:
            raise CaseFailed(f"attempt {a} was to be killed ({kill[0]} {kill[3]} on rank {kill[2]}) but finished: "
                             f"train {STEPS} steps with a snapshot every {CFG['every']}", got="finished")
        return results, a
    raise AssertionError("the schedule ends with an attempt that is not killed")


def _run_case(t, resumable_train, schedule: list):
    work = t.scratch("mgpu-lab-10-resume-")  # where the ranks run (a grader's sandbox); read there
    results, final = _attempts(t, resumable_train, schedule, work)
    logs = t.local(read_logs, os.path.join(work, "logs"), final + 1, WORLD)
    _judge_run(t, logs[final * WORLD:], final, resumed_from(schedule), results)
    return logs


def read_logs(log_dir: str, attempts: int, world: int) -> list[list[dict]]:
    """Every attempt's log of every rank, attempt by attempt (:func:`read_log`)."""
    return [read_log(log_dir, a, r) for a in range(attempts) for r in range(world)]


def _count_saves(logs: list) -> list[int]:
    return [sum(1 for rec in log if "save" in rec) for log in logs]


@exercise("10.resumable_train", points=7, description="resumable_train(model_fn, dataset, epochs, batch_size, lr, "
          "snapshot_path, snapshot_every): DDP training that snapshots every snapshot_every steps and, started "
          "again after a SIGKILL, resumes exactly (the weights of an uninterrupted run)")
def _resumable_train(t, resumable_train):
    every, passed = CFG["every"], []
    fresh_logs = killed_logs = None

    def case(name, hidden=False, hint=""):
        passed.append(len(t.cases))
        return t.case(name, hidden=hidden, hint=hint)

    with case(f"{WORLD} ranks, a fresh start: the weights of an uninterrupted run, step by step (DDP, "
              "DistributedSampler + set_epoch, SGD momentum 0.9, mean cross-entropy)",
              hint="resumable_train runs in every rank with the process group initialised"):
        fresh_logs = _run_case(t, resumable_train, [None])
    with case(f"a snapshot every snapshot_every={every} steps: {STEPS // every} in {STEPS} steps",
              hint="count optimizer steps across epochs and save when step % snapshot_every == 0 "
                   "(rank 0 writes; the other ranks need not)"):
        if fresh_logs is None:
            t.fail("the first case did not finish")
        saves = _count_saves(fresh_logs)
        if max(saves) not in (STEPS // every, STEPS // every + 1):
            t.fail(f"save every snapshot_every={every} optimizer steps (not every step, not only at the end of "
                   "an epoch)", f"{STEPS // every} torch.save calls on rank 0", f"{saves} per rank")
    with case("rank 1 SIGKILLed as step 10 starts, both ranks restarted: resumes after step 8 (the last "
              "snapshot) and ends with the uninterrupted weights"):
        killed_logs = _run_case(t, resumable_train, [["step", 0, 1, 10], None])
    with case("the restart loads the snapshot with torch.load(..., map_location=...)",
              hint="without map_location, tensors saved from cuda:0 load back onto cuda:0 on every rank of a GPU "
                   "node; load with map_location='cpu' (or this rank's device)"):
        if killed_logs is None:
            t.fail("the previous case did not finish")
        loads = [[rec["load"] for rec in log if "load" in rec] for log in killed_logs[WORLD:]]
        if not all(loads) or any(where is None for per_rank in loads for where in per_rank):
            t.fail("", "every rank: torch.load(path, map_location=...)", f"map_location per rank: {loads}")
    with case("rank 0 killed while writing its 2nd snapshot: the restart resumes from the 1st and ends with "
              "the uninterrupted weights", hint=ATOMIC):
        _run_case(t, resumable_train, [["save", 0, 0, 2], None])
    with case("killed twice (rank 0 at step 3, before any snapshot; then rank 1 at the 5th step after the "
              "restart): the uninterrupted weights", hidden=True):
        _run_case(t, resumable_train, [["step", 0, 0, 3], ["step", 1, 1, 5], None])
    with case("under real torchrun --max-restarts=1: rank 1 SIGKILLed as step 7 starts; torchrun restarts both "
              "ranks; the uninterrupted weights"):
        if any(not t.cases[i].passed for i in passed[:-1]):
            t.fail("not run: torchrun takes seconds; pass the cases above first", "the cases above pass",
                   "some failed")
        _torchrun_case(t, resumable_train)


def _torchrun_case(t, resumable_train) -> None:
    t._skip_if_hung()
    kill = ["step", 0, 1, 7]
    work = t.scratch("mgpu-lab-10-torchrun-")
    # torchrun runs where the learner's code runs: in a grader's sandbox, never in the grader
    results, returncode, tail, logs = t.local(torchrun_attempts, resumable_train, work, kill, timeout=330)
    if results is None:
        t.fail("torchrun's job failed (exit code " + str(returncode) + "); its last lines: "
               + " | ".join(tail)[-900:], "exit code 0 after one restart", returncode)
    _judge_run(t, logs, 1, resumed_from([kill, None]), results)


def torchrun_attempts(resumable_train, work: str, kill: list):
    """In the learner's environment: ``resumable_train`` under real torchrun with one restart.

    Returns:
        ``(results or None, torchrun's exit code, its last output lines, the second attempt's logs)``.
    """
    logs = os.path.join(work, "logs")
    os.makedirs(logs, exist_ok=True)
    results, run_ = elastic.call(run_resumable, WORLD, resumable_train, CFG, os.path.join(work, "snap.pt"),
                                 logs, None, kill, max_restarts=1, timeout=300)
    tail = [ln for ln in run_.output.splitlines() if ln.strip()][-6:]
    return results, run_.returncode, tail, [read_log(logs, 1, r) for r in range(WORLD)]

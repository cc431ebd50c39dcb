"""Checks of lesson 10 (failures): atomic_save, resumable_train, first_desync.

atomic_save runs in forked writers killed at every file operation of the save
and at byte offsets of its writes; what each leaves at the path is loaded.
resumable_train runs in real ranks that are killed with SIGKILL at steps the
learner does not know (or while a snapshot is written), restarted as torchrun
restarts them, and finally under real ``torchrun --max-restarts``; the final
weights are compared with an uninterrupted run of the library's version, and
per-step logs (batch, RNG state, weights) name the first thing that differs.
first_desync gets hand-made logs and logs recorded by the flight recorder in
real hung runs. What runs in processes is :mod:`.ranks`; this module judges.
"""
from __future__ import annotations

import os
import random

from mgpu_lab.launcher import elastic
from mgpu_lab.launcher.errors import LaunchError, LaunchTimeout
from .._core import _error_text, CaseFailed, exercise
from ..sim.outcome import in_words
from .judges import (count_saves, expected_desync, judge_run, judge_trials, other_filesystem, random_logs,
                     recorded_logs, AR3, AR4, BAR, BC, CFG, read_logs, resumed_from, RUN_TIMEOUT, STEPS,
                     WORLD)
from .ranks import atomic_probe, first_desync_all, HANGS, read_log, run_resumable


ATOMIC_HINT = ("write to a temporary file in the same directory as path, then os.replace(tmp, path): the "
               "rename is atomic, so path holds the old file or the new one at every moment")


@exercise("10.atomic_save", points=6, description="atomic_save(obj, path): torch.save such that a process killed "
          "at any moment leaves the old file or the new one at path, never a torn one")
def _atomic_save(t, atomic_save):
    root = t.scratch("mgpu-lab-10-atomic-")  # where the learner's code runs (a grader's sandbox)
    other = t.remove_after(t.local(other_filesystem, root))
    got = None
    with t.case("saves the object (torch.load(path) gives it back) and a second save replaces it",
                hint="torch.save the object, and make sure path holds it when atomic_save returns"):
        got = t.call(atomic_probe, atomic_save, root, other, timeout=120)
        if got["plain"] != ["old", "new"]:
            t.fail("", "['old', 'new'] after saving the old then the new object", got["plain"])
        dry = got["dry"]
        if dry.get("raised") or dry["outcome"] != "new":
            t.fail("a save over an existing file must leave the new object there",
                   "new", dry.get("raised") or dry["outcome"])
    for trial in (got or {}).get("events", []):
        trial["at"] = got["dry"]["events"][trial["k"] - 1] if trial["k"] <= len(got["dry"]["events"]) else "?"
    with t.case("SIGKILL at each file operation of a save over an old file (open, rename, remove, copy, ...): "
                "the old or the new object, never a torn file or none", hint=ATOMIC_HINT):
        if got is None:
            t.fail("the first case did not finish")
        judge_trials(t, got["events"], ("old", "new"),
                      "path must never be missing or half written: don't remove it before the rename, "
                      + ATOMIC_HINT)
    with t.case("killed mid-write (the writer dies the moment a file it writes reaches 1 byte, or half the "
                "object's size: RLIMIT_FSIZE), from the start and after each file operation: the old or "
                "the new object", hint=ATOMIC_HINT):
        if got is None:
            t.fail("the first case did not finish")
        judge_trials(t, got["bytes"], ("old", "new"),
                      "path was left half written: never write (or copy) into path itself; " + ATOMIC_HINT)
    with t.case("an object torch.save cannot pickle: the error reaches the caller and the old file is intact",
                hint="let torch.save's exception propagate (no bare except), and write to a temporary file "
                     "so that a failed save never touches path"):
        if got is None:
            t.fail("the first case did not finish")
        bad = got["bad"]
        if not bad.get("raised"):
            t.fail("atomic_save returned as if it had saved: let the pickling error propagate",
                   "an exception", "returned normally")
        if bad["outcome"] != "old":
            t.fail("the failed save damaged path: " + ATOMIC_HINT, "old", bad["outcome"])
    with t.case("no old file yet: a writer killed at any point leaves no file or the complete new one",
                hidden=True):
        if got is None:
            t.fail("the first case did not finish")
        judge_trials(t, got["fresh"], ("missing", "new"), ATOMIC_HINT)
    with t.case("the temporary file is made in path's directory (it works with the system temp dir on "
                "another file system)", hint="os.replace cannot move a file across file systems: create the "
                "temporary file next to path, e.g. tempfile.mkstemp(dir=os.path.dirname(path)) or path + "
                "'.tmp', not in the system temp dir"):
        if got is None:
            t.fail("the first case did not finish")
        cross = got["cross"]
        if cross is not None and (cross.get("raised") or cross["outcome"] != "new"):
            t.fail("", f"the new object at path, with TMPDIR={other}",
                   f"raised {cross['raised']}" if cross.get("raised") else cross["outcome"])


FIXED = [
    ("the logs of 2 ranks agree: None", [[AR3, BAR], [AR3, BAR]], False,
     "return None when every index holds the same call on every rank"),
    ("3 ranks, rank 2 all-reduces 4 numbers at call 1: (1, [2])", [[AR3, AR3], [AR3, AR3], [AR3, AR4]], False,
     "compare op and shape (the whole tuple), and return (index, [ranks that differ])"),
    ("rank 0 is the odd one out (ranks 1 and 2 agree): (1, [0])", [[AR3, BC], [AR3, AR3], [AR3, AR3]], False,
     "the reference is the majority's call, not rank 0's: count the calls at that index"),
    ("rank 1's log ends before the others': (2, [1])", [[AR3, AR3, BAR], [AR3, AR3], [AR3, AR3, BAR]], False,
     "a rank whose log has ended differs (it never made that call): don't stop at the shortest log (zip)"),
    ("2 against 2: the tie goes to rank 0's call: (0, [2, 3])", [[AR3], [AR3], [AR4], [AR4]], False,
     "on a tie take the call of the lowest rank among the tied ones (rank 0's here)"),
    ("every rank but rank 3 has ended: (2, [0, 1, 2])", [[AR3, AR3], [AR3, AR3], [AR3, AR3], [AR3, AR3, BAR]], True,
     "ended logs differ; the majority is counted among the ranks that still have a call"),
]


@exercise("10.first_desync", points=8, description="first_desync(logs): the first index at which the ranks' "
          "collective calls disagree and the ranks that differ from the majority; None when all agree")
def _first_desync(t, first_desync):
    sweep = [random_logs(random.Random(seed)) for seed in range(300)]
    cases = [logs for _, logs, _, _ in FIXED] + sweep
    results = None
    for name, logs, hidden, hint in FIXED:
        with t.case(name, hidden=hidden, hint=hint):
            if results is None:
                results = t.call(first_desync_all, first_desync, cases)
            outcome = results[[c for c in cases].index(logs)]
            if outcome != ("ok", expected_desync(logs)):
                t.fail(hint, expected_desync(logs), in_words(outcome))
    with t.case("logs recorded by the flight recorder in real hung runs (gloo, 3 ranks): a skipped all_reduce, "
                "a shape mismatch, a broadcast against an all_reduce",
                hint="the same rules on real logs: e.g. the skipping rank's log holds a barrier where the others "
                     "hold their second all_reduce"):
        recorded = recorded_logs(t)
        got = t.call(first_desync_all, first_desync, [recorded[n] for n in HANGS])
        for name, outcome in zip(HANGS, got):
            if outcome != ("ok", expected_desync(recorded[name])):
                t.fail(f"hung run '{name}', logs {recorded[name]}", expected_desync(recorded[name]), in_words(outcome))
    with t.case("300 random logs of 1 to 5 ranks agree with the reference", hidden=True):
        if results is None:
            t.fail("the first case did not finish")
        for logs, outcome in zip(sweep, results[len(FIXED):]):
            if outcome != ("ok", expected_desync(logs)):
                t.fail(f"logs {logs}", expected_desync(logs), in_words(outcome))


ATOMIC = ("a rank killed while writing the snapshot left it torn: write it with atomic_save (a temporary file "
          "in the same directory, then os.replace)")


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
    judge_run(t, logs[final * WORLD:], final, resumed_from(schedule), results)
    return logs


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
        saves = count_saves(fresh_logs)
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
    judge_run(t, logs, 1, resumed_from([kill, None]), results)


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

"""Checks of lesson 10 (failures): atomic_save, resumable_train, guarded.

atomic_save runs in forked writers killed at every file operation of the save
and at byte offsets of its writes; what each leaves at the path is loaded. A
complete save's renames and ``os.fsync`` calls (on what file, holding how many
bytes) are recorded in the writer: a power loss is judged from them.
resumable_train runs in real ranks that are killed with SIGKILL at steps the
learner does not know (or while a snapshot is written), restarted as torchrun
restarts them, and finally under real ``torchrun --max-restarts``; the final
weights are compared with an uninterrupted run of the library's version, and
per-step logs (batch, RNG state, weights) name the first thing that differs.
guarded wraps the collectives of the lesson's hang programs (a skipped
all_reduce, a shape mismatch, a broadcast against an all_reduce, a rank that
never comes), each run in 3 fresh ranks. What runs in processes is :mod:`.ranks`; this module judges.
"""
from __future__ import annotations

import os

from mgpu_lab.launcher import elastic
from mgpu_lab.launcher.errors import LaunchError, LaunchTimeout
from .._core import _error_text, CaseFailed, exercise, for_learners
from .judges import (absent_hint, agreed_results, count_saves, judge_durable, judge_guard, judge_run, judge_trials,
                     judge_written_beside, other_filesystem, outcome_words, CFG, read_logs, resumed_from,
                     RUN_TIMEOUT, STEPS, WITHIN, WORLD)
from .ranks import atomic_probe, guard_probe, read_log, run_resumable


ATOMIC_HINT = ("a right save leaves path untouched until the new content is complete on path's file system, "
               "then swaps it in with one atomic step: path holds the old file or the new one at every moment")


@exercise("10.atomic_save", points=7, description="atomic_save(obj, path): torch.save such that a process killed "
          "at any moment leaves the old file or the new one at path, never a torn one, and a power loss after it "
          "returned leaves the new one", references=("mgpu_lab.failures.resume:save_atomically",))
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
                   "new", dry.get("raised") or outcome_words(dry))
    for trial in (got or {}).get("events", []):
        trial["at"] = got["dry"]["events"][trial["k"] - 1] if trial["k"] <= len(got["dry"]["events"]) else "?"
    with t.case("SIGKILL at each file operation of a save over an old file (open, rename, remove, copy, ...): "
                "the old or the new object, never a torn file or none", hint=ATOMIC_HINT):
        _saved_at_all(t, got)
        if not got["events"]:
            t.fail("not judged: your save made no file operation the check can stop it at (no open, rename, "
                   "copy, ...): it writes path in one go from torch's own code, in place; " + ATOMIC_HINT,
                   "a save that opens, writes and renames files", "no file operation")
        judge_trials(t, got["events"], ("old", "new"),
                      "killed there, your save left path missing or half written: it removes, truncates or "
                      "writes path itself before the new content is complete; " + ATOMIC_HINT)
    with t.case("killed mid-write (the writer dies the moment a file it writes reaches 1 byte, or half the "
                "object's size: RLIMIT_FSIZE), from the start and after each file operation: the old or "
                "the new object", hint=ATOMIC_HINT):
        _saved_at_all(t, got)
        judge_trials(t, got["bytes"], ("old", "new"),
                      "path was left half written: your save writes (or copies) into path itself, so a kill "
                      "mid-write tears it; " + ATOMIC_HINT)
    with t.case("an object torch.save cannot pickle: the error reaches the caller and the old file is intact",
                hint="a failed torch.save must reach the caller with its error and leave path as it was: your "
                     "save swallowed the error, or had already changed path"):
        _saved_at_all(t, got)  # a save that always raises says nothing about this error reaching the caller
        bad = got["bad"]
        if not bad.get("raised"):
            t.fail("atomic_save returned as if it had saved: let the pickling error propagate",
                   "an exception", "returned normally")
        if bad["outcome"] != "old":
            t.fail("the failed save damaged path: " + ATOMIC_HINT, "the old object", outcome_words(bad))
    with t.case("no old file yet: a writer killed at any point leaves no file or the complete new one",
                hidden=True):
        _saved_at_all(t, got)
        judge_trials(t, got["fresh"], ("missing", "new"), ATOMIC_HINT)
    with t.case("the temporary file is made in path's directory and renamed onto path (it works with the system "
                "temp dir on another file system)", hint="with the system temp dir on another file system your "
                "save failed: a rename cannot cross file systems, so the new content must be written on path's "
                "own file system"):
        if got is None:
            t.fail("the first case did not finish")
        judge_written_beside(t, got["cross"] or got["dry"], other)
    with t.case("after it returns, the save survives a power loss: the new file's data fsynced before the rename, "
                "path's directory fsynced after it (the check records each os.fsync and what it was called on)",
                hint="a kill loses nothing the kernel has, a power loss loses what is not on disk: the new file's "
                     "bytes, then the directory entry the rename changed, each made durable in that order"):
        _saved_at_all(t, got)
        judge_durable(t, got["dry"])


def _saved_at_all(t, got) -> None:
    """A kill proves nothing about a save that never puts the new object at path: such a case fails."""
    if got is None:
        t.fail("the first case did not finish")
    if got["dry"].get("raised") or got["dry"]["outcome"] != "new":
        t.fail("not judged: a complete save of yours leaves no new object at path, so what a kill leaves proves "
               "nothing", "the new object after a complete save", got["dry"].get("raised") or outcome_words(got["dry"]))


SCENARIOS = [  # (scenario, odd rank, what the program did, hidden)
    ("skip", 2, "rank 2 skips the second all_reduce and calls the barrier that the others call after it", False),
    ("shape", 0, "rank 0 all-reduces 4 numbers where ranks 1 and 2 all-reduce 3", False),
    ("order", 1, "rank 1 broadcasts where ranks 0 and 2 all-reduce", False),
    ("dtype", 1, "rank 1 all-reduces float64 where ranks 0 and 2 all-reduce float32", True),
]


@exercise("10.guarded", points=6, description="guarded(collective): the collective, but the ranks first agree on "
          "(call number, op, shape, dtype) with a bounded wait; a mismatch raises on every rank naming the odd "
          "rank and the call instead of hanging", references=("mgpu_lab.failures.desync:first_desync",))
def _guarded(t, guarded):
    """Each scenario in 3 fresh ranks (the guard's call count starts at 0), its collectives on a group with a 2 s
    timeout, so that a mismatched collective the guard let through fails instead of hanging.

    Catches: a wrapper that does not run the collective or changes its result; comparing op only (shape,
    dtype let through); a count per wrapper instead of per rank (the skipped call paired with another one);
    rank 0's call taken as the reference instead of the majority's; raising on the odd rank only; no bound
    on the wait for a rank that never comes.
    """
    with t.case("3 ranks agree on 12 guarded calls (all_reduce, broadcast with src and group, barrier): every "
                "collective runs once with the results and return values of the plain one",
                hint="when the ranks agree, the wrapper calls the collective with the arguments it was given and "
                     "returns what it returns"):
        got = t.ranks(guard_probe, 3, guarded, "agree", BOUND, timeout=GUARD_TIMEOUT)
        for r, g in enumerate(got):
            if g.get("waiting") is not None:
                t.fail(f"rank {r} was still waiting inside your guard after {g['waiting']} s although every rank "
                       "made the same calls", "12 calls that return", f"the calls that ran: {g['ran']}")
            if g["raised"]:
                t.fail(f"rank {r} raised although every rank made the same calls", "no error",
                       f"{g['raised'][0]}: {g['raised'][1][:300]}")
            if g["ran"] != ["all_reduce", "broadcast", "barrier"] * 4:
                t.fail("each guarded call must run its collective exactly once", "['all_reduce', 'broadcast', "
                       "'barrier'] x 4", g["ran"])
            expected = agreed_results()
            if g["results"] != expected:
                t.fail("the results differ from the plain collectives' (a False: the wrapper did not return the "
                       "collective's own return value, None)", expected, g["results"])
    for scenario, odd, what, hidden in SCENARIOS:
        with t.case(f"{what}: every rank raises at call 1, before that collective runs, naming rank {odd} and "
                    "call 1", hidden=hidden, hint=GUARD_HINTS[scenario]):
            judge_guard(t, t.ranks(guard_probe, 3, guarded, scenario, BOUND, timeout=GUARD_TIMEOUT), odd, (0, 1, 2),
                        what, GUARD_HINTS[scenario])
    absent = ("a right guard waits for the other ranks' calls up to a deadline; a rank that has not made the call "
              "by then is the odd rank, and the ranks that waited raise naming it")
    with t.case(f"rank 2 never makes call 1: ranks 0 and 1 raise within {WITHIN:.0f} s naming rank 2 and call 1",
                hint=absent):
        got = t.ranks(guard_probe, 3, guarded, "absent", BOUND, timeout=GUARD_TIMEOUT)
        judge_guard(t, got, 2, (0, 1), "rank 2 never makes a second call", absent_hint(got, absent))


BOUND = WITHIN + 0.5  # seconds the probe lets a rank's guarded calls take before it reports the rank as waiting
GUARD_TIMEOUT = 25.0  # seconds for one scenario's 3 ranks: a last resort (the probe itself gives up after BOUND)


GUARD_HINTS = {
    "skip": "the calls are paired by each rank's count of guarded calls, over all collectives: rank 2's call 1 "
            "is its barrier, the others' call 1 their second all_reduce; a count per collective pairs rank 2's "
            "barrier with the others' barrier, and names the wrong call",
    "shape": "compare the shapes too: a gloo all_reduce of 4 numbers against one of 3 does not fail where it is "
             "called; the odd rank is the one whose call differs from the majority's (here rank 0 itself)",
    "order": "compare the collective itself (all_reduce against broadcast), not only the shapes",
    "dtype": "compare the dtypes too: an all_reduce of float64 against float32 mixes bytes or hangs",
}


ATOMIC = ("a rank killed while writing the snapshot left it torn: the snapshot was written in place, not with "
          "your atomic_save")


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
          "again after a SIGKILL, resumes exactly (the weights of an uninterrupted run)",
          references=("mgpu_lab.failures.resume:train", "mgpu_lab.failures.resume:save_atomically"))
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
              hint="a snapshot after every snapshot_every optimizer steps, counted across epochs, written by "
                   "one rank"):
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
              hint="your torch.load of the snapshot named no map_location: tensors saved from cuda:0 then load "
                   "onto cuda:0 on every rank of a GPU node; a right restart says where they go (the CPU, or "
                   "this rank's device)"):
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
    tail = for_learners(run_.output.splitlines())[-6:]  # no C++ stack trace, no c10d warnings
    return results, run_.returncode, tail, [read_log(logs, 1, r) for r in range(WORLD)]

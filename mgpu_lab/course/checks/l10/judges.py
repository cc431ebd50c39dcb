"""Lesson 10's verdicts: the evidence of :mod:`.ranks`, in the words of each case."""
from __future__ import annotations

import math
import os
import shutil
import tempfile
import threading

from mgpu_lab.failures import resume
from .._core import CaseFailed
from mgpu_lab.parallel import ddp
from .ranks import read_log, run_resumable


CFG = {"n": 48, "epochs": 3, "batch_size": 4, "lr": 0.1, "every": 4}


WORLD = 2


PER_EPOCH = CFG["n"] // WORLD // CFG["batch_size"]


STEPS = PER_EPOCH * CFG["epochs"]


# seconds one attempt of the 2-rank resumable run may take: a few idle; CI at a load of 10 (four answers judged
# at once beside other workers) once took over 90 for an answer that does finish (2026-11-29)
RUN_TIMEOUT = 180.0


_reference: dict = {}
_reference_lock = threading.Lock()  # checks judged in threads at once (the mutant tests') make it once


# -- atomic_save -----------------------------------------------------------------------
def other_filesystem(root: str) -> str | None:
    """A writable directory on another file system than ``root`` (e.g. /dev/shm), or None."""
    dev = os.stat(root).st_dev
    for cand in ("/dev/shm", "/run/user", "/var/tmp", "/tmp", os.getcwd()):
        try:
            if os.path.isdir(cand) and os.access(cand, os.W_OK) and os.stat(cand).st_dev != dev:
                return tempfile.mkdtemp(prefix="mgpu-lab-10-other-", dir=cand)
        except OSError:
            continue
    return None


def plural(n: int, word: str) -> str:
    """``n`` and ``word``, in the singular for 1.

    Example:
        >>> plural(1, "byte"), plural(2048, "byte")
        ('1 byte', '2048 bytes')
    """
    return f"{n} {word}" + ("" if n == 1 else "s")


def _where(trial: dict) -> str:
    events = trial.get("events") or []
    if trial["kind"] == "event":
        return f"SIGKILL at file operation {trial['k']} ({trial.get('at', '?')})"
    if trial["kind"] == "bytes":
        after = f" after file operation {trial['k']}" if trial["k"] else ""
        return f"killed{after} once a file being written reaches {plural(trial['n'], 'byte')}"
    return "a complete save" + (f" (file operations: {', '.join(events)})" if events else "")


def outcome_words(trial: dict) -> str:
    """What a trial left at path, in the check's words (never the loader's error)."""
    outcome = trial["outcome"]
    if outcome == "missing":
        return "no file at path"
    if outcome != "torn":
        return f"the {outcome} object"
    held = f" (it holds {plural(trial['final'][2], 'byte')})" if trial.get("final") else ""
    if trial["kind"] == "bytes":
        return f"the file at path was half written when the writer was killed at byte {trial['n']}{held}"
    if trial["kind"] == "event":
        return (f"the file at path was half written when the writer was killed at file operation {trial['k']} "
                f"({trial.get('at', '?')}){held}")
    return f"the file at path does not load{held}"


def judge_trials(t, trials, allowed, hint):
    for trial in trials:
        if trial.get("raised"):
            t.fail(f"{_where(trial)}: your atomic_save raised {trial['raised']}", "no error", trial["raised"])
        if trial["outcome"] not in allowed:
            t.fail(f"{_where(trial)}: {hint}", " or ".join(f"the {a} object" if a != "missing" else "no file"
                                                          for a in allowed), outcome_words(trial))


def _new_from_rename(trial: dict) -> tuple[int, dict] | None:
    """The rename that put the file now at path there (its index in the trial's log), or None."""
    final = trial.get("final")
    for i, e in reversed(list(enumerate(trial.get("log") or []))):
        if e["op"] == "rename" and final and e["src"] and e["src"][:2] == final[:2] and e["dst"] == trial["path"]:
            return i, e
    return None


def judge_written_beside(t, trial: dict, other: str | None) -> None:
    """The new file at path came from a rename of a file in path's directory (made there, written, renamed)."""
    if trial.get("raised") or trial["outcome"] != "new":
        t.fail("", f"the new object at path, with TMPDIR={other}",
               f"raised {trial['raised']}" if trial.get("raised") else outcome_words(trial))
    found = _new_from_rename(trial)
    if found is None:
        t.fail("no temporary file was renamed onto path: your save writes (or copies) path itself, so there is "
               "a moment when path holds part of the new file", "the new file renamed onto path",
               "the file at path was written in place")
    if found[1]["src_dir"] != os.path.dirname(trial["path"]):
        t.fail("the temporary file was not in path's directory", os.path.dirname(trial["path"]),
               found[1]["src_dir"])


def judge_durable(t, trial: dict) -> None:
    """The new file's data fsynced (all of it) before the rename, path's directory fsynced after it."""
    found = _new_from_rename(trial)
    if found is None:
        t.fail("not judged: no rename put the new file at path (the cases above say why)",
               "the new file renamed onto path", "the file at path was written in place")
    at, rename = found
    log, size = trial["log"], trial["final"][2]
    data = [e for e in log[:at] if e["op"] in ("fsync", "fdatasync") and e["file"][:2] == trial["final"][:2]]
    if not data:
        t.fail("the new file's data was not fsynced before the rename: after a power loss the rename can be on "
               "disk and the data not, and path names an empty or partial file",
               "an fsync of the new file before the rename", "none")
    if not any(e["file"][2] == size for e in data):
        t.fail("the new file was fsynced before all of it reached the kernel: what Python's file object still "
               "buffered was not part of it", f"an fsync of all {plural(size, 'byte')}",
               f"fsynced at {', '.join(plural(e['file'][2], 'byte') for e in data)}")
    dirs = [i for i, e in enumerate(log) if e["op"] == "fsync" and e["file"][:2] == trial["directory"]]
    if not any(i > at for i in dirs):
        t.fail("path's directory was not fsynced after the rename: the rename is a change of the directory, and "
               "until the directory is on disk a power loss can bring back the old file (or none)"
               + (" (your fsync of the directory came before the rename)" if dirs else ""),
               "an fsync of path's directory after the rename", "none after it")


def reference() -> dict:
    """The uninterrupted run of the library's resumable training (:func:`mgpu_lab.failures.resume.train`).

    Its final weights and each rank's per-step log.
    """
    with _reference_lock:
        if not _reference:
            from mgpu_lab.launcher.launch import run

            work = tempfile.mkdtemp(prefix="mgpu-lab-10-ref-")
            try:
                res = run(run_resumable, WORLD, (resume.train, CFG, os.path.join(work, "s.pt"), work, 0,
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
                            "a right restart begins from the weights of the last snapshot written")
                return ("the weights the restart began from are none of the uninterrupted run's: a right "
                        "restart begins from the snapshot's weights")
            if j == 0:
                return "the initial weights differ: use model_fn() as given (DDP broadcasts rank 0's weights)"
            return (f"step {i} changed the weights differently from the uninterrupted run although its batch and "
                    "random state were the same: " + ("the optimizer's state (SGD's momentum buffers) was not the one "
                    "saved with the snapshot" if resumed else
                    "train with SGD(lr, momentum=0.9), mean CrossEntropyLoss, DDP, one step per batch"))
        if not math.isclose(rec["x"], exp["x"], rel_tol=1e-9, abs_tol=1e-9):
            epoch = i // PER_EPOCH
            if resumed:
                return (f"after resuming, rank {rank} trained step {i + 1} on other samples than the uninterrupted "
                        f"run: a right restart continues epoch {epoch} in that epoch's order, with the batch after "
                        "the snapshot's")
            return (f"rank {rank} trained step {i + 1} (epoch {epoch}) on other samples than the reference: "
                    + ("it kept an earlier epoch's order: the DistributedSampler reshuffles only when told the "
                       "epoch" if epoch else "the batches are not the DistributedSampler's shard of the dataset, "
                       "batch_size samples per rank"))
        if rec["rng"] != exp["rng"]:
            return (f"at step {i + 1} rank {rank}'s random state (dropout's) differs from the uninterrupted run's: "
                    "a right restart gives each rank the random state it had at the snapshot, as it stood once "
                    "the epoch's iterator was made (making one draws from it)")
    if start + len(steps) != len(ref):
        return f"rank {rank} stopped after step {start + len(steps)} of {len(ref)}"
    return None


def judge_run(t, final_logs: list, final: int, start: int, results) -> None:
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


def read_logs(log_dir: str, attempts: int, world: int) -> list[list[dict]]:
    """Every attempt's log of every rank, attempt by attempt (:func:`read_log`)."""
    return [read_log(log_dir, a, r) for a in range(attempts) for r in range(world)]


def count_saves(logs: list) -> list[int]:
    return [sum(1 for rec in log if "save" in rec) for log in logs]


# -- guarded ---------------------------------------------------------------------------
WITHIN = 6.0  # seconds within which every rank must raise (the bounded wait included)


def agreed_results() -> list:
    """What the ``agree`` scenario's collectives give on every rank of 3 (guard_probe's calls)."""
    out = []
    for step in range(4):
        out.append([3.0 * i + 3 + 3 * step for i in range(3)])   # all_reduce of arange(3) + rank + step
        src = step % 3
        out.append([float(src * 10 + step)] * 2)                  # broadcast from rank step % 3
    return out


def names(message: str, odd: int, call: int) -> bool:
    """Whether an error message names rank ``odd`` and call ``call`` (as "rank R" and "call N")."""
    import re

    text = message.lower()
    return bool(re.search(rf"\brank {odd}\b", text)) and bool(re.search(rf"\bcall {call}\b", text))


MONITORED = ("dist.monitored_barrier names the ranks that did not arrive on rank 0 only: the ranks that did arrive "
             "wait for rank 0's answer, which never comes, so they neither raise in time nor learn who is absent; "
             "it is allowed, but on its own it is not the absent-rank half of a guard")


def absent_hint(got: list, hint: str) -> str:
    """``hint``, and what ``dist.monitored_barrier`` does when a rank's error is its report (the lesson's decision:
    it may be used, but it tells rank 0 alone)."""
    said = " ".join(g["raised"][1] for g in got if g.get("raised"))
    return f"{hint}; {MONITORED}" if "monitoredBarrier" in said or "monitored_barrier" in said else hint


def judge_guard(t, got: list, odd: int, ranks: tuple, what: str, hint: str = "") -> None:
    """Every rank of ``ranks`` raised at call 1, before its collective ran, naming ``odd`` and call 1."""
    try:
        _judge_guard(t, got, odd, ranks, what)
    except CaseFailed as failed:
        failed.hint = f"{failed.hint}; {hint}" if hint else failed.hint
        raise


def _judge_guard(t, got: list, odd: int, ranks: tuple, what: str) -> None:
    for r in ranks:
        said, ran = got[r]["raised"], got[r]["ran"]
        if got[r].get("waiting") is not None:
            t.fail(f"rank {r} was still waiting inside your guard after {got[r]['waiting']} s: {what}; a wait with "
                   "no bound hangs just like the collective it guards" + _ran(ran), f"a RuntimeError within "
                   f"{WITHIN:.0f} s naming rank {odd} and call 1", f"rank {r}: still waiting after "
                   f"{got[r]['waiting']} s")
        if said is None:
            t.fail(f"rank {r} raised nothing: {what}; your guard let the ranks go on" + _ran(ran), "a RuntimeError on "
                   f"every rank naming rank {odd} and call 1", f"rank {r}: no error")
        if len(ran) > 1:
            t.fail(f"the collective of call 1 ran on rank {r} (the calls that ran: {ran}): the guard must stop a "
                   "mismatched call before it starts; a mismatched collective hangs or mixes data", "the collective of "
                   "call 1 not run", f"ran {ran}, then raised {said[0]}: {said[1][:200]}")
        if not ran:
            t.fail(f"on rank {r} call 0, which every rank made alike, did not run: {said[0]}: {said[1][:200]}",
                   "call 0 runs, call 1 raises", "call 0 raised")
        if not names(said[1], odd, 1):
            t.fail(f"rank {r}'s error does not name the odd rank and the call as 'rank {odd}' and 'call 1' (calls "
                   "counted from 0 on each rank, over every guarded collective): " + what, f"rank {odd}, call 1",
                   f"rank {r} raised {said[0]}: {said[1][:300]}")
        if got[r]["seconds"] > WITHIN:
            t.fail(f"rank {r} raised only after {got[r]['seconds']} s: bound the wait", f"within {WITHIN:.0f} s",
                   f"{got[r]['seconds']} s")


def _ran(ran: list) -> str:
    return f" (the calls that ran: {ran})" if ran else ""

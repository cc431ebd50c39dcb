"""Checks of lesson 10 (failures): atomic_save, resumable_train, first_desync.

atomic_save runs in forked writers killed at every file operation of the save
and at byte offsets of its writes; what each leaves at the path is loaded.
resumable_train runs in real ranks that are killed with SIGKILL at steps the
learner does not know (or while a snapshot is written), restarted as torchrun
restarts them, and finally under real ``torchrun --max-restarts``; the final
weights are compared with an uninterrupted run of the library's version, and
per-step logs (batch, RNG state, weights) name the first thing that differs.
first_desync gets hand-made logs and logs recorded by the flight recorder in
real hung runs. What runs in processes is :mod:`.probes10`; this module judges.
"""
from __future__ import annotations

import os
import random
import tempfile

from mgpu_lab.failures import hangs
from ._core import exercise
from .probes10 import HANGS, atomic_probe, first_desync_all, record_hangs

ATOMIC_HINT = ("write to a temporary file in the same directory as path, then os.replace(tmp, path): the "
               "rename is atomic, so path holds the old file or the new one at every moment")


# -- atomic_save -----------------------------------------------------------------------
def _other_filesystem(root: str) -> str | None:
    """A writable directory on another file system than ``root`` (e.g. /dev/shm), or None."""
    dev = os.stat(root).st_dev
    for cand in ("/dev/shm", "/run/user", "/var/tmp", "/tmp", os.getcwd()):
        try:
            if os.path.isdir(cand) and os.access(cand, os.W_OK) and os.stat(cand).st_dev != dev:
                return tempfile.mkdtemp(prefix="mgpu-lab-10-other-", dir=cand)
        except OSError:
            continue
    return None


def _where(trial: dict) -> str:
    events = trial.get("events") or []
    if trial["kind"] == "event":
        return f"SIGKILL at file operation {trial['k']} ({trial.get('at', '?')})"
    if trial["kind"] == "bytes":
        after = f" after file operation {trial['k']}" if trial["k"] else ""
        return f"killed{after} once a file being written reaches {trial['n']} bytes"
    return "a complete save" + (f" (file operations: {', '.join(events)})" if events else "")


def _judge_trials(t, trials, allowed, hint):
    for trial in trials:
        if trial.get("raised"):
            t.fail(f"{_where(trial)}: your atomic_save raised {trial['raised']}", "no error", trial["raised"])
        if trial["outcome"] not in allowed:
            t.fail(f"{_where(trial)}: {hint}", " or ".join(allowed), trial["outcome"])


@exercise("10.atomic_save", points=6, description="atomic_save(obj, path): torch.save such that a process killed "
          "at any moment leaves the old file or the new one at path, never a torn one")
def _atomic_save(t, atomic_save):
    root = t.scratch("mgpu-lab-10-atomic-")  # where the learner's code runs (a grader's sandbox)
    other = t.remove_after(t.local(_other_filesystem, root))
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
        _judge_trials(t, got["events"], ("old", "new"),
                      "path must never be missing or half written: don't remove it before the rename, "
                      + ATOMIC_HINT)
    with t.case("killed mid-write (the writer dies the moment a file it writes reaches 1 byte, or half the "
                "object's size: RLIMIT_FSIZE), from the start and after each file operation: the old or "
                "the new object", hint=ATOMIC_HINT):
        if got is None:
            t.fail("the first case did not finish")
        _judge_trials(t, got["bytes"], ("old", "new"),
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
        _judge_trials(t, got["fresh"], ("missing", "new"), ATOMIC_HINT)
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


# -- first_desync ----------------------------------------------------------------------
AR3, AR4, BAR, BC = ["all_reduce", [3]], ["all_reduce", [4]], ["barrier", []], ["broadcast", [2]]
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
_recorded: dict = {}


def _random_logs(rng: random.Random) -> list:
    calls = [AR3, AR4, BAR, BC]
    world, length = rng.randint(1, 5), rng.randint(0, 5)
    base = [rng.choice(calls) for _ in range(length)]
    logs = []
    for _ in range(world):
        log = list(base)
        if rng.random() < 0.5 and log:
            log[rng.randrange(len(log))] = rng.choice(calls)
        if rng.random() < 0.3:
            log = log[:rng.randint(0, len(log))]
        logs.append(log)
    return logs


def _recorded_logs(t) -> dict:
    """Logs of real hung runs (3 ranks, flight recorder, 1 s timeout), recorded once per process."""
    if not _recorded:
        from mgpu_lab.launcher.launch import run

        t._skip_if_hung()
        ranks = run(record_hangs, 3, (1.0,), init=False, quiet=True, echo=False, timeout=90)
        _recorded.update({name: [r[name] for r in ranks] for name in HANGS})
    return _recorded


def _expected(logs):
    got = hangs.first_desync([[(op, tuple(shape)) for op, shape in log] for log in logs])
    return None if got is None else [got[0], list(got[1])]


def _shown(outcome):
    return f"raised {outcome[1]}: {outcome[2]}" if outcome[0] == "raised" else repr(outcome[1])


@exercise("10.first_desync", points=8, description="first_desync(logs): the first index at which the ranks' "
          "collective calls disagree and the ranks that differ from the majority; None when all agree")
def _first_desync(t, first_desync):
    sweep = [_random_logs(random.Random(seed)) for seed in range(300)]
    cases = [logs for _, logs, _, _ in FIXED] + sweep
    results = None
    for name, logs, hidden, hint in FIXED:
        with t.case(name, hidden=hidden, hint=hint):
            if results is None:
                results = t.call(first_desync_all, first_desync, cases)
            outcome = results[[c for c in cases].index(logs)]
            if outcome != ("ok", _expected(logs)):
                t.fail(hint, _expected(logs), _shown(outcome))
    with t.case("logs recorded by the flight recorder in real hung runs (gloo, 3 ranks): a skipped all_reduce, "
                "a shape mismatch, a broadcast against an all_reduce",
                hint="the same rules on real logs: e.g. the skipping rank's log holds a barrier where the others "
                     "hold their second all_reduce"):
        recorded = _recorded_logs(t)
        got = t.call(first_desync_all, first_desync, [recorded[n] for n in HANGS])
        for name, outcome in zip(HANGS, got):
            if outcome != ("ok", _expected(recorded[name])):
                t.fail(f"hung run '{name}', logs {recorded[name]}", _expected(recorded[name]), _shown(outcome))
    with t.case("300 random logs of 1 to 5 ranks agree with the reference", hidden=True):
        if results is None:
            t.fail("the first case did not finish")
        for logs, outcome in zip(sweep, results[len(FIXED):]):
            if outcome != ("ok", _expected(logs)):
                t.fail(f"logs {logs}", _expected(logs), _shown(outcome))


from . import resume10  # noqa: E402,F401  (registers 10.resumable_train, judged in its own module)

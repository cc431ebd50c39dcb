"""Lesson 10's verdicts: the evidence of :mod:`.ranks`, in the words of each case."""
from __future__ import annotations

import math
import os
import random
import shutil
import tempfile

from mgpu_lab.failures import hangs, snapshot
from mgpu_lab.parallel import ddp
from .ranks import HANGS, read_log, record_hangs, run_resumable


# -- first_desync ----------------------------------------------------------------------
AR3, AR4, BAR, BC = ["all_reduce", [3]], ["all_reduce", [4]], ["barrier", []], ["broadcast", [2]]


_recorded: dict = {}


CFG = {"n": 48, "epochs": 3, "batch_size": 4, "lr": 0.1, "every": 4}


WORLD = 2


PER_EPOCH = CFG["n"] // WORLD // CFG["batch_size"]


STEPS = PER_EPOCH * CFG["epochs"]


RUN_TIMEOUT = 90.0


_reference: dict = {}


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


def _where(trial: dict) -> str:
    events = trial.get("events") or []
    if trial["kind"] == "event":
        return f"SIGKILL at file operation {trial['k']} ({trial.get('at', '?')})"
    if trial["kind"] == "bytes":
        after = f" after file operation {trial['k']}" if trial["k"] else ""
        return f"killed{after} once a file being written reaches {trial['n']} bytes"
    return "a complete save" + (f" (file operations: {', '.join(events)})" if events else "")


def judge_trials(t, trials, allowed, hint):
    for trial in trials:
        if trial.get("raised"):
            t.fail(f"{_where(trial)}: your atomic_save raised {trial['raised']}", "no error", trial["raised"])
        if trial["outcome"] not in allowed:
            t.fail(f"{_where(trial)}: {hint}", " or ".join(allowed), trial["outcome"])


def random_logs(rng: random.Random) -> list:
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


def recorded_logs(t) -> dict:
    """Logs of real hung runs (3 ranks, flight recorder, 1 s timeout), recorded once per process."""
    if not _recorded:
        from mgpu_lab.launcher.launch import run

        t._skip_if_hung()
        ranks = run(record_hangs, 3, (1.0,), init=False, quiet=True, echo=False, timeout=90)
        _recorded.update({name: [r[name] for r in ranks] for name in HANGS})
    return _recorded


def expected_desync(logs):
    got = hangs.first_desync([[(op, tuple(shape)) for op, shape in log] for log in logs])
    return None if got is None else [got[0], list(got[1])]


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

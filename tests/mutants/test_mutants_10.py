"""Lesson 10's checks against named wrong answers made from the solution's source, and correct variants.

Each mutant is a bug learners write (or that only shows on a GPU, such as
loading a snapshot without map_location); its check must fail with a message
that names it. Each variant is a correct answer written differently; it must
get full marks.
"""
from __future__ import annotations

import pytest

from mutation import ExerciseMutants, Mutant, Variant, drop_statement, mutant_tests, replace


pytestmark = pytest.mark.timeout(600)

NOTEBOOK = "10_failures.ipynb"
# What the solution cells take from the notebook's first cell.
PRELUDE = """
import os, tempfile, shutil
from collections import Counter
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from mgpu_lab.failures import snapshot
from mgpu_lab import dist as mdist
from mgpu_lab.failures.snapshot import atomic_save
"""


def namespace() -> dict:
    ns: dict = {}
    exec(PRELUDE, ns)
    return ns


DIRECT_WRITE = (replace('with os.fdopen(fd, "wb") as f:', 'os.close(fd)\n        with open(path, "wb") as f:'),
                drop_statement("os.replace(tmp, path)"))

ATOMIC = ExerciseMutants("10.atomic_save", NOTEBOOK, ("atomic_save",), mutants=[
    Mutant("torch.save straight into path", DIRECT_WRITE, expect="half written"),
    Mutant("the temporary file copied over path", replace("os.replace(tmp, path)", "shutil.copyfile(tmp, path)"),
           expect="half written"),
    Mutant("path removed before the rename",
           replace("os.replace(tmp, path)", "if os.path.exists(path):\n            os.remove(path)\n"
                                            "        os.rename(tmp, path)"), expect="missing"),
    Mutant("the rename forgotten", drop_statement("os.replace(tmp, path)"), expect="new"),
    Mutant("the temporary file in the system temp dir", replace("tempfile.mkstemp(dir=directory, ", "tempfile.mkstemp("),
           expect="file system"),
    Mutant("the pickling error swallowed", replace("        raise\n", "        return\n"), expect="propagate"),
], variants=[
    Variant("path + '.tmp', plain open, no fsync", """
def atomic_save(obj, path):
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
"""),
    Variant("pathlib, NamedTemporaryFile in the same directory", """
def atomic_save(obj, path):
    from pathlib import Path
    target = Path(path)
    with tempfile.NamedTemporaryFile(dir=target.parent, delete=False) as f:
        tmp = Path(f.name)
        try:
            torch.save(obj, f)
        except BaseException:
            f.close()
            tmp.unlink()
            raise
    tmp.replace(target)
"""),
])

DESYNC = ExerciseMutants("10.first_desync", NOTEBOOK, ("first_desync",), mutants=[
    Mutant("stops at the shortest log (zip)", replace("longest = max(", "longest = min("), expect="ended"),
    Mutant("compares with rank 0's call", replace(
        "majority = next(call for call in calls if call is not None and counts[call] == top)", "majority = calls[0]"),
        expect="majority"),
    Mutant("compares the op names only", replace("calls = [log[i] if i < len(log)", "calls = [log[i][0] if i < len(log)"),
           expect="shape"),
    Mutant("a tie goes to the highest rank", replace("next(call for call in calls if", "next(call for call in reversed(calls) if"),
           expect="tie"),
    Mutant("[] instead of None when the logs agree", replace("    return None\n", "    return []\n"), expect="none"),
    Mutant("an ended log counted as agreeing",
           replace("if call != majority]", "if call is not None and call != majority]"), expect="ended"),
], variants=[
    Variant("Counter.most_common on rank-ordered calls", """
def first_desync(logs):
    i = 0
    while any(i < len(log) for log in logs):
        calls = [tuple(log[i]) if i < len(log) else None for log in logs]
        present = [c for c in calls if c is not None]
        counts = Counter(present)  # insertion order = rank order, so most_common keeps the lowest rank on a tie
        majority = counts.most_common(1)[0][0]
        odd = sorted(r for r, c in enumerate(calls) if c != majority)
        if odd:
            return (i, odd)
        i += 1
    return None
"""),
    Variant("scores by (count, -first rank)", """
def first_desync(logs):
    for i in range(max(map(len, logs), default=0)):
        calls = [log[i] if i < len(log) else None for log in logs]
        first = {}
        for r, c in enumerate(calls):
            if c is not None:
                first.setdefault(c, r)
        majority = max(first, key=lambda c: (calls.count(c), -first[c]))
        odd = [r for r in range(len(logs)) if calls[r] != majority]
        if odd:
            return i, odd
"""),
])

RESUME = ExerciseMutants("10.resumable_train", NOTEBOOK, ("resumable_train",), mutants=[
    Mutant("the optimizer's state not restored", drop_statement("optimizer.load_state_dict"), expect="optimizer"),
    Mutant("the RNG state not restored", drop_statement("snapshot.set_rng_state"), expect="random state"),
    Mutant("the RNG restored before iter(loader)", (
        replace("        batches = iter(loader)", "        if rng is not None:\n            snapshot.set_rng_state(rng)\n"
                                                 "            rng = None\n        batches = iter(loader)"),),
        expect="iter(loader)"),
    Mutant("resumes at the start of the epoch", replace("for _ in range(step - epoch * per_epoch):", "for _ in range(0):"),
           expect="samples"),
    Mutant("the snapshot written in place", replace("atomic_save({", "torch.save({"), expect="atomic_save"),
    Mutant("no map_location (rank r loads cuda:0 tensors on GPUs)", replace('map_location="cpu", ', ""),
           expect="map_location"),
    Mutant("snapshots only at the end of an epoch", replace("if step % snapshot_every == 0:", "if step % per_epoch == 0:"),
           expect="snapshot_every"),
], variants=[
    Variant("epoch and batch index in the snapshot, islice, the library's helpers", """
def resumable_train(model_fn, dataset, epochs, batch_size, lr, snapshot_path, snapshot_every):
    import itertools
    device = mdist.device()
    model = model_fn().to(device)
    ddp = DDP(model, device_ids=[device.index]) if device.type == "cuda" else DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9)
    sampler = DistributedSampler(dataset)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    start_epoch, start_batch, rng, done = 0, 0, None, 0
    snap = snapshot.load_snapshot(snapshot_path)
    if snap is not None:
        model.load_state_dict(snap["model"])
        opt.load_state_dict(snap["opt"])
        start_epoch, start_batch, done = snap["epoch"], snap["batch"], snap["done"]
        rng = snap["rngs"][dist.get_rank()]
    for epoch in range(start_epoch, epochs):
        sampler.set_epoch(epoch)
        it = iter(loader)
        skip = start_batch if epoch == start_epoch else 0
        it = itertools.islice(it, skip, None)
        if rng is not None:
            snapshot.set_rng_state(rng)
            rng = None
        for b, (x, y) in enumerate(it, start=skip):
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x.to(device)), y.to(device)).backward()
            opt.step()
            done += 1
            if done % snapshot_every == 0:
                rngs = [None] * dist.get_world_size()
                dist.all_gather_object(rngs, snapshot.rng_state())
                nxt = (epoch, b + 1) if b + 1 < len(loader) else (epoch + 1, 0)
                if mdist.is_main_process():
                    snapshot.atomic_save({"model": model.state_dict(), "opt": opt.state_dict(), "epoch": nxt[0],
                                          "batch": nxt[1], "done": done, "rngs": rngs}, snapshot_path)
    return {k: v.cpu() for k, v in model.state_dict().items()}
"""),
    Variant("the library's resumable_train", """
def resumable_train(model_fn, dataset, epochs, batch_size, lr, snapshot_path, snapshot_every):
    return snapshot.resumable_train(model_fn, dataset, epochs, batch_size, lr, snapshot_path, snapshot_every)
"""),
])

SPECS = [ATOMIC, DESYNC, RESUME]


def needs_a_second_file_system(mutant):
    """The temp-dir mutant is only wrong where the system temp dir is on another file system."""
    if mutant.name == "the temporary file in the system temp dir":
        from mgpu_lab.course.checks.l10.judges import other_filesystem

        other = other_filesystem(__import__("tempfile").gettempdir())
        if other is None:
            pytest.skip("no second file system here (e.g. /dev/shm) to put the system temp dir on")
        __import__("shutil").rmtree(other)


test_mutant_fails_naming_its_bug, test_correct_variant_passes, test_every_exercise_has_five_mutants_and_two_variants = \
    mutant_tests(SPECS, "10", namespace, before=needs_a_second_file_system)

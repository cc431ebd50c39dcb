"""Lesson 10's checks against named wrong answers made from the solution's source, and correct variants.

Each mutant is a bug learners write (or that only shows on a GPU, such as
loading a snapshot without map_location); its check must fail with a message
that names it. Each variant is a correct answer written differently; it must
get full marks.
"""
from __future__ import annotations

import pytest

from mutation import ExerciseMutants, Mutant, Variant, cell_of, drop_statement, mutant_tests, replace


pytestmark = pytest.mark.timeout(600)

NOTEBOOK = "10_failures.ipynb"
# What the solution cells take from the notebook's first cell.
PRELUDE = """
import functools, os, tempfile, shutil, time
from collections import Counter
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from mgpu_lab.failures import snapshot
from mgpu_lab import dist as mdist
"""


def namespace() -> dict:
    """The prelude, and the learner's own atomic_save (resumable_train calls it), from the solution cell."""
    ns: dict = {}
    exec(PRELUDE, ns)
    exec(cell_of(ATOMIC), ns)
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
    Mutant("the new file's data not fsynced before the rename", drop_statement("os.fsync(f.fileno())"),
           expect="data was not fsynced before the rename"),
    Mutant("the directory not fsynced after the rename", drop_statement("os.fsync(dir_fd)"),
           expect="directory was not fsynced after the rename"),
    Mutant("fsync before torch.save has written anything",
           (replace("            torch.save(obj, f)\n            f.flush()\n            os.fsync(f.fileno())",
                    "            os.fsync(f.fileno())\n            torch.save(obj, f)"),), expect="before all of it"),
], variants=[
    Variant("path + '.tmp', plain open, fsync of the file object, O_DIRECTORY", """
def atomic_save(obj, path):
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    d = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY)
    os.fsync(d)
    os.close(d)
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
        f.flush()
        os.fdatasync(f.fileno())
    tmp.replace(target)
    fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
"""),
])

GUARD = ExerciseMutants("10.guarded", NOTEBOOK, ("guarded",), mutants=[
    Mutant("the collective's name only compared (shape and dtype let through)",
           replace('mine = collective.__name__ + (f" of shape {list(tensor.shape)}, {tensor.dtype}" if tensor is not '
                   'None else "")', "mine = collective.__name__"),
           ("the collective of call 1 ran", "compare the shapes too")),
    Mutant("a count per collective instead of per rank",
           (replace("    @functools.wraps(collective)\n",
                    "    own = {\"calls\": 0}\n\n    @functools.wraps(collective)\n"),
            replace('_guard["calls"]', 'own["calls"]', count=2)),
           "over every guarded collective"),
    Mutant("rank 0's call taken as the reference", replace(
        "majority = max(calls, key=lambda c: (counts[c], -calls.index(c)))", "majority = calls[0]"),
        ("rank 0, call 1", "majority")),
    Mutant("raises on the odd rank only", replace("        if odd:\n", "        if rank in odd:\n"),
           "the collective of call 1 ran on rank 0"),
    Mutant("the count never advances", replace('        _guard["calls"] += 1\n', ""),
           ("rank 0, call 1", "counted from 0")),
    Mutant("no bound on the wait", replace("deadline = time.monotonic() + GUARD_WAIT", "deadline = float('inf')"),
           ("still waiting", "deadline")),
    Mutant("checks, but never runs the collective", replace("return collective(*args, **kwargs)", "return None"),
           "exactly once"),
], variants=[
    Variant("store.wait with a timeout, json descriptions, most_common", """
import itertools, json, datetime

_count = itertools.count()


def guarded(collective):
    def run(*args, **kwargs):
        t = kwargs["tensor"] if "tensor" in kwargs else (args[0] if args and torch.is_tensor(args[0]) else None)
        me = [collective.__name__, None if t is None else list(t.shape), None if t is None else str(t.dtype)]
        n = next(_count)
        store = dist.distributed_c10d._get_default_store()
        keys = [f"g{n}:{r}" for r in range(dist.get_world_size())]
        store.set(keys[dist.get_rank()], json.dumps(me))
        try:
            store.wait(keys, datetime.timedelta(seconds=2))
        except Exception:
            late = [r for r, k in enumerate(keys) if not store.check([k])]
            raise RuntimeError(f"rank {late[0]} never reached call {n}") from None
        seen = [json.loads(store.get(k)) for k in keys]
        top = Counter(json.dumps(c) for c in seen).most_common(1)[0][0]
        bad = [r for r, c in enumerate(seen) if json.dumps(c) != top]
        if bad:
            raise RuntimeError(f"desync at call {n}: rank {bad[0]} is doing {seen[bad[0]]}, the rest {top}")
        return collective(*args, **kwargs)
    return run
"""),
    Variant("a class with the count, polling each key", """
class _Guard:
    calls = 0


def guarded(collective):
    import pickle

    def wrapper(*args, **kwargs):
        tensor = next((a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)), None)
        what = (collective.__name__,) + ((tuple(tensor.shape), str(tensor.dtype)) if tensor is not None else ())
        call, _Guard.calls = _Guard.calls, _Guard.calls + 1
        store, world = dist.distributed_c10d._get_default_store(), dist.get_world_size()
        store.set(f"guarded-{call}-{dist.get_rank()}", pickle.dumps(what))
        waiting, t0 = set(range(world)), time.time()
        while waiting and time.time() - t0 < 2.5:
            waiting = {r for r in waiting if not store.check([f"guarded-{call}-{r}"])}
            time.sleep(0.01)
        if waiting:
            raise RuntimeError(f"call {call}: no answer from rank {min(waiting)}")
        whats = [pickle.loads(store.get(f"guarded-{call}-{r}")) for r in range(world)]
        best = sorted(set(whats), key=lambda w: (-whats.count(w), whats.index(w)))[0]
        for r, w in enumerate(whats):
            if w != best:
                raise RuntimeError(f"call {call}: rank {r} does {w}, the majority {best}")
        return collective(*args, **kwargs)
    return wrapper
"""),
])

RESUME = ExerciseMutants("10.resumable_train", NOTEBOOK, ("resumable_train",), mutants=[
    Mutant("the optimizer's state not restored", drop_statement("optimizer.load_state_dict"), expect="optimizer"),
    Mutant("the RNG state not restored", drop_statement("snapshot.set_rng_state"), expect="random state"),
    Mutant("the RNG restored before iter(loader)", (
        replace("        batches = iter(loader)", "        if rng is not None:\n            snapshot.set_rng_state(rng)\n"
                                                 "            rng = None\n        batches = iter(loader)"),),
        expect=("random state", "iterator was made")),
    Mutant("resumes at the start of the epoch", replace("for _ in range(step - epoch * per_epoch):", "for _ in range(0):"),
           expect="samples"),
    Mutant("the snapshot written in place", replace("atomic_save({", "torch.save({"), expect="atomic_save"),
    Mutant("no map_location (rank r loads cuda:0 tensors on GPUs)", replace('map_location="cpu", ', ""),
           expect="map_location"),
    Mutant("snapshots only at the end of an epoch", replace("if step % snapshot_every == 0:", "if step % per_epoch == 0:"),
           expect="snapshot_every"),
], variants=[
    Variant("epoch and batch index in the snapshot, islice, the library's RNG helpers", """
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
                    atomic_save({"model": model.state_dict(), "opt": opt.state_dict(), "epoch": nxt[0],
                                 "batch": nxt[1], "done": done, "rngs": rngs}, snapshot_path)
    return {k: v.cpu() for k, v in model.state_dict().items()}
"""),
    Variant("skips done batches with continue, map_location to the device, torch's RNG calls", """
def resumable_train(model_fn, dataset, epochs, batch_size, lr, snapshot_path, snapshot_every):
    device = mdist.device()
    net = model_fn().to(device)
    wrapped = DDP(net, device_ids=[device.index]) if device.type == "cuda" else DDP(net)
    sgd = torch.optim.SGD(wrapped.parameters(), lr=lr, momentum=0.9)
    sampler = DistributedSampler(dataset)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    steps, pending = 0, None
    if os.path.isfile(snapshot_path):
        saved = torch.load(snapshot_path, map_location=device, weights_only=True)
        net.load_state_dict(saved["net"])
        sgd.load_state_dict(saved["sgd"])
        steps, pending = saved["steps"], saved["cpu_rng"][dist.get_rank()]
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for b, (x, y) in enumerate(loader):
            if epoch * len(loader) + b < steps:
                continue
            if pending is not None:
                torch.set_rng_state(pending.cpu())
                pending = None
            sgd.zero_grad()
            nn.CrossEntropyLoss()(wrapped(x.to(device)), y.to(device)).backward()
            sgd.step()
            steps += 1
            if steps % snapshot_every == 0:
                states = [None] * dist.get_world_size()
                dist.all_gather_object(states, torch.get_rng_state())
                if dist.get_rank() == 0:
                    atomic_save({"net": net.state_dict(), "sgd": sgd.state_dict(), "steps": steps,
                                 "cpu_rng": states}, snapshot_path)
    return net.state_dict()
"""),
])

SPECS = [ATOMIC, GUARD, RESUME]


def needs_a_second_file_system(mutant):
    """The temp-dir mutant is only wrong where the system temp dir is on another file system."""
    if mutant.name == "the temporary file in the system temp dir":
        from mgpu_lab.course.checks.l10.judges import other_filesystem

        other = other_filesystem(__import__("tempfile").gettempdir())
        if other is None:
            pytest.skip("no second file system here (e.g. /dev/shm) to put the system temp dir on")
        __import__("shutil").rmtree(other)


test_mutant_fails_naming_its_bug, test_correct_variant_passes, test_every_exercise_has_five_mutants_and_two_variants = \
    mutant_tests(SPECS, "10", namespace, before=needs_a_second_file_system, at_once=4)

"""What lesson 10's checks run in fresh processes, in real ranks and in torchrun workers.

- :func:`atomic_probe` runs the learner's ``atomic_save`` in forked writer
  processes killed at every file operation of the save (SIGKILL from an audit
  hook) and at byte offsets of the writes (``RLIMIT_FSIZE``), and loads what
  each one left;
- :func:`run_resumable` runs ``resumable_train`` in a rank with a model that
  logs, at every forward pass, a checksum of the batch, of the RNG state and of
  the weights to a file (a killed rank's log survives it), and kills the rank
  at a step, or while it writes a snapshot, on the attempt the check chose;
- :func:`guard_probe` runs the hang programs of the lesson (a skipped
  all_reduce, a shape mismatch, a broadcast against an all_reduce, ...) with
  the learner's guarded collectives, and returns what ran and what was raised.

Everything returned is plain data; :mod:`.checkers` judges it in the kernel.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import resource
import signal
import stat
import sys
import tempfile
import torch

from mgpu_lab.data.datasets import synthetic_classification


# -- atomic_save -----------------------------------------------------------------------
OLD = {"version": 1, "weights": torch.arange(3000, dtype=torch.float32)}


NEW = {"version": 2, "weights": torch.arange(3000, dtype=torch.float32) * 2}


FILE_EVENTS = {"open", "os.rename", "os.remove", "shutil.copyfile", "shutil.move", "os.truncate", "os.link",
               "os.symlink", "tempfile.mkstemp"}


def classify(path: str) -> str:
    """What a file holds after a save: "old", "new", "missing" or "torn" (it does not load, or loads as neither).

    The check says why in its own words (:func:`.judges.outcome_words`): the reason torch gives for a file it
    cannot load (an ``UnpicklingError`` about ``weights_only``, a zip archive without its end) points away
    from what happened, a writer killed halfway through.
    """
    if not os.path.exists(path):
        return "missing"
    try:
        obj = torch.load(path, weights_only=True)
    except Exception:  # noqa: BLE001 - any failure to load is a torn file
        return "torn"
    for name, ref in (("old", OLD), ("new", NEW)):
        if isinstance(obj, dict) and obj.get("version") == ref["version"] \
                and torch.equal(obj["weights"], ref["weights"]):
            return name
    return "torn"


class _Unpicklable:
    def __reduce__(self):
        raise TypeError("cannot pickle this object (the check's stand-in for a lambda or an open file)")


def _child(atomic_save, obj, path, trial, watch, out_fd) -> None:
    """In a forked writer: arm the kill, save, report the file operations and fsyncs seen through the pipe."""
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it; the default kills the process
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if trial.get("tmpdir"):
        os.environ["TMPDIR"] = tempfile.tempdir = trial["tmpdir"]
    seen, log = [], []
    kind, k = trial["kind"], trial.get("k", 0)

    def hook(event, args):
        if event not in FILE_EVENTS or not any(
                isinstance(a, (str, bytes, os.PathLike)) and os.fsdecode(a).startswith(tuple(watch)) for a in args):
            return
        seen.append(event)
        if event == "os.rename":
            log.append(_renamed(args))
        if kind == "event" and len(seen) == k:
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "bytes" and len(seen) == k:
            resource.setrlimit(resource.RLIMIT_FSIZE, (trial["n"], trial["n"]))

    _record_fsyncs(log)
    sys.addaudithook(hook)
    if kind == "bytes" and k == 0:
        resource.setrlimit(resource.RLIMIT_FSIZE, (trial["n"], trial["n"]))
    report = {"events": seen, "log": log}
    try:
        atomic_save(obj, path)
        report["returned"] = True
    except BaseException as exc:  # noqa: BLE001 - reported to the check
        report["raised"] = f"{type(exc).__name__}: {exc}"[:300]
    os.write(out_fd, json.dumps(report).encode())
    os._exit(0)


def _identity(st) -> list:
    """A file's identity and size, as plain data: ``[st_dev, st_ino, st_size]``."""
    return [st.st_dev, st.st_ino, st.st_size]


def _renamed(args) -> dict:
    """What an ``os.rename`` (``os.replace``, ``Path.rename``, ...) audit event is about to move where."""
    src, dst, src_fd, dst_fd = (list(args) + [-1, -1])[:4]
    src_fd, dst_fd = (None if fd in (None, -1) else fd for fd in (src_fd, dst_fd))  # the audit event's -1: none
    try:
        st = os.stat(src, dir_fd=src_fd)
        ident = _identity(st)
    except OSError:
        ident = None
    where = os.path.dirname(os.path.realpath(os.fsdecode(src))) if src_fd is None else None
    return {"op": "rename", "src": ident, "src_dir": where,
            "dst": os.path.realpath(os.fsdecode(dst)) if dst_fd is None else None}


def _record_fsyncs(log: list) -> None:
    """In this (forked) writer: note every ``os.fsync``/``os.fdatasync``, what it was called on and its size."""
    for name in ("fsync", "fdatasync"):
        real = getattr(os, name, None)
        if real is None:
            continue

        def recorded(fd, _real=real, _name=name):
            st = os.fstat(fd if isinstance(fd, int) else fd.fileno())
            log.append({"op": _name, "file": _identity(st), "dir": stat.S_ISDIR(st.st_mode)})
            return _real(fd)

        setattr(os, name, recorded)


def _trial(atomic_save, root, trial, watch) -> dict:
    d = tempfile.mkdtemp(dir=root)
    path = os.path.join(d, "snapshot.pt")
    if trial.get("old", True):
        torch.save(OLD, path)
    obj = [_Unpicklable()] if trial.get("bad") else NEW
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child leaves through os._exit
        os.close(read)
        try:
            _child(atomic_save, obj, path, trial, [d, *watch], write)
        finally:
            os._exit(1)
    os.close(write)
    chunks = []
    while chunk := os.read(read, 65536):
        chunks.append(chunk)
    os.close(read)
    _, status = os.waitpid(pid, 0)
    report = json.loads(b"".join(chunks) or b"{}")
    killed = os.WIFSIGNALED(status) and signal.Signals(os.WTERMSIG(status)).name
    left = sorted(n for n in os.listdir(d) if n != "snapshot.pt")
    final = _identity(os.stat(path)) if os.path.exists(path) else None
    return {**trial, "outcome": classify(path), "killed": killed or "", "leftovers": left,
            "path": os.path.realpath(path),
            "final": final, "directory": _identity(os.stat(d))[:2], **report}


def atomic_probe(atomic_save, root: str, other_fs: str | None) -> dict:
    """Probe: every trial of the atomic_save check; a NotImplementedError stub raises here at once."""
    first = os.path.join(tempfile.mkdtemp(dir=root), "snapshot.pt")
    atomic_save(OLD, first)  # in this process: NotImplementedError reaches the check
    plain = [classify(first)]
    atomic_save(NEW, first)
    plain.append(classify(first))
    watch = [tempfile.gettempdir()] + ([other_fs] if other_fs else [])
    dry = _trial(atomic_save, root, {"kind": "count"}, watch)
    n_events = len(dry.get("events", []))
    size = len(_saved_bytes(NEW))
    events = [_trial(atomic_save, root, {"kind": "event", "k": k}, watch) for k in range(1, n_events + 1)]
    offsets = sorted({1, size // 2})
    byte_trials = [_trial(atomic_save, root, {"kind": "bytes", "k": k, "n": n}, watch)
                   for k in range(0, n_events + 1) for n in offsets]
    fresh = [_trial(atomic_save, root, {"kind": "event", "k": k, "old": False}, watch)
             for k in range(1, n_events + 1)]
    fresh += [_trial(atomic_save, root, {"kind": "bytes", "k": 0, "n": size // 2, "old": False}, watch)]
    bad = _trial(atomic_save, root, {"kind": "count", "bad": True}, watch)
    cross = (_trial(atomic_save, root, {"kind": "count", "tmpdir": other_fs}, watch) if other_fs else None)
    return {"plain": plain, "dry": dry, "events": events, "bytes": byte_trials, "fresh": fresh, "bad": bad,
            "cross": cross, "size": size}


def _saved_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


# -- resumable_train -------------------------------------------------------------------
def check_model():
    """The model the check trains: dropout makes the RNG state part of what a resume must restore."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                               torch.nn.Linear(16, 3))


def check_data(n: int = 48):
    return synthetic_classification(n, features=6, classes=3, seed=3)


def _digest(device: torch.device) -> str:
    """A short digest of the RNG state dropout draws from: the CPU generator, and the GPU's on a GPU."""
    h = hashlib.sha1(torch.get_rng_state().numpy().tobytes())
    if device.type == "cuda":
        h.update(torch.cuda.get_rng_state(device).numpy().tobytes())
    return h.hexdigest()[:12]


def run_resumable(resumable_train, cfg: dict, snapshot_path: str, log_dir: str, attempt, kill) -> dict:
    """Probe: one attempt of the learner's resumable_train in this rank, its evidence logged to a file.

    Args:
        cfg: ``n, epochs, batch_size, lr, every``.
        attempt: which attempt this is (None: torchrun's TORCHELASTIC_RESTART_COUNT).
        kill: None, ``["step", attempt, rank, n]`` (SIGKILL as forward pass n starts) or
            ``["save", attempt, rank, m]`` (killed while the m-th torch.save writes: RLIMIT_FSIZE).
    """
    import torch.distributed as tdist

    if attempt is None:
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank = tdist.get_rank()
    log = open(os.path.join(log_dir, f"a{attempt}r{rank}.jsonl"), "a", buffering=1)
    mine = bool(kill) and kill[1] == attempt and kill[2] == rank
    counts = {"f": 0, "save": 0}
    real_save, real_load = torch.save, torch.load

    def hook(module, inputs):
        counts["f"] += 1
        if mine and kill[0] == "step" and counts["f"] == kill[3]:
            os.kill(os.getpid(), signal.SIGKILL)
        x = inputs[0]
        w = torch.cat([p.detach().reshape(-1).double().cpu() for p in module.parameters()])
        log.write(json.dumps({"f": counts["f"], "x": float(x.detach().double().sum()), "rng": _digest(x.device),
                              "w": [float(w.sum()), float(w.square().sum())]}) + "\n")

    def model_fn():
        model = check_model()
        model.register_forward_pre_hook(hook)
        return model

    def save(obj, f, *args, **kwargs):
        if isinstance(f, io.BytesIO):  # e.g. all_gather_object pickling through torch.save: not a snapshot
            return real_save(obj, f, *args, **kwargs)
        counts["save"] += 1
        log.write(json.dumps({"save": counts["save"], "after": counts["f"]}) + "\n")
        if mine and kill[0] == "save" and counts["save"] == kill[3]:
            signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))  # dies once a file it writes passes 1 KiB
        return real_save(obj, f, *args, **kwargs)

    def load(f, *args, **kwargs):
        if isinstance(f, io.BytesIO):
            return real_load(f, *args, **kwargs)
        where = kwargs.get("map_location", args[0] if args else None)
        log.write(json.dumps({"load": None if where is None else repr(where)}) + "\n")
        return real_load(f, *args, **kwargs)

    torch.save, torch.load = save, load
    try:
        state = resumable_train(model_fn, check_data(cfg["n"]), cfg["epochs"], cfg["batch_size"], cfg["lr"],
                                snapshot_path, cfg["every"])
    finally:
        torch.save, torch.load = real_save, real_load
        log.close()
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        return {"state": None, "type": type(state).__name__}
    return {"state": {k.removeprefix("module."): v.detach().cpu().clone() for k, v in state.items()}, "type": "dict"}


def read_log(log_dir: str, attempt: int, rank: int) -> list[dict]:
    """The records one attempt of one rank left (forward passes, saves, loads), in order."""
    path = os.path.join(log_dir, f"a{attempt}r{rank}.jsonl")
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a rank killed mid-line
                break
    return out


# -- guarded ---------------------------------------------------------------------------
GUARD_SCENARIOS = ("agree", "skip", "shape", "order", "dtype", "absent")
PROBE_TIMEOUT = 2.0  # seconds a collective the guard let through may wait (the probe's own group) before it fails
ABSENT_WAIT = 30.0  # seconds the absent rank waits for the others to finish (it makes no guarded call)


def _counted(collective, ran: list):
    """``collective``, noting each call that really ran (its name keeps: a guard may read ``__name__``)."""
    import functools

    @functools.wraps(collective)
    def call(*args, **kwargs):
        ran.append(collective.__name__)
        return collective(*args, **kwargs)

    return call


def guard_probe(guarded, scenario: str, bound: float = 60.0) -> dict:
    """Probe (3 ranks): one scenario of guarded collectives; what ran, what came back, what was raised and when.

    ``agree``: 12 agreeing calls; ``skip``: rank 2 skips the second all_reduce; ``shape``: rank 0
    all-reduces 4 numbers where the others all-reduce 3; ``order``: rank 1 broadcasts where the others
    all-reduce; ``dtype``: rank 1 all-reduces float64 where the others float32; ``absent``: rank 2 makes
    no second call at all. Every collective runs on a group of the probe's with a short timeout, so a
    mismatched collective the guard lets through fails in seconds instead of hanging. The calls run in a
    thread that this one watches: one still waiting after ``bound`` seconds (a guard with no deadline) is
    reported as ``waiting`` at once, instead of holding the ranks until the launch's timeout.
    """
    import datetime
    import threading
    import time

    import torch.distributed as tdist

    rank, ran, results = tdist.get_rank(), [], []
    group = tdist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=PROBE_TIMEOUT))
    store = tdist.distributed_c10d._get_default_store()
    ar, bc, bar = (guarded(_counted(f, ran)) for f in (tdist.all_reduce, tdist.broadcast, tdist.barrier))
    start, out = time.monotonic(), {"raised": None}
    worker = threading.Thread(target=_guard_calls, args=(scenario, rank, (ar, bc, bar), group, store, results, out),
                              daemon=True, name="guard-probe")
    worker.start()
    worker.join(bound)
    if worker.is_alive():  # still inside the guard: it waits with no deadline
        out["waiting"] = round(time.monotonic() - start, 2)
    if scenario == "absent" and rank != 2:
        store.set(f"guard-probe/done/{rank}", "1")
    out.update(ran=list(ran), results=list(results), seconds=round(time.monotonic() - start, 2))
    return out


def _guard_calls(scenario: str, rank: int, calls: tuple, group, store, results: list, out: dict) -> None:
    """The calls of one scenario (see :func:`guard_probe`), in the probe's thread; what was raised into ``out``."""
    import datetime

    ar, bc, bar = calls
    try:
        if scenario == "agree":
            for step in range(4):
                t = torch.arange(3.0) + rank + step
                results.append(ar(t, group=group) is None and t.tolist())
                b = torch.full((2,), float(rank * 10 + step))
                bc(b, src=step % 3, group=group)
                results.append(b.tolist())
                bar(group=group)
            return
        ar(torch.ones(3), group=group)  # call 0: every rank agrees
        if scenario == "skip" and rank != 2:
            ar(torch.ones(3), group=group)
        elif scenario == "shape":
            ar(torch.ones(4 if rank == 0 else 3), group=group)
        elif scenario == "order":
            (bc(torch.ones(2), src=0, group=group) if rank == 1 else ar(torch.ones(2), group=group))
        elif scenario == "dtype":
            ar(torch.ones(3, dtype=torch.float64 if rank == 1 else torch.float32), group=group)
        elif scenario == "absent":
            if rank != 2:
                ar(torch.ones(3), group=group)
            else:  # makes no call: waits until the others are done (or gave up)
                store.wait([f"guard-probe/done/{r}" for r in (0, 1)], datetime.timedelta(seconds=ABSENT_WAIT))
        if not (scenario == "absent" and rank == 2):
            bar(group=group)
    except Exception as exc:  # noqa: BLE001 - the check judges what the guard raised
        out["raised"] = [type(exc).__name__, str(exc)[:500]]

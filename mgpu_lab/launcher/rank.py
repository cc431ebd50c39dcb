"""What runs inside each rank started by :func:`mgpu_lab.launch`.

The forkserver preloads this module (and so torch), then forks one clean
process per rank; :func:`rank_main` wires the rank's output to the launcher,
sets the torchrun variables, initialises the process group, runs the shipped
function and sends back its return value or its traceback.
"""
from __future__ import annotations

import datetime
import faulthandler
import multiprocessing
import multiprocessing.util
import os
import signal
import sys
import threading
import time
import traceback

import cloudpickle
import torch
import torch.distributed as tdist
import torch.nn.parallel  # noqa: F401  (preloaded: most lessons wrap with DDP)

from mgpu_lab.core import compat

from . import pickling, procs
from .lifetime import bind_rank

compat.install()  # torch 2.13's collective names on an older torch: lessons use them in ranks

report = None  # in a launched rank: report(kind, data) sends a message to the launcher


def _wire_output(out, err, stacks) -> None:
    os.dup2(out.fileno(), 1)
    os.dup2(err.fileno(), 2)
    out.close()
    err.close()
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True, write_through=True)
    faulthandler.enable(file=sys.stderr, all_threads=True)
    # The launcher sends SIGUSR1 to a hung rank to collect its Python stack.
    faulthandler.register(signal.SIGUSR1, file=stacks.fileno(), all_threads=True)


def _fresh_random_state() -> None:
    # Forked ranks inherit the forkserver's NumPy generator: every rank of every
    # launch would draw the same numbers. Seed it from the OS as a new process
    # (torchrun's) would. Python's `random` is reseeded on fork by Python itself,
    # and torch's default seed is the same fixed value in any new process.
    import numpy as np

    np.random.seed(int.from_bytes(os.urandom(4), "little"))


def _to_cpu(obj):
    """Move tensors in (nested) containers to the CPU so the launcher never touches CUDA."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu() if obj.device.type != "cpu" else obj
    if isinstance(obj, dict):
        return type(obj)((k, _to_cpu(v)) for k, v in obj.items()) if type(obj) is dict else obj
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def describe_exception(exc: BaseException) -> dict:
    """Everything the launcher needs to re-render a rank's exception."""
    te = traceback.TracebackException.from_exception(exc, lookup_lines=False)
    frames = [(f.filename, f.lineno, f.name, f.line or "") for f in te.stack]
    try:
        pickled = pickling.dumps(exc)
    except Exception:  # noqa: BLE001 - an unpicklable exception still gets reported
        pickled = None
    return {
        "type": type(exc).__name__,
        "message": str(exc),
        "frames": frames,
        "exception_only": "".join(te.format_exception_only()),
        "pickled": pickled,
        "time": time.time(),
        "cause": _cause(te),
    }


def _cause(te: traceback.TracebackException) -> dict | None:
    """The exception this one was raised from (``raise ... from``), as frames and text; None if none.

    A wrapper (e.g. torch's "[Stage 1] failed to run forward") hides the learner's own error, which
    pickling the exception loses (a pickled exception keeps no ``__cause__``)."""
    cause = te.__cause__
    if cause is None:
        return None
    return {"frames": [(f.filename, f.lineno, f.name, f.line or "") for f in cause.stack],
            "exception_only": "".join(cause.format_exception_only()), "cause": _cause(cause)}


def exit_status(code) -> int:
    """The exit status a process gets from ``sys.exit(code)``, as Python computes it.

    Example:
        >>> exit_status(None), exit_status(3), exit_status(256), exit_status("bye")
        (0, 3, 0, 1)
    """
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    return 1


def rank_main(payload: bytes, spec: dict, out, err, stacks, chan, lifeline) -> None:
    """Entry point of one rank (runs in the forked child).

    Args:
        payload: cloudpickled ``(fn, args, kwargs)``.
        spec: rank, world size, environment, backend, device, init flag, timeout.
        out, err, stacks: write ends of the launcher's pipes (stdout, stderr, stack dumps).
        chan: message connection back to the launcher.
        lifeline: read end of the launch's lifeline (see :mod:`.lifetime`).
    """
    lock = _enter(spec, out, err, stacks, chan, lifeline)
    phase = "init"
    try:  # here, not in a helper: a learner's traceback starts below this frame, which relay cuts off
        fn, args, kwargs = _setup(payload, spec)
        phase = "fn"
        result = fn(*args, **kwargs)
        try:
            blob = pickling.dumps(_to_cpu(result))
        except Exception as exc:  # noqa: BLE001 - any pickling failure is the learner's to fix
            raise TypeError(
                f"rank {spec['rank']} returned a value of type {type(result).__name__} that "
                f"cannot be sent back to the launcher ({exc}); return plain data instead "
                "(numbers, strings, tensors, lists, dicts)"
            ) from None
        if tdist.is_available() and tdist.is_initialized():
            tdist.destroy_process_group()
        msg, code = ("ok", blob), 0
    except SystemExit as exc:
        msg, code = _exited(exc, phase)
    except BaseException as exc:  # noqa: BLE001 - report everything
        # Report before any teardown: the other ranks may be stuck waiting for this one.
        msg, code = ("error", dict(describe_exception(exc), phase=phase)), 1
    _leave(msg, code, lock, chan)


def _enter(spec: dict, out, err, stacks, chan, lifeline) -> threading.Lock:
    """Become the rank ``spec`` describes: tied to the launch, its output wired, its environment; the
    lock that guards ``chan``."""
    bind_rank(lifeline)  # first: from here on nothing this rank starts outlives the launch
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher stops ranks on Ctrl-C
    _wire_output(out, err, stacks)
    global report
    lock = threading.Lock()

    def report(kind, data):  # noqa: F811 - set once per rank process
        with lock:
            chan.send((kind, data))

    os.environ.clear()
    os.environ.update(spec["env"])
    _fresh_random_state()
    # multiprocessing made this process's start method "forkserver"; DataLoader
    # workers of the rank should start as the caller's (and torchrun's) would
    # (None: unset, the platform's default).
    multiprocessing.set_start_method(spec.get("start_method"), force=True)
    return lock


def _setup(payload: bytes, spec: dict):
    """The learner's ``(fn, args, kwargs)``, with the threads and the process group ``spec`` asks for."""
    threads = spec["env"].get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))  # the pool was sized in the forkserver
    fn, args, kwargs = cloudpickle.loads(payload)
    if spec["init"]:
        if spec["backend"] == "nccl":
            torch.cuda.set_device(spec["device"])
        tdist.init_process_group(
            spec["backend"], rank=spec["rank"], world_size=spec["world_size"],
            timeout=datetime.timedelta(seconds=spec["pg_timeout"]),
        )
    return fn, args, kwargs


def _exited(exc: SystemExit, phase: str) -> tuple[tuple, int]:
    code = exit_status(exc.code)
    if code == 0:  # sys.exit(0) or sys.exit(): the rank finished, as under torchrun
        try:
            if tdist.is_available() and tdist.is_initialized():
                tdist.destroy_process_group()
        except Exception as teardown:  # noqa: BLE001 - reported like any other error
            return ("error", dict(describe_exception(teardown), phase="fn")), 1
        return ("ok", cloudpickle.dumps(None)), 0
    if not isinstance(exc.code, int):
        print(exc.code, file=sys.stderr)  # as Python prints sys.exit("message")
    return ("error", dict(describe_exception(exc), phase=phase, exit={"arg": repr(exc.code), "status": code})), code


def _leave(msg: tuple, code: int, lock: threading.Lock, chan) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    with lock:
        chan.send(msg)
    chan.close()
    # DataLoader workers and other children of the rank (its guard, and orphans it
    # adopted as a subreaper: a shell's `cmd &`) must not outlive it.
    procs.kill_descendants(os.getpid(), wait=2)
    try:  # unregister semaphores etc. (tqdm's locks) that os._exit would leave behind
        multiprocessing.util._run_finalizers(0)
    except Exception:  # noqa: BLE001 - exiting matters more
        pass
    os._exit(code)

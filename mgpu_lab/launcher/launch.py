"""Start N real ranks from a notebook or a script: ``launch(fn, nprocs, ...)``.

Every rank is a real process with the torchrun variables set and (by default)
the process group initialised; functions and classes defined in notebook cells
travel by value (cloudpickle). Output of every rank appears live in the calling
cell, prefixed ``[rank r/w]``. A rank that raises or dies stops the others and
raises :class:`LaunchError` with its traceback; a hang raises
:class:`LaunchTimeout` with every rank's Python stack.

Example:
    >>> import torch, torch.distributed as dist
    >>> from mgpu_lab import launch
    >>> def total(x):
    ...     t = torch.tensor([float(dist.get_rank() + x)])
    ...     dist.all_reduce(t)
    ...     return t.item()
    >>> launch(total, 2, 1)   # prints: launch: 2 ranks · gloo · cpu (...)
    [3.0, 3.0]
"""
from __future__ import annotations

import datetime
import multiprocessing
import os

from . import procs

if os.environ.get("MGPU_LAB_PREWARM", "1") != "0" and "MGPU_LAB_IN_RANK" not in os.environ:
    # Start the forkserver before this process imports torch below: the two
    # imports overlap, and the first launch finds the server (nearly) ready.
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        procs.prewarm()

import cloudpickle  # noqa: E402

from mgpu_lab import dist  # noqa: E402
from . import rank as _rank  # noqa: E402
from .errors import LaunchError, LaunchTimeout  # noqa: E402 (learners catch them as launch's)
from .job import Job  # noqa: E402
from mgpu_lab.devices import cpu_count  # noqa: E402

__all__ = ["launch", "run", "LaunchError", "LaunchTimeout", "prewarm", "banner"]

DEFAULT_TIMEOUT = float(os.environ.get("MGPU_LAB_TIMEOUT", "300"))
INIT_ATTEMPTS = 3  # gloo's loopback set-up fails about once in 150 launches here: retry it
prewarm = procs.prewarm


def _validate(fn, nprocs, timeout) -> None:
    if not callable(fn):
        raise TypeError(f"launch needs a function to run in every rank, got {fn!r} of type {type(fn).__name__}")
    if isinstance(nprocs, bool) or not isinstance(nprocs, int):
        raise TypeError(f"nprocs must be an int (the number of ranks), got {nprocs!r}")
    if nprocs < 1:
        raise ValueError(
            f"nprocs={nprocs}: launch needs at least one rank; pass the number of "
            "processes to start, e.g. nprocs=2"
        )
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(
            f"timeout={timeout!r}: pass the number of seconds after which a hung "
            "launch is stopped, e.g. timeout=60"
        )


def banner(nprocs: int, backend: str, devices: list[str], init: bool = True) -> str:
    """The one line that says what a launch runs on.

    Example:
        >>> banner(4, "gloo", ["cpu"] * 4)[:26]
        'launch: 4 ranks · gloo · c'
    """
    ranks = f"{nprocs} rank" + ("s" if nprocs != 1 else "")
    if devices[0] == "cpu":
        where = "cpu (no CUDA GPU visible"
        cores = cpu_count()
        where += f"; {nprocs} ranks share {cores} CPU cores)" if nprocs > cores else ")"
    elif backend == "nccl":
        where = f"cuda:0..{nprocs - 1}, one GPU per rank" if nprocs > 1 else "cuda:0"
    else:
        used = sorted(set(devices), key=devices.index)
        where = f"{', '.join(used)} shared by {nprocs} ranks ({len(used)} CUDA GPU(s) visible)"
    pg = backend if init else f"init=False (ranks call init_process_group themselves; {backend} suggested)"
    return f"launch: {ranks} · {pg} · {where}"


def _rank_env(rank: int, nprocs: int, port: int, backend: str, device: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nprocs),
        LOCAL_WORLD_SIZE=str(nprocs), GROUP_RANK="0", ROLE_RANK=str(rank),
        ROLE_WORLD_SIZE=str(nprocs), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        # As under torchrun: the launcher hosts the store, every rank is a client.
        TORCHELASTIC_USE_AGENT_STORE="True",
        MGPU_LAB_BACKEND=backend, MGPU_LAB_DEVICE=device, MGPU_LAB_IN_RANK="1",
        PYTHONUNBUFFERED="1",
    )
    # torchrun's rule: one intra-op thread per rank unless the user chose otherwise.
    env.setdefault("OMP_NUM_THREADS", str(max(1, cpu_count() // nprocs)))
    return env


def launch(fn, nprocs: int, *args, backend: str | None = None,
           timeout: float = DEFAULT_TIMEOUT, init: bool = True, **kwargs) -> list:
    """Run ``fn(*args, **kwargs)`` in ``nprocs`` real processes; return their results.

    Before ``fn`` runs, RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR
    and MASTER_PORT are set as torchrun sets them and the default process group
    is initialised (destroyed afterwards). Read them with :mod:`mgpu_lab.dist`.

    Args:
        fn: the function every rank runs; may be defined in a notebook cell.
        nprocs: number of ranks.
        *args: positional arguments for ``fn`` (pickled with cloudpickle).
        backend: ``None`` (NCCL with one GPU per rank when enough GPUs are
            visible, else gloo), ``"nccl"`` or ``"gloo"``.
        timeout: seconds before a hung launch is stopped with every rank's stack.
        init: ``False`` leaves ``init_process_group`` to ``fn``.
        **kwargs: keyword arguments for ``fn``.

    Returns:
        The return values in rank order (tensors come back on the CPU).

    Raises:
        ValueError, TypeError: bad arguments, NCCL without one GPU per rank, or
            arguments that cannot be pickled.
        LaunchError: a rank raised or died (message: its rank and traceback).
        LaunchTimeout: the ranks did not finish within ``timeout``.
        KeyboardInterrupt: interrupted; every rank has been stopped.

    Example:
        >>> launch(lambda: dist.get_rank(), 2)
        [0, 1]
    """
    return run(fn, nprocs, args, kwargs, backend=backend, timeout=timeout, init=init)


def run(fn, nprocs: int, args: tuple = (), kwargs: dict | None = None, *, backend: str | None = None,
        timeout: float = DEFAULT_TIMEOUT, init: bool = True, quiet: bool = False,
        echo: bool = True) -> list:
    """:func:`launch` with the arguments of ``fn`` passed as a tuple and a dict.

    For library code (the checks) that needs every launcher option without
    reserving more keyword names of ``fn``: ``quiet=True`` prints no banner,
    ``echo=False`` keeps the ranks' output out of the cell (a LaunchError then
    carries it as ``output``).
    """
    kwargs = kwargs or {}
    _validate(fn, nprocs, timeout)
    backend, devices = dist.choose(nprocs, backend)
    try:
        payload = cloudpickle.dumps((fn, args, kwargs))
    except Exception as exc:  # noqa: BLE001 - pickling can fail in many ways
        raise TypeError(
            f"could not send {getattr(fn, '__name__', fn)!r} and its arguments to the ranks: "
            f"{type(exc).__name__}: {exc}. Everything passed to launch is pickled with "
            "cloudpickle; pass plain data (tensors, numbers, lists) or create the object inside fn"
        ) from exc
    if not quiet:
        print(banner(nprocs, backend, devices, init), flush=True)
    for attempt in range(1, INIT_ATTEMPTS + 1):
        try:
            return _run(payload, nprocs, backend, devices, timeout, init, echo)
        except LaunchError as exc:
            if not (_is_gloo_connect_race(exc) and attempt < INIT_ATTEMPTS):
                raise
            print(f"launch: gloo's connection set-up failed before fn ran ({exc.exc_type}: "
                  f"'Connection closed by peer', a known rare gloo race on loopback); "
                  f"retrying ({attempt}/{INIT_ATTEMPTS - 1})", flush=True)
    raise AssertionError("unreachable")  # pragma: no cover


def _is_gloo_connect_race(exc: LaunchError) -> bool:
    return exc.phase == "init" and "connectFullMesh" in str(exc)


def _run(payload, nprocs, backend, devices, timeout, init, echo=True) -> list:
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, nprocs, is_master=True, wait_for_workers=False,
                     timeout=datetime.timedelta(seconds=timeout + 60))
    try:
        with Job(nprocs, timeout, echo) as job:
            for r in range(nprocs):
                spec = {
                    "rank": r, "world_size": nprocs, "backend": backend, "device": devices[r],
                    "init": init, "pg_timeout": timeout + 30,
                    "start_method": multiprocessing.get_start_method(),
                    "env": _rank_env(r, nprocs, store.port, backend, devices[r]),
                }
                job.start_rank(r, _rank.rank_main, payload, spec)
            return job.wait()
    finally:
        del store

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
    >>> launch(total, 2, 1)
    launch: 2 ranks · ...
    [3.0, 3.0]
"""
from __future__ import annotations

import datetime
import multiprocessing
import numbers
import os
import socket

from . import procs

# Seconds (a year). A timeout is a deadline for a hang; far longer ones overflow the
# datetime.timedelta that torch's timeouts take (inf and 1e17 ended in OverflowError).
MAX_TIMEOUT = 365 * 24 * 3600


def _timeout_from_env() -> float:
    raw = os.environ.get("MGPU_LAB_TIMEOUT")
    if raw is None:
        return 300.0
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value <= MAX_TIMEOUT:  # also false for nan
        raise ValueError(
            f"MGPU_LAB_TIMEOUT={raw!r} is not a number of seconds above 0 and at most {MAX_TIMEOUT:g} "
            "(the default timeout of every launch); set it to e.g. 300, or unset it"
        )
    return value


DEFAULT_TIMEOUT = _timeout_from_env()


if os.environ.get("MGPU_LAB_PREWARM", "1") != "0" and "MGPU_LAB_IN_RANK" not in os.environ:
    # Start the forkserver before this process imports torch below: the two
    # imports overlap, and the first launch finds the server (nearly) ready.
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        procs.prewarm()

from mgpu_lab import dist  # noqa: E402
from mgpu_lab.core import procenv  # noqa: E402
from . import pickling  # noqa: E402
from . import rank as _rank  # noqa: E402
from .errors import LaunchError, LaunchTimeout  # noqa: E402 (learners catch them as launch's)
from .job import Job  # noqa: E402
from .lifetime import interrupts_deferred  # noqa: E402
from mgpu_lab.devices import cpu_count  # noqa: E402

__all__ = ["launch", "run", "LaunchError", "LaunchTimeout", "prewarm", "banner", "MAX_TIMEOUT", "DEFAULT_TIMEOUT"]

INIT_ATTEMPTS = 3  # gloo's loopback set-up fails about once in 150 launches here: retry it
prewarm = procs.prewarm


def _validate(fn, nprocs, timeout, init) -> tuple[int, float]:
    """Check launch's arguments; return nprocs and timeout as plain numbers."""
    if not callable(fn):
        raise TypeError(f"launch needs a function to run in every rank, got {fn!r} of type {type(fn).__name__}")
    # numbers.Integral/Real: NumPy's integers and floats count, bool (an int to Python) does not
    if isinstance(nprocs, bool) or not isinstance(nprocs, numbers.Integral):
        raise TypeError(f"nprocs must be an int (the number of ranks), got {nprocs!r} of type "
                        f"{type(nprocs).__name__}; pass e.g. nprocs=2")
    if nprocs < 1:
        raise ValueError(
            f"nprocs={nprocs}: launch needs at least one rank; pass the number of "
            "processes to start, e.g. nprocs=2"
        )
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(f"timeout={timeout!r}: pass the number of seconds after which a hung launch "
                        "is stopped, e.g. timeout=60")
    if not 0 < float(timeout) <= MAX_TIMEOUT:  # also false for nan
        raise ValueError(
            f"timeout={timeout!r}: pass a number of seconds above 0 and at most {MAX_TIMEOUT:g} (a year) "
            "after which a hung launch is stopped, e.g. timeout=60"
        )
    if not isinstance(init, bool):
        raise TypeError(
            f"init={init!r}: pass init=True (launch initialises the process group before fn runs, "
            "the default) or init=False (fn calls init_process_group itself)"
        )
    return int(nprocs), float(timeout)


def _check_working_directory() -> None:
    # Ranks start in the caller's working directory; multiprocessing would fail on it
    # with a bare FileNotFoundError that names nothing.
    try:
        os.getcwd()
    except FileNotFoundError:
        try:
            where = os.readlink("/proc/self/cwd").removesuffix(" (deleted)")
        except OSError:
            where = os.environ.get("PWD", "(unknown)")
        raise RuntimeError(
            f"the working directory {where} no longer exists (it was deleted or renamed after this "
            "process entered it), and ranks start in the caller's working directory; change to one "
            "that exists first, e.g. os.chdir(os.path.expanduser('~'))"
        ) from None


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
    env = {**os.environ, **procenv.rank_env(rank, nprocs, "127.0.0.1", port)}
    env.update(
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
        nprocs: number of ranks (any integral number, NumPy's included).
        *args: positional arguments for ``fn`` (pickled with cloudpickle).
        backend: ``None`` (NCCL with one GPU per rank when enough GPUs are
            visible, else gloo), ``"nccl"`` or ``"gloo"``.
        timeout: seconds (above 0, at most :data:`MAX_TIMEOUT`, a year) before a
            hung launch is stopped with every rank's stack; the default is
            ``MGPU_LAB_TIMEOUT`` or 300.
        init: ``True`` initialises the process group before ``fn`` runs;
            ``False`` leaves ``init_process_group`` to ``fn``.
        **kwargs: keyword arguments for ``fn``.

    Returns:
        The return values in rank order (tensors come back on the CPU). A rank
        that ends with exit code 0 instead of returning (``sys.exit()``,
        ``sys.exit(0)``, ``os._exit(0)``) has finished, as under torchrun; its
        result is None.

    Raises:
        ValueError, TypeError: bad arguments, NCCL without one GPU per rank, or
            arguments that cannot be pickled.
        RuntimeError: the working directory no longer exists.
        LaunchError: a rank raised, died, or called ``sys.exit`` with another
            code (message: its rank and traceback; ``exitcode``: its exit code).
        LaunchTimeout: the ranks did not finish within ``timeout``.
        KeyboardInterrupt: interrupted; every rank that had started has been stopped.

    Example:
        >>> import torch.distributed
        >>> launch(lambda: torch.distributed.get_rank(), 2)
        launch: 2 ranks · ...
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
    nprocs, timeout = _validate(fn, nprocs, timeout, init)
    _check_working_directory()
    backend, devices = dist.choose(nprocs, backend)
    try:
        payload = pickling.dumps((fn, args, kwargs))
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


def _open_store(nprocs: int, timeout: float):
    """The rendezvous store, listening on 127.0.0.1 only.

    ``TCPStore(is_master=True)`` alone listens on every interface, without
    authentication: from another host anyone could read and set its keys (the
    ranks' gloo addresses among them). A socket bound here is handed over instead.
    """
    from torch.distributed import TCPStore

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        port = sock.getsockname()[1]
        fd = sock.detach()  # the store owns the socket from here on
    try:
        return TCPStore("127.0.0.1", port, nprocs, is_master=True, wait_for_workers=False,
                        timeout=datetime.timedelta(seconds=timeout + 60), master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise


def _run(payload, nprocs, backend, devices, timeout, init, echo=True) -> list:
    with Job(nprocs, timeout, echo, init) as job:
        # Ctrl-C while ranks start is held back until all have started, so that the
        # job knows every rank it must stop (see Job.__exit__).
        with interrupts_deferred():
            port = job.keep_store(_open_store(nprocs, timeout))
            for r in range(nprocs):
                spec = {
                    "rank": r, "world_size": nprocs, "backend": backend, "device": devices[r],
                    "init": init, "pg_timeout": timeout + 30,
                    # None: the caller has not chosen one (and asking must not choose it)
                    "start_method": multiprocessing.get_start_method(allow_none=True),
                    "env": _rank_env(r, nprocs, port, backend, devices[r]),
                }
                job.start_rank(r, _rank.rank_main, payload, spec)
        return job.wait()

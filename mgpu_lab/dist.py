"""One source of rank information, backend choice, and process-group setup.

The same helpers work in a rank started by :func:`mgpu_lab.launch` and in a
process started by ``torchrun``: both set ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE`` (and ``MASTER_ADDR``/``MASTER_PORT``),
and everything here reads only those variables. Outside any launcher the
process counts as rank 0 of a world of size 1.

Example:
    >>> from mgpu_lab import dist
    >>> dist.rank(), dist.world_size()
    (0, 1)
"""
from __future__ import annotations

import datetime
import os
import sys
from dataclasses import dataclass

BACKENDS = ("nccl", "gloo")
DEFAULT_PG_TIMEOUT = 300.0


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(
            f"environment variable {name}={raw!r} is not an integer; it is set by "
            f"torchrun or mgpu_lab.launch, so unset it or set it to a whole number"
        ) from None
    if value < 0:
        raise ValueError(f"environment variable {name}={value} must be >= 0")
    return value


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits in the job.

    Attributes:
        rank: global rank, 0..world_size-1.
        local_rank: rank on this node (picks the GPU).
        world_size: number of processes in the job.
        local_world_size: number of processes on this node.
        node_rank: index of this node (``GROUP_RANK`` under torchrun).
    """

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int


def info() -> RankInfo:
    """Read the torchrun variables into a :class:`RankInfo`.

    Returns:
        The rank information; ``RankInfo(0, 0, 1, 1, 0)`` outside a launcher.

    Raises:
        ValueError: if the variables are malformed or contradict each other.

    Example:
        >>> info().world_size
        1
    """
    world = _env_int("WORLD_SIZE", 1)
    rank_ = _env_int("RANK", 0)
    local = _env_int("LOCAL_RANK", rank_ if "WORLD_SIZE" not in os.environ else 0)
    local_world = _env_int("LOCAL_WORLD_SIZE", world)
    node = _env_int("GROUP_RANK", _env_int("NODE_RANK", 0))
    if world < 1 or rank_ >= world:
        raise ValueError(
            f"RANK={rank_} with WORLD_SIZE={world}: the rank must lie in 0..WORLD_SIZE-1; "
            "start the process with torchrun or mgpu_lab.launch, which set both"
        )
    if local >= local_world:
        raise ValueError(
            f"LOCAL_RANK={local} with LOCAL_WORLD_SIZE={local_world}: the local rank "
            "must lie in 0..LOCAL_WORLD_SIZE-1"
        )
    return RankInfo(rank_, local, world, local_world, node)


def rank() -> int:
    """Global rank of this process (0 outside a launcher)."""
    return info().rank


def local_rank() -> int:
    """Rank of this process on its node; picks the GPU (0 outside a launcher)."""
    return info().local_rank


def world_size() -> int:
    """Number of processes in the job (1 outside a launcher)."""
    return info().world_size


def local_world_size() -> int:
    """Number of processes on this node (1 outside a launcher)."""
    return info().local_world_size


def is_main_process() -> bool:
    """True on global rank 0, the rank that logs and writes checkpoints."""
    return info().rank == 0


def print0(*args, **kwargs) -> None:
    """``print`` on the main process only: for messages every rank would repeat."""
    if is_main_process():
        # One write per line: under torchrun the ranks share the terminal, and a
        # separate write of the newline lets other ranks' text land mid-line.
        sep, end = kwargs.pop("sep", " "), kwargs.pop("end", "\n")
        file = kwargs.pop("file", None) or sys.stdout
        file.write(sep.join(map(str, args)) + end)
        if kwargs.pop("flush", True):
            file.flush()


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def choose(nprocs: int, backend: str | None = None, gpus: int | None = None) -> tuple[str, list[str]]:
    """Pick the backend and each local rank's device for ``nprocs`` ranks on one node.

    NCCL with one GPU per rank when enough GPUs are visible; otherwise gloo,
    on the CPU when no GPU is visible, or with the ranks sharing the GPUs.

    Args:
        nprocs: ranks on this node.
        backend: ``None`` (choose), ``"nccl"`` or ``"gloo"``.
        gpus: visible GPU count; read from torch when ``None``.

    Returns:
        ``(backend, devices)`` with one device string per local rank.

    Raises:
        ValueError: unknown backend, or NCCL without one GPU per rank.

    Example:
        >>> choose(4, gpus=0)
        ('gloo', ['cpu', 'cpu', 'cpu', 'cpu'])
        >>> choose(2, gpus=2)
        ('nccl', ['cuda:0', 'cuda:1'])
    """
    if gpus is None:
        gpus = _cuda_count()
    if backend is not None and backend not in BACKENDS:
        raise ValueError(
            f"backend={backend!r} is not supported; use backend='nccl' (one GPU per rank), "
            "backend='gloo' (CPU or shared GPUs) or backend=None to choose automatically"
        )
    if backend is None:
        backend = "nccl" if gpus >= nprocs and _nccl_available() else "gloo"
    if backend == "nccl":
        if gpus < nprocs:
            alt = f" or nprocs<={gpus}" if gpus else f" or run on a machine with {nprocs} GPUs"
            raise ValueError(
                f"backend='nccl' needs one CUDA GPU per rank: nprocs={nprocs} but {gpus} "
                f"CUDA GPU(s) are visible; use backend='gloo'{alt}"
            )
        if not _nccl_available():
            raise ValueError(
                "backend='nccl' was asked for but this torch build has no NCCL "
                "(torch.distributed.is_nccl_available() is False); use backend='gloo'"
            )
        return "nccl", [f"cuda:{r}" for r in range(nprocs)]
    if gpus == 0:
        return "gloo", ["cpu"] * nprocs
    return "gloo", [f"cuda:{r % gpus}" for r in range(nprocs)]


def _nccl_available() -> bool:
    import torch.distributed as tdist

    return tdist.is_available() and tdist.is_nccl_available()


def device():
    """This rank's device: the one :func:`mgpu_lab.launch` assigned, else from LOCAL_RANK.

    Under torchrun a rank uses ``cuda:LOCAL_RANK`` when it has a GPU of its own,
    shares the GPUs round-robin when there are fewer GPUs than local ranks, and
    uses the CPU when no GPU is visible.

    Example:
        >>> str(device())  # on a machine without a GPU
        'cpu'
    """
    import torch

    assigned = os.environ.get("MGPU_LAB_DEVICE")
    if assigned:
        return torch.device(assigned)
    gpus = _cuda_count()
    return torch.device(f"cuda:{local_rank() % gpus}") if gpus else torch.device("cpu")


def setup(backend: str | None = None, timeout: float = DEFAULT_PG_TIMEOUT):
    """Initialise the default process group from the torchrun variables.

    Does nothing if it is already initialised. With NCCL it first binds this
    process to ``cuda:LOCAL_RANK`` so that collectives use the right GPU.

    Args:
        backend: ``None`` to choose (NCCL if every local rank has a GPU, else gloo).
        timeout: seconds a collective may wait for the other ranks.

    Returns:
        This rank's device (see :func:`device`).

    Raises:
        ValueError: as :func:`choose`, or if MASTER_ADDR/MASTER_PORT are missing.

    Example:
        >>> from mgpu_lab import launch
        >>> def script():          # what a script started by torchrun does first and last
        ...     import torch.distributed as tdist
        ...     dev = setup()
        ...     where = (tdist.get_rank(), tdist.get_world_size(), dev.type in ("cpu", "cuda"))
        ...     teardown()
        ...     return where
        >>> launch(script, 2, init=False)   # ranks with torchrun's variables, no process group yet
        launch: 2 ranks · ...
        [(0, 2, True), (1, 2, True)]
    """
    import torch
    import torch.distributed as tdist

    if tdist.is_initialized():
        return device()
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not os.environ.get(name):
            raise ValueError(
                f"{name} is not set; start this script with torchrun "
                "(e.g. torchrun --standalone --nproc-per-node=2 script.py) or mgpu_lab.launch"
            )
    me = info()
    chosen = os.environ.get("MGPU_LAB_BACKEND") if backend is None else backend
    chosen, _ = choose(me.local_world_size, chosen or None)
    dev = device()
    if chosen == "nccl":
        torch.cuda.set_device(dev)
    tdist.init_process_group(
        chosen, rank=me.rank, world_size=me.world_size,
        timeout=datetime.timedelta(seconds=timeout),
    )
    return dev


def teardown() -> None:
    """Wait for every rank, then destroy the default process group (safe to call twice).

    The barrier makes the ranks leave together: a rank that tears its
    connections down while a peer still works (say rank 0 writing a report)
    can abort at exit with "terminate called without an active exception".
    """
    import torch.distributed as tdist

    if tdist.is_available() and tdist.is_initialized():
        tdist.barrier()
        tdist.destroy_process_group()


def leave(code: int):
    """End a torchrun script's process with exit status ``code``, after :func:`teardown`: flush, then ``os._exit``.

    Training is done and the process group destroyed, yet with torch 2.14 a rank can still
    abort in C++ teardown at interpreter exit ("terminate called without an active
    exception", SIGABRT), and torchrun then fails the whole job (seen twice in CI here).
    Leaving without that teardown is what the scripts do: ``mdist.leave(main())``.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


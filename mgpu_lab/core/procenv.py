"""The process environment: what makes a process a rank, and what a command started from one gets.

torchrun gives each worker its place in the job through variables
(:data:`RANK_VARS`: ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ...), and so does
:func:`mgpu_lab.launch` (:func:`rank_env`, plus :data:`LAUNCHER_VARS`). A command
started from a notebook or from inside a rank (a ``torchrun``, a simulated
node, a script under test) must not inherit them, or it would take itself for
that rank: :func:`child_env` gives it this environment without them, without
the agent's ``TORCHELASTIC_*``, with this package importable and one intra-op
thread unless the caller chose otherwise. :func:`private_tmpdir` gives a run
its own ``TMPDIR`` (torchrun leaves its ``torchelastic_*`` folders there).

Example:
    >>> env = child_env({"LOGLEVEL": "INFO", "NCCL_DEBUG": None}, base={"RANK": "3", "PATH": "/bin"})
    >>> "RANK" in env, env["LOGLEVEL"], env["OMP_NUM_THREADS"], "NCCL_DEBUG" in env
    (False, 'INFO', '1', False)
    >>> rank_env(1, 2, "127.0.0.1", 29500)["LOCAL_WORLD_SIZE"]
    '2'
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

__all__ = ["RANK_VARS", "LAUNCHER_VARS", "rank_env", "child_env", "scrubbed", "private_tmpdir", "package_root"]

#: What torchrun (and mgpu_lab.launch) sets in every worker to say where it sits in the job.
RANK_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
             "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")
#: What mgpu_lab.launch adds for its own ranks (the backend and device it chose, and that it is a rank).
LAUNCHER_VARS = ("MGPU_LAB_IN_RANK", "MGPU_LAB_DEVICE", "MGPU_LAB_BACKEND")


def package_root() -> str:
    """The folder that holds this ``mgpu_lab`` package (put first on a child's ``PYTHONPATH``)."""
    return str(Path(__file__).resolve().parents[2])


def rank_env(rank: int, world_size: int, master_addr: str, master_port: int, *, local_rank: int | None = None,
             local_world_size: int | None = None, node_rank: int = 0) -> dict[str, str]:
    """The variables torchrun gives worker ``rank`` of a job (one node unless told otherwise).

    Returns:
        Only the job's variables, as strings: merge them into an environment.
    """
    local_rank = rank if local_rank is None else local_rank
    local_world_size = world_size if local_world_size is None else local_world_size
    return {"RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(local_world_size), "GROUP_RANK": str(node_rank), "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(world_size), "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)}


def scrubbed(base: dict | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) without rank, launcher and ``TORCHELASTIC_*`` variables."""
    base = os.environ if base is None else base
    return {k: v for k, v in base.items()
            if k not in RANK_VARS and k not in LAUNCHER_VARS and not k.startswith("TORCHELASTIC_")}


def child_env(extra: dict | None = None, *, base: dict | None = None, python_first: bool = False) -> dict[str, str]:
    """The environment of a command started from here that must not look like a rank.

    Args:
        extra: variables to set last; a value of None removes the variable.
        base: the environment to start from (default: this process's).
        python_first: put this Python's folder first on ``PATH`` (so ``torchrun``
            is this environment's).

    Returns:
        :func:`scrubbed` ``base``, with ``PYTHONUNBUFFERED=1``, ``OMP_NUM_THREADS``
        (1 unless set), this package first on ``PYTHONPATH``, then ``extra``.
    """
    env = scrubbed(base)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join([package_root(), *filter(None, [env.get("PYTHONPATH")])])
    if python_first:
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), *filter(None, [env.get("PATH")])])
    for key, value in (extra or {}).items():
        if value is None:
            env.pop(str(key), None)
        else:
            env[str(key)] = str(value)
    return env


@contextmanager
def private_tmpdir(prefix: str = "mgpu-lab-run-"):
    """A folder of this run's own, for its ``TMPDIR``; removed with what is in it afterwards.

    Example:
        >>> with private_tmpdir() as tmp:
        ...     os.path.isdir(tmp)
        True
    """
    path = tempfile.mkdtemp(prefix=prefix)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)

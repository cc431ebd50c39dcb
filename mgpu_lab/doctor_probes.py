"""The doctor's probes: real launches that prove a backend, or simulated nodes, work here.

:func:`check_backend` starts ranks through :mod:`mgpu_lab.launch` that run
:func:`allreduce_probe` (an ``all_reduce`` and a ``barrier``) and checks every
rank's sum; :func:`check_nodes` does the same across simulated nodes
(:mod:`mgpu_lab.cluster.multinode`) under the real ``torchrun``. Each returns
whether it passed and the report line :func:`mgpu_lab.doctor.run_doctor`
prints: ``OK`` with the time it took, or ``FAILED`` with what went wrong and
what to try. Nothing here raises for a failed check.

Example:
    >>> from mgpu_lab.doctor_probes import check_backend
    >>> check_backend("gloo", nprocs=2, timeout=60)
    launch: 2 ranks · ...
    (True, 'OK in ... s (2 ranks, all_reduce sum 3 on every rank)')
"""

from __future__ import annotations

import importlib
import time

import torch
import torch.distributed as dist

__all__ = ["allreduce_probe", "check_backend", "check_nodes", "check_traceback", "load_launcher"]

# What to try when a check fails, by backend ("nodes": the multi-node check).
_HINTS = {
    "gloo": (
        "try: MASTER_ADDR=127.0.0.1 and GLOO_SOCKET_IFNAME=lo (gloo may pick a "
        "network interface this machine cannot reach itself on), and check "
        "that no firewall blocks local TCP ports"
    ),
    "nccl": (
        "try: NCCL_DEBUG=INFO to see where NCCL stops; NCCL_P2P_DISABLE=1 if "
        "peer-to-peer between GPUs is broken; NCCL_SHM_DISABLE=1 or a larger "
        "/dev/shm (docker --shm-size=1g) in containers; and check that "
        "nvidia-smi lists every GPU"
    ),
    "nodes": (
        "try: the lesson 07 troubleshooting table; GLOO_SOCKET_IFNAME must name the "
        "interface that joins the nodes, and torchrun must be on the PATH of this "
        "Python (pip install -e . in the environment that runs mgpu-lab)"
    ),
}


def allreduce_probe(device_type: str) -> list[float]:
    """Runs in every rank: all_reduce(SUM) of ones * (rank + 1), then a barrier.

    Args:
        device_type: ``"cuda"`` to use this rank's GPU (``cuda:LOCAL_RANK``,
            see :func:`mgpu_lab.dist.device`) for NCCL, ``"cpu"`` otherwise.

    Returns:
        The reduced tensor as a list; every element should be
        ``world_size * (world_size + 1) / 2`` on every rank.
    """
    from mgpu_lab import dist as rank_info

    rank = dist.get_rank()
    if device_type == "cuda":
        device = rank_info.device()  # cuda:LOCAL_RANK, or what the launcher assigned
        torch.cuda.set_device(device)  # NCCL needs each rank bound to its own GPU
    else:
        device = torch.device("cpu")
    tensor = torch.ones(4, device=device) * (rank + 1)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    dist.barrier()
    return tensor.cpu().tolist()


def load_launcher():
    """The mgpu_lab.launch module, or the exception that importing it raised.

    Returns:
        The module ``mgpu_lab.launcher.launch``, or the exception (never raised:
        a broken install is a check that fails, with the fix in its report).
    """
    try:
        # The module, not the function mgpu_lab re-exports under the same name.
        return importlib.import_module("mgpu_lab.launcher.launch")
    except Exception as err:  # a broken install must give a FAILED line, not a crash
        return err


def check_backend(backend: str, nprocs: int, timeout: float) -> tuple[bool, str]:
    """Launch :func:`allreduce_probe` on ``nprocs`` ranks and check every rank's sum.

    Args:
        backend: ``"gloo"`` (ranks on the CPU) or ``"nccl"`` (one GPU per rank).
        nprocs: how many ranks.
        timeout: seconds the launch may take, process start-up included.

    Returns:
        (passed, report): the report is one paragraph, ``OK in ...`` or
        ``FAILED ...`` with what went wrong and what to try.
    """
    launcher = load_launcher()
    if isinstance(launcher, Exception):
        return False, (
            f"FAILED: cannot import mgpu_lab.launcher.launch ({type(launcher).__name__}: "
            f"{launcher}); reinstall the package with `pip install -e .` from the "
            "repository root"
        )
    timeout_error = getattr(launcher, "LaunchTimeout", launcher.LaunchError)
    device_type = "cuda" if backend == "nccl" else "cpu"
    start = time.perf_counter()
    try:
        results = launcher.launch(
            allreduce_probe, nprocs, device_type, backend=backend, timeout=timeout
        )
    except (launcher.LaunchError, timeout_error) as err:
        elapsed = time.perf_counter() - start
        timed_out = isinstance(err, timeout_error) and timeout_error is not launcher.LaunchError
        what = (
            f"a rank hung: no result within timeout={timeout:g} s (every rank's stack "
            "shows where it waited)"
            if timed_out
            else "a rank raised an error"
        )
        return False, (
            f"FAILED after {elapsed:.1f} s: {what}\n{_indent(str(err))}\n"
            f"{_hint(backend)}"
        )
    except Exception as err:  # anything else is a bug or a setup problem; report it
        elapsed = time.perf_counter() - start
        return False, (
            f"FAILED after {elapsed:.1f} s: launching {nprocs} {backend} ranks raised "
            f"{type(err).__name__}: {err}\n{_hint(backend)}"
        )
    elapsed = time.perf_counter() - start
    expected = float(nprocs * (nprocs + 1) // 2)
    if not isinstance(results, list) or len(results) != nprocs:
        return False, (
            f"FAILED: expected a list of one result per rank ({nprocs}), got "
            f"{results!r}; this is a bug in mgpu_lab.launch, please report it"
        )
    for rank, values in enumerate(results):
        if not isinstance(values, list) or any(v != expected for v in values):
            return False, (
                f"FAILED: all_reduce(SUM) of ones * (rank + 1) over {nprocs} ranks "
                f"should give {expected:g} on every rank, but rank {rank} got "
                f"{values!r}: the collective ran and computed a wrong sum\n"
                f"{_hint(backend)}"
            )
    return True, (
        f"OK in {elapsed:.1f} s ({nprocs} ranks, all_reduce sum {expected:g} "
        "on every rank)"
    )


def check_nodes(nodes: int, nprocs: int, timeout: float) -> tuple[bool, str]:
    """all_reduce + barrier across ``nodes`` simulated nodes, ``nprocs`` ranks each, under real torchrun.

    Args:
        nodes: how many simulated nodes (:class:`mgpu_lab.cluster.multinode.SimCluster`).
        nprocs: ranks per node.
        timeout: seconds the whole run may take.

    Returns:
        (passed, report), as :func:`check_backend` returns them, with the nodes
        and node 0's command; a failure adds the run's summary and key log lines.
    """
    try:
        # Imported here: only the multi-node check needs the cluster.
        from mgpu_lab.cluster.multinode import PROBE_SCRIPT, SimCluster, probe_reports

        cluster = SimCluster(nodes)
    except Exception as err:  # no namespaces is a fallback, not an error: this is something else
        return False, f"FAILED: cannot set up {nodes} simulated nodes: {type(err).__name__}: {err}\n{_hint('nodes')}"
    start = time.perf_counter()
    with cluster:
        where = cluster.banner().split(" · ", 1)[1]
        env = {"GLOO_SOCKET_IFNAME": cluster.interface, "ALLREDUCE_CHECK_JSON": "1",
               "ALLREDUCE_CHECK_TIMEOUT": f"{max(5.0, timeout / 3):g}"}
        # Workers forked from torchrun (--run-path --start-method=fork): they do not import torch again,
        # about 2 s of CPU each here; the rendezvous and gloo's connections across the nodes are the same.
        from mgpu_lab.cluster.commands import torchrun_commands

        argv = torchrun_commands(cluster, PROBE_SCRIPT, "--backend", "gloo", nproc_per_node=nprocs, fork=True)
        try:
            result = cluster.run(argv, env=env, timeout=timeout, after_failure=5, echo=False)
        except Exception as err:  # e.g. torchrun missing: report it, like a failed launch
            return False, f"FAILED: starting torchrun raised {type(err).__name__}: {err}\n{_hint('nodes')}"
    elapsed = time.perf_counter() - start
    world = nodes * nprocs
    expected = float(world * (world + 1) // 2)
    sums = [r["sum"] for r in probe_reports(result)]
    shown = ["scripts/" + PROBE_SCRIPT.name if a == str(PROBE_SCRIPT) else a for a in argv[0]]
    command = f"GLOO_SOCKET_IFNAME={cluster.interface} " + " ".join(shown)
    if result.ok and len(sums) == world and all(v == expected for v in sums):
        return True, (f"OK in {elapsed:.1f} s ({nodes} simulated nodes x {nprocs} rank(s), torchrun with static "
                      f"rendezvous, gloo; all_reduce sum {expected:g} on every rank)\n"
                      f"         nodes: {where}\n         node0 ran: {command}")
    details = "\n".join(result.key_lines(limit=3)) or "(no error in the logs)"
    return False, (f"FAILED after {elapsed:.1f} s: {len(sums)} of {world} ranks finished the all_reduce "
                   f"(expected sum {expected:g})\n         nodes: {where}\n"
                   f"{_indent(result.summary())}\n{_indent(details)}\n{_hint('nodes')}")


#: A function as a notebook cell defines it: compiled from a file name only the kernel's linecache knows.
_CELL = "/mgpu-lab-doctor/cell_1.py"
_CELL_SOURCE = "def doctor_cell_probe():\n    raise ValueError('raised in a rank on purpose')\n"


def check_traceback(timeout: float) -> tuple[bool, str]:
    """Launch a function defined as a notebook cell defines it; its rank's traceback must show the cell's line.

    The line comes from this process's linecache (as a kernel's cells do), so
    it shows only when the function reached the rank with its file name: the
    launcher's pickler keeps it where cloudpickle 3.1.3 and later replace it
    with ``<dynamic-code>``.

    Returns:
        (passed, report), as :func:`check_backend`.
    """
    import linecache

    launcher = load_launcher()
    if isinstance(launcher, Exception):
        return False, f"FAILED: cannot import mgpu_lab.launcher.launch ({type(launcher).__name__}: {launcher})"
    lines = _CELL_SOURCE.splitlines(keepends=True)
    linecache.cache[_CELL] = (len(_CELL_SOURCE), None, lines, _CELL)  # what IPython does for every cell
    namespace = {"__name__": "__main__"}
    exec(compile(_CELL_SOURCE, _CELL, "exec"), namespace)  # noqa: S102 - the fixed text above
    start = time.perf_counter()
    try:
        launcher.run(namespace["doctor_cell_probe"], 1, backend="gloo", timeout=timeout, init=False,
                     quiet=True, echo=False)
        return False, "FAILED: the rank was meant to raise ValueError and returned instead"
    except launcher.LaunchError as err:
        text = str(err)
    finally:
        linecache.cache.pop(_CELL, None)
    elapsed = time.perf_counter() - start
    if f'File "{_CELL}", line 2' in text and "raise ValueError('raised in a rank on purpose')" in text:
        return True, f"OK in {elapsed:.1f} s (a rank's traceback shows the notebook cell's own line)"
    import cloudpickle

    return False, (f"FAILED: a rank's traceback lost the notebook cell's line (cloudpickle "
                   f"{cloudpickle.__version__}); reinstall with the tested versions: "
                   f"pip install -c constraints.txt -e .\n{_indent(text)}")


def _hint(backend: str) -> str:
    return "         " + _HINTS[backend]


def _indent(text: str, prefix: str = "      | ") -> str:
    return "\n".join(prefix + line for line in text.rstrip().splitlines())

"""`mgpu-lab doctor`: what this machine can run, proven with real collectives.

The doctor prints the versions that matter, the GPUs and CPUs this process
sees and the distributed backends torch was built with, then starts real
ranks through :mod:`mgpu_lab.launch` and runs an ``all_reduce`` and a
``barrier`` on every backend that can work here. Each check ends in ``OK``
with the time it took, ``skipped`` with the reason, or ``FAILED`` with what
went wrong and what to try.

Example:
    >>> from mgpu_lab.doctor import run_doctor
    >>> run_doctor(backends=["gloo"])  # doctest: +SKIP
    mgpu-lab doctor
    ...
      gloo   OK in 0.4 s (2 ranks, all_reduce sum 3 on every rank)
    result: all 1 check(s) passed
    0
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from collections.abc import Sequence
from typing import TextIO

import torch
import torch.distributed as dist

from mgpu_lab import devices

__all__ = ["CHECKABLE_BACKENDS", "run_doctor"]

#: Backends the doctor can start ranks for; MPI ranks must come from mpirun.
CHECKABLE_BACKENDS = ("gloo", "nccl")

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
#: The multi-node check starts torchrun on every node; it gets at least this many seconds.
NODES_MIN_TIMEOUT = 90.0


def _allreduce_probe(device_type: str) -> list[float]:
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


def _format_nccl_version() -> str:
    if not dist.is_nccl_available():
        return "not available"
    try:
        version = torch.cuda.nccl.version()
    except Exception as err:  # CPU-only builds raise from deep inside torch
        return f"unknown ({type(err).__name__}: {err})"
    if isinstance(version, tuple):
        return ".".join(map(str, version))
    return str(version)


def _torchvision_version() -> str:
    try:
        import torchvision
    except Exception as err:  # a torch/torchvision mismatch fails at import
        return f"not importable ({type(err).__name__}: {err})"
    return torchvision.__version__


def _versions() -> list[tuple[str, str]]:
    cuda = torch.version.cuda or "none (CPU-only build)"
    return [
        ("python", f"{sys.version.split()[0]} ({sys.executable})"),
        ("torch", torch.__version__),
        ("cuda", f"{cuda} (the CUDA torch was built with)"),
        ("nccl", _format_nccl_version()),
        ("torchvision", _torchvision_version()),
    ]


def _available_backends() -> dict[str, bool]:
    return {
        "gloo": dist.is_gloo_available(),
        "nccl": dist.is_nccl_available(),
        "mpi": dist.is_mpi_available(),
    }


def _normalise_backends(backends: str | Sequence[str] | None) -> list[str] | None:
    if backends is None:
        return None
    names = [backends] if isinstance(backends, str) else list(backends)
    unknown = [name for name in names if name not in CHECKABLE_BACKENDS]
    if unknown or not names:
        problem = f"names unknown backend {unknown[0]!r}" if unknown else "is empty"
        raise ValueError(
            f"backends={names!r} {problem}; the doctor can check "
            f"{', '.join(CHECKABLE_BACKENDS)}, e.g. backends=['gloo'], or None for "
            "every one that can work here (MPI ranks must be started by mpirun)"
        )
    return list(dict.fromkeys(names))


def _why_not(backend: str, nprocs: int, available: dict[str, bool], n_gpus: int) -> str:
    """Why ``backend`` cannot run ``nprocs`` ranks here; "" when it can."""
    if not available[backend]:
        return f"torch {torch.__version__} was built without {backend}"
    if backend == "nccl" and n_gpus < nprocs:
        return f"nccl needs one GPU per rank, {n_gpus} visible"
    return ""


def _load_launcher():
    """The mgpu_lab.launch module, or the exception that importing it raised."""
    try:
        # The module, not the function mgpu_lab re-exports under the same name.
        return importlib.import_module("mgpu_lab.launcher.launch")
    except Exception as err:  # a broken install must give a FAILED line, not a crash
        return err


def _check(backend: str, nprocs: int, timeout: float) -> tuple[bool, str]:
    """Launch the probe on ``nprocs`` ranks; return (passed, one-paragraph report)."""
    launcher = _load_launcher()
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
            _allreduce_probe, nprocs, device_type, backend=backend, timeout=timeout
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


def _check_nodes(nodes: int, nprocs: int, timeout: float) -> tuple[bool, str]:
    """all_reduce + barrier across ``nodes`` simulated nodes, ``nprocs`` ranks each, under real torchrun."""
    try:
        from mgpu_lab.cluster.multinode import PROBE_SCRIPT, SimCluster, probe_reports

        cluster = SimCluster(nodes)
    except Exception as err:  # no namespaces is a fallback, not an error: this is something else
        return False, f"FAILED: cannot set up {nodes} simulated nodes: {type(err).__name__}: {err}\n{_hint('nodes')}"
    start = time.perf_counter()
    with cluster:
        where = cluster.banner().split(" · ", 1)[1]
        env = {"GLOO_SOCKET_IFNAME": cluster.interface, "ALLREDUCE_CHECK_JSON": "1",
               "ALLREDUCE_CHECK_TIMEOUT": f"{max(5.0, timeout / 3):g}"}
        argv = cluster.torchrun(PROBE_SCRIPT, "--backend", "gloo", nproc_per_node=nprocs)
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


def _hint(backend: str) -> str:
    return "         " + _HINTS[backend]


def _indent(text: str, prefix: str = "      | ") -> str:
    return "\n".join(prefix + line for line in text.rstrip().splitlines())


def run_doctor(
    backends: str | Sequence[str] | None = None,
    nprocs: int = 2,
    timeout: float = 30.0,
    out: TextIO | None = None,
    nodes: int | None = None,
) -> int:
    """Print what this machine can run and prove it with real collectives.

    Args:
        backends: Backends to check, from ``("gloo", "nccl")``. None checks
            every one that can work here: gloo when torch has it, nccl when
            torch has it and there is one GPU per rank. A backend named here
            that cannot work here is reported as FAILED, not skipped.
        nprocs: Ranks per check (processes started through
            :func:`mgpu_lab.launch.launch`).
        timeout: Seconds each check may take, process start-up included.
        out: Stream for the report; defaults to ``sys.stdout``.
        nodes: Also run the all_reduce + barrier across this many simulated
            nodes (:mod:`mgpu_lab.cluster.multinode`: network namespaces where the
            machine allows it, else 127.0.0.1), ``nprocs`` ranks each, started
            by the real torchrun with gloo; at least 90 s of timeout.

    Returns:
        0 if every check that ran passed, 1 if any failed or none could run.

    Raises:
        ValueError: If ``backends`` names an unknown backend, ``nprocs`` is not
            an int >= 1, ``timeout`` is not a positive number, or ``nodes`` is
            not None or an int from 2 to 16.

    Example:
        >>> run_doctor(backends=["gloo"], nprocs=2, timeout=60)  # doctest: +SKIP
        0
    """
    requested = _normalise_backends(backends)
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs={nprocs!r} must be an int >= 1, e.g. nprocs=2")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"timeout={timeout!r} must be a positive number of seconds, e.g. 30")
    if nodes is not None and (isinstance(nodes, bool) or not isinstance(nodes, int) or not 2 <= nodes <= 16):
        raise ValueError(f"nodes={nodes!r} must be an int from 2 to 16 (simulated nodes), e.g. nodes=2")
    out = sys.stdout if out is None else out

    def say(line: str = "") -> None:
        print(line, file=out, flush=True)

    n_gpus = devices.gpu_count()
    available = _available_backends()
    plan = [(b, _why_not(b, nprocs, available, n_gpus)) for b in requested or CHECKABLE_BACKENDS]
    if any(not reason for _, reason in plan):
        _load_launcher()  # its import starts the rank processes' warm-up meanwhile

    say("mgpu-lab doctor")
    say("versions")
    for name, value in _versions():
        say(f"  {name:<12} {value}")
    say("devices")
    gpus = devices.describe()
    say(f"  {'gpus':<12} {gpus}")
    if "CUDA_VISIBLE_DEVICES" in os.environ and "CUDA_VISIBLE_DEVICES=" not in gpus:
        say(f"  {'':<12} CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r}")
    say(f"  {'cpus':<12} {devices.cpu_count()} usable by this process")
    say("backends (built into torch)")
    for name, ok in available.items():
        say(f"  {name:<12} {'available' if ok else 'not available'}")

    say(f"checks: all_reduce + barrier on {nprocs} rank(s), timeout {timeout:g} s each")
    failures = passes = 0
    for backend, reason in plan:
        if reason and requested is None:
            say(f"  {backend:<6} skipped: {reason}")
            continue
        if reason:
            failures += 1
            fix = "use backend gloo" if backend == "nccl" else "install a torch with it"
            say(f"  {backend:<6} FAILED: cannot run here: {reason}; {fix}")
            continue
        passed, report = _check(backend, nprocs, timeout)
        passes += passed
        failures += not passed
        say(f"  {backend:<6} {report}")
    if nodes is not None:
        node_timeout = max(timeout, NODES_MIN_TIMEOUT)
        say(f"multi-node: all_reduce + barrier across {nodes} simulated nodes x {nprocs} rank(s), "
            f"timeout {node_timeout:g} s")
        passed, report = _check_nodes(nodes, nprocs, node_timeout)
        passes += passed
        failures += not passed
        say(f"  {'nodes':<6} {report}")

    if failures:
        say(f"result: {failures} check(s) FAILED; see the lines above for what to try")
        return 1
    if not passes:
        say("result: FAILED, no backend could be checked: torch has neither gloo nor "
            "a usable nccl; install the torch wheel from pytorch.org")
        return 1
    say(f"result: all {passes} check(s) passed")
    return 0

"""`mgpu-lab doctor`: what this machine can run, proven with real collectives.

The doctor prints the versions that matter, the GPUs and CPUs this process
sees and the distributed backends torch was built with, then starts real
ranks through :mod:`mgpu_lab.launch` and runs an ``all_reduce`` and a
``barrier`` on every backend that can work here. Each check ends in ``OK``
with the time it took, ``skipped`` with the reason, or ``FAILED`` with what
went wrong and what to try. The launches themselves are in
:mod:`mgpu_lab.doctor_probes`; this module gathers the facts and the report.

Example:
    >>> from mgpu_lab.doctor import run_doctor
    >>> run_doctor(backends=["gloo"], course=False)
    mgpu-lab doctor
    ...
      gloo   OK in ... s (2 ranks, all_reduce sum 3 on every rank)
    result: all 1 check(s) passed
    0
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import TextIO

import torch
import torch.distributed as dist

from mgpu_lab import devices, doctor_probes  # the module: tests stand in for its probes

__all__ = ["CHECKABLE_BACKENDS", "run_doctor"]

#: Backends the doctor can start ranks for; MPI ranks must come from mpirun.
CHECKABLE_BACKENDS = ("gloo", "nccl")

#: The multi-node check starts torchrun on every node; it gets at least this many seconds.
NODES_MIN_TIMEOUT = 90.0


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


def _validate(backends, nprocs, timeout, nodes) -> list[str] | None:
    requested = _normalise_backends(backends)
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs={nprocs!r} must be an int >= 1, e.g. nprocs=2")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"timeout={timeout!r} must be a positive number of seconds, e.g. 30")
    if nodes is not None and (isinstance(nodes, bool) or not isinstance(nodes, int) or not 2 <= nodes <= 16):
        raise ValueError(f"nodes={nodes!r} must be an int from 2 to 16 (simulated nodes), e.g. nodes=2")
    return requested


def _describe_machine(say, available: dict[str, bool]) -> None:
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


def _backend_checks(say, plan, requested, nprocs, timeout) -> list[bool]:
    results = []
    for backend, reason in plan:
        if reason and requested is None:
            say(f"  {backend:<6} skipped: {reason}")
            continue
        if reason:
            fix = "use backend gloo" if backend == "nccl" else "install a torch with it"
            say(f"  {backend:<6} FAILED: cannot run here: {reason}; {fix}")
            results.append(False)
            continue
        passed, report = doctor_probes.check_backend(backend, nprocs, timeout)
        say(f"  {backend:<6} {report}")
        results.append(passed)
    return results


def _course_checks(say, timeout: float) -> list[bool]:
    """What notebooks and grading need beyond collectives: the learner's line in a rank's traceback,
    and a grading sandbox that starts here (as which user, and what it lacks)."""
    from mgpu_lab.course.sandbox import self_test

    say("notebooks and grading")
    results = []
    for name, check in (("traceback", lambda: doctor_probes.check_traceback(timeout)),
                        ("sandbox", lambda: self_test(max(timeout, 120.0)))):
        passed, report = check()
        say(f"  {name:<9} {report}")
        results.append(passed)
    return results


def run_doctor(
    backends: str | Sequence[str] | None = None,
    nprocs: int = 2,
    timeout: float = 30.0,
    out: TextIO | None = None,
    nodes: int | None = None,
    course: bool = True,
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
        course: Also check what notebooks and grading need: that a rank's
            traceback shows a notebook cell's line, and that a grading sandbox
            starts here (the report names its user and what it lacks).

    Returns:
        0 if every check that ran passed, 1 if any failed or none could run.

    Raises:
        ValueError: If ``backends`` names an unknown backend, ``nprocs`` is not
            an int >= 1, ``timeout`` is not a positive number, or ``nodes`` is
            not None or an int from 2 to 16.

    Example:
        >>> import io
        >>> report = io.StringIO()
        >>> run_doctor(backends=["gloo"], nprocs=1, timeout=60, out=report, course=False)
        launch: 1 rank · ...
        0
        >>> report.getvalue().splitlines()[-1]
        'result: all 1 check(s) passed'
    """
    requested = _validate(backends, nprocs, timeout, nodes)
    out = sys.stdout if out is None else out

    def say(line: str = "") -> None:
        print(line, file=out, flush=True)

    available = _available_backends()
    plan = [(b, _why_not(b, nprocs, available, devices.gpu_count())) for b in requested or CHECKABLE_BACKENDS]
    if any(not reason for _, reason in plan):
        doctor_probes.load_launcher()  # its import starts the rank processes' warm-up meanwhile
    say("mgpu-lab doctor")
    _describe_machine(say, available)
    say(f"checks: all_reduce + barrier on {nprocs} rank(s), timeout {timeout:g} s each")
    results = _backend_checks(say, plan, requested, nprocs, timeout)
    if not results:
        say("result: FAILED, no backend could be checked: torch has neither gloo nor "
            "a usable nccl; install the torch wheel from pytorch.org")
        return 1
    if nodes is not None:
        node_timeout = max(timeout, NODES_MIN_TIMEOUT)
        say(f"multi-node: all_reduce + barrier across {nodes} simulated nodes x {nprocs} rank(s), "
            f"timeout {node_timeout:g} s")
        passed, report = doctor_probes.check_nodes(nodes, nprocs, node_timeout)
        say(f"  {'nodes':<6} {report}")
        results.append(passed)
    if course:
        results += _course_checks(say, timeout)
    if not all(results):
        say(f"result: {results.count(False)} check(s) FAILED; see the lines above for what to try")
        return 1
    say(f"result: all {len(results)} check(s) passed")
    return 0

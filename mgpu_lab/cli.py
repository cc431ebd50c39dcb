"""The ``mgpu-lab`` command.

Each subcommand is a thin layer over a library function, so notebooks and
tests call the same code the command line does.

Example:
    $ mgpu-lab doctor
    $ mgpu-lab doctor --backend gloo --nprocs 4 --timeout 60
    $ python -m mgpu_lab doctor
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

__all__ = ["build_parser", "main"]


def _add_doctor(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "doctor",
        help="check versions, devices and backends, with real 2-rank collectives",
        description=(
            "Print the versions, GPUs, CPUs and distributed backends this machine "
            "has, then run a real all_reduce + barrier on every backend that can "
            "work here. Exits non-zero if any check fails."
        ),
    )
    parser.add_argument(
        "--backend",
        dest="backends",
        action="append",
        choices=["gloo", "nccl"],
        help="check only this backend (repeatable); default: every usable one",
    )
    parser.add_argument(
        "--nprocs", type=int, default=2, help="ranks per check (default: 2)"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=30.0,
        help="seconds each check may take, start-up included (default: 30)",
    )
    # Simulated multi-node checks (--nodes N) go here, passed on to run_doctor.
    parser.set_defaults(handler=_doctor)


def _doctor(args: argparse.Namespace) -> int:
    from mgpu_lab.doctor import run_doctor

    return run_doctor(backends=args.backends, nprocs=args.nprocs, timeout=args.timeout)


def build_parser() -> argparse.ArgumentParser:
    """The ``mgpu-lab`` argument parser, one subparser per subcommand.

    Returns:
        The parser; subcommands set ``handler``, a function of the parsed
        arguments that returns the exit code.

    Example:
        >>> build_parser().parse_args(["doctor", "--nprocs", "4"]).nprocs
        4
    """
    parser = argparse.ArgumentParser(
        prog="mgpu-lab",
        description="Multi-GPU training in PyTorch: course tools.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_doctor(subparsers)
    # Further subcommands (assign, grade) register here the same way.
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``mgpu-lab`` with ``argv`` (default: ``sys.argv[1:]``).

    Args:
        argv: Command-line arguments without the program name.

    Returns:
        The exit code: 0 on success, 1 if a check failed, 2 on a usage error.

    Example:
        >>> main(["doctor", "--backend", "gloo"])  # doctest: +SKIP
        0
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return args.handler(args)
    except ValueError as err:  # bad option values: say so like argparse does
        parser.exit(2, f"mgpu-lab {args.command}: error: {err}\n")

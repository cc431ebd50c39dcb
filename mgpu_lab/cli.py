"""The ``mgpu-lab`` command.

Each subcommand is a thin layer over a library function, so notebooks and
tests call the same code the command line does.

Example:
    $ mgpu-lab lab                      # a learner: the notebooks into ./mgpu-lab-notebooks, JupyterLab there
    $ mgpu-lab doctor
    $ mgpu-lab doctor --backend gloo --nprocs 4 --timeout 60
    $ mgpu-lab doctor --nodes 2
    $ mgpu-lab slurm up --nodes 2; mgpu-lab slurm run -- sinfo; mgpu-lab slurm down
    $ python -m mgpu_lab doctor
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

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
    parser.add_argument(
        "--nodes",
        type=int,
        default=None,
        metavar="N",
        help="also run the all_reduce + barrier across N simulated nodes (2..16), "
        "--nprocs ranks each, under real torchrun (at least 90 s of timeout)",
    )
    parser.set_defaults(handler=_doctor)


def _doctor(args: argparse.Namespace) -> int:
    from mgpu_lab.doctor import run_doctor

    extra = {} if args.nodes is None else {"nodes": args.nodes}
    return run_doctor(backends=args.backends, nprocs=args.nprocs, timeout=args.timeout, **extra)


def _add_assign(subparsers) -> None:
    parser = subparsers.add_parser(
        "assign", help="write the student notebooks from the solution notebooks",
        description="Replace every ### BEGIN SOLUTION ... ### END SOLUTION block with "
                    "raise NotImplementedError and clear the outputs.")
    parser.add_argument("sources", nargs="*", type=Path, help="solution notebooks (default: solutions/*.ipynb)")
    parser.add_argument("--out", type=Path, default=Path("notebooks"), help="output folder (default: notebooks)")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if a student copy is missing or out of date")
    parser.set_defaults(handler=_assign)


def _assign(args) -> int:
    from mgpu_lab.course.assign import MarkerError, assign

    try:
        changed = assign(args.sources or None, args.out, check_only=args.check)
    except (MarkerError, FileNotFoundError) as err:
        print(f"mgpu-lab assign: {err}", file=sys.stderr)
        return 1
    verb = "out of date" if args.check else "written"
    for path in changed:
        print(f"{verb}: {path}")
    if not changed:
        print("student notebooks are up to date")
    return 1 if args.check and changed else 0


def _add_lab(subparsers) -> None:
    parser = subparsers.add_parser(
        "lab", help="copy the course's notebooks into DIR (once) and start JupyterLab there",
        description="Copy every student notebook of the installed course into DIR that is not there yet "
                    "(a copy you have edited is never overwritten: delete or rename it for a fresh one), "
                    "then start JupyterLab on DIR. Options after `--` go to JupyterLab, "
                    "e.g. `mgpu-lab lab DIR -- --ServerApp.token=...`.")
    parser.add_argument("dir", nargs="?", type=Path, default=Path("mgpu-lab-notebooks"),
                        help="your folder for the notebooks (default: ./mgpu-lab-notebooks)")
    parser.add_argument("--ip", default=None, help="address JupyterLab listens on (JupyterLab's default: localhost)")
    parser.add_argument("--port", type=int, default=None, help="port JupyterLab listens on")
    parser.add_argument("--no-browser", action="store_true", help="do not open a browser (remote machines, CI)")
    parser.add_argument("--no-start", action="store_true", help="copy the notebooks only; do not start JupyterLab")
    parser.set_defaults(handler=_lab)


def _lab(args) -> int:
    from mgpu_lab.course.lab import copy_notebooks, start_lab

    try:
        report = copy_notebooks(args.dir)
    except (ValueError, FileNotFoundError) as err:
        print(f"mgpu-lab lab: {err}", file=sys.stderr)
        return 1
    for line in report.lines():
        print(f"mgpu-lab lab: {line}", flush=True)
    if args.no_start:
        return 0
    options = [*([f"--ip={args.ip}"] if args.ip else []), *([f"--port={args.port}"] if args.port else []),
               *(["--no-browser"] if args.no_browser else []), *args.passthrough]
    return start_lab(args.dir, options)


def _add_refresh(subparsers) -> None:
    parser = subparsers.add_parser(
        "refresh", help="run solution notebooks; keep the outputs nbval checks and the measured ones",
        description="Execute each notebook in a fresh kernel and keep the outputs of "
                    "cells tagged 'nbval-check-output' (the ones nbval compares) or 'keep-output' (measured results a reader holds the text against).")
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--timeout", type=float, default=600, help="seconds per cell (default: 600)")
    parser.set_defaults(handler=_refresh)


def _refresh(args) -> int:
    from mgpu_lab.course.assign import refresh

    for path in args.notebooks:
        kept = refresh(path, timeout=args.timeout)
        print(f"{path}: kept the outputs of {kept} checked cell(s)")
    return 0


def _seconds(text: str) -> float:
    from mgpu_lab.course.grade import check_timeout

    try:
        return check_timeout(float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive finite number of seconds, e.g. 600") from None


def _add_grade(subparsers) -> None:
    parser = subparsers.add_parser(
        "grade", help="run submitted notebooks, each in its own sandbox, and score their checks",
        description="Each notebook runs in its own sandbox (a user, a directory, an allow-listed environment, "
                    "resource limits, no network, a PID namespace) under a timeout; the grader then judges "
                    "every check itself. Prints points per exercise and a total per notebook.")
    parser.add_argument("paths", nargs="+", type=Path,
                        help="notebooks to grade, or folders: every notebook in them (below too) is graded")
    parser.add_argument("--json", type=Path, help="also write the grades as JSON")
    parser.add_argument("--csv", type=Path, help="also write the grades as CSV")
    parser.add_argument("--gradescope", type=Path, metavar="OUT",
                        help="also write OUT/<submission>/results.json in Gradescope's autograder format")
    parser.add_argument("--timeout", type=_seconds, default=600.0,
                        help="seconds per notebook, and again (at least 300) for judging its checks (default: 600)")
    parser.add_argument("--jobs", "-j", type=_jobs, default=None, metavar="N",
                        help="notebooks graded at once, each in its own sandbox (default: what this machine's "
                             "cores and memory fit)")
    parser.add_argument("--results", type=Path, default=Path(".mgpu-lab-grades"), metavar="DIR",
                        help="where each notebook's grade is kept, by content: a re-run grades only what is new "
                             "or changed (default: .mgpu-lab-grades)")
    parser.add_argument("--force", action="store_true", help="grade every notebook again, kept grades or not")
    parser.add_argument("--all-cells", action="store_true",
                        help="run the demo cells too (by default grading skips those tagged skip-in-grading that "
                             "no exercise needs)")
    parser.add_argument("--plot", type=Path, metavar="PNG",
                        help="also draw the class summary (pass rate and most common failure per exercise)")
    slurm = parser.add_argument_group("on a SLURM cluster", "grade as a job array (a task per submission or per "
                                      "--chunk), on the nodes; --results must be on a file system they all see")
    slurm.add_argument("--slurm", action="store_true", help="grade as a SLURM job array (run on the login node)")
    slurm.add_argument("--partition", help="the partition to submit to (default: the cluster's)")
    slurm.add_argument("--parallel", type=_jobs, metavar="N",
                       help="array tasks grading at once, whatever the nodes they land on (default: as many as fit)")
    slurm.add_argument("--nodes", type=_jobs, metavar="N", dest="nodes_deprecated",
                       help="deprecated: the old name of --parallel (it never counted nodes)")
    slurm.add_argument("--chunk", type=_jobs, default=1, metavar="K", help="submissions per task (default: 1)")
    parser.set_defaults(handler=_grade)


def _jobs(text: str) -> int:
    from mgpu_lab.course.batch import check_jobs

    try:
        return check_jobs(int(text))
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"{text!r}: {err}") from None


def _notebooks(paths: list[Path]) -> tuple[list[Path], list[str]]:
    """The notebooks ``paths`` name (a folder: the notebooks in it and below, checkpoints left out), and
    what is wrong with the others, in words."""
    out, wrong = [], []
    for p in paths:
        if p.is_dir():
            found = sorted(q for q in p.rglob("*.ipynb") if ".ipynb_checkpoints" not in q.parts and q.is_file())
            out += found
            if not found:
                wrong.append(f"{p} is a folder that holds no notebook (.ipynb)")
        elif p.is_file():
            out.append(p)
        else:
            wrong.append(f"no such notebook or folder: {p}")
    return out, wrong


def _grade(args) -> int:
    from mgpu_lab.course.batch import default_jobs
    from mgpu_lab.course.grade import grade

    args.paths, wrong = _notebooks(args.paths)
    if wrong:
        print("mgpu-lab grade: " + "; ".join(wrong), file=sys.stderr)
        return 2
    if args.slurm:
        grades = _grade_on_slurm(args)
        if grades is None:
            return 1
        return _report(args, grades)
    from mgpu_lab.course.isolation import slot_user

    jobs = args.jobs or min(default_jobs(), len(args.paths))
    users = ", ".join(str(slot_user(k)[0]) for k in range(jobs)) if slot_user(0)[1] is not None else ""
    print(f"mgpu-lab grade: {len(args.paths)} notebook(s), {jobs} at a time"
          + (f" (each sandbox its own user: {users})" if jobs > 1 and users else "")
          + f"; grades kept in {args.results}" + (" (re-grading all: --force)" if args.force else ""),
          file=sys.stderr, flush=True)
    grades = grade(args.paths, timeout=args.timeout, jobs=jobs, store=args.results, force=args.force,
                   all_cells=args.all_cells, progress=True)
    return _report(args, grades)


def _grade_on_slurm(args):
    from mgpu_lab.course.slurm_grade import grade_on_slurm

    if args.nodes_deprecated is not None:
        print("mgpu-lab grade: --nodes is deprecated: it sets how many array tasks grade at once, not nodes; "
              "use --parallel", file=sys.stderr)
        args.parallel = args.parallel or args.nodes_deprecated
    try:
        return grade_on_slurm(args.paths, timeout=args.timeout, store=args.results, force=args.force,
                              all_cells=args.all_cells, partition=args.partition, parallel=args.parallel,
                              chunk=args.chunk, progress=True)
    except RuntimeError as err:
        print(f"mgpu-lab grade --slurm: {err}", file=sys.stderr)
        return None


def _report(args, grades) -> int:
    from mgpu_lab.course.grade import report, write_csv, write_json
    from mgpu_lab.course.gradescope import write_gradescope
    from mgpu_lab.course.summary import plot, summarize, table

    print(report(grades))
    rows = summarize(grades)
    if len(grades) > 1:
        print("\nclass summary\n" + table(rows))
    if args.plot:
        print(f"class summary drawn in {plot(rows, args.plot)}")
    if args.json:
        write_json(grades, args.json)
    if args.csv:
        write_csv(grades, args.csv)
    if args.gradescope:
        write_gradescope(grades, args.gradescope)
    return 0


def _add_autograder(subparsers) -> None:
    parser = subparsers.add_parser(
        "autograder", help="write a Gradescope autograder bundle (autograder.zip) for some lessons",
        description="Write the zip to upload as a Gradescope programming assignment's autograder: setup.sh "
                    "installs Python's packages and this course, run_autograder grades every notebook of a "
                    "submission as `mgpu-lab grade` does (a sandbox per notebook) and writes results.json.")
    parser.add_argument("lessons", nargs="*", metavar="LESSON", help="the assignment's lessons, e.g. 04 (default: all)")
    parser.add_argument("--out", type=Path, default=Path("autograder.zip"), help="default: autograder.zip")
    parser.add_argument("--budget", type=_seconds, default=540.0, metavar="SECONDS",
                        help="seconds run_autograder may take for a submission, a minute below the autograder "
                             "timeout set on Gradescope (default: 540, for its default of 10 minutes)")
    parser.set_defaults(handler=_autograder)


def _autograder(args) -> int:
    from mgpu_lab.course.autograder import build

    try:
        out = build(args.out, args.lessons, budget=args.budget)
    except ValueError as err:
        print(f"mgpu-lab autograder: {err}", file=sys.stderr)
        return 2
    print(f"{out}: upload it as the autograder of a Gradescope programming assignment "
          f"(lessons {', '.join(args.lessons) or 'all'}; students upload their NN_*.ipynb notebooks); on "
          f"Gradescope set the autograder's memory to 2 GB at least and its timeout above {args.budget:g} s")
    return 0


def _add_slurm(subparsers) -> None:
    parser = subparsers.add_parser(
        "slurm", help="a real SLURM cluster on this machine (root, Linux): up, down, status, run",
        description="Start or stop a local SLURM cluster (slurmctld, one slurmd per node, munge), every node a "
                    "network namespace; run SLURM commands on its login node. Needs root and the Debian "
                    "packages slurm-wlm and munge.")
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    start = actions.add_parser("up", help="start the cluster and wait until its nodes are idle")
    start.add_argument("--nodes", type=int, default=2, metavar="N", help="compute nodes (1..8, default 2)")
    actions.add_parser("down", help="stop the cluster and remove everything it made (also after a crash)")
    actions.add_parser("status", help="sinfo of the running cluster")
    runner = actions.add_parser("run", help="run a SLURM command on the login node, e.g. `run -- sbatch job.sh`")
    runner.add_argument("argv", nargs=argparse.REMAINDER, help="the command and its arguments")
    parser.set_defaults(handler=_slurm)


def _slurm(args) -> int:
    from mgpu_lab.cluster import slurm_local

    try:
        if args.action == "up":
            slurm_local.up(args.nodes)
        elif args.action == "down":
            slurm_local.down()
        elif args.action == "status":
            print(slurm_local.status(), end="")
        else:
            argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
            if not argv:
                print("mgpu-lab slurm run: name a command, e.g. mgpu-lab slurm run -- squeue", file=sys.stderr)
                return 2
            proc = slurm_local.run(argv, cwd=Path.cwd(), check=False, timeout=None)
            sys.stdout.write(proc.stdout)
            sys.stderr.write(proc.stderr)
            return proc.returncode
    except RuntimeError as err:
        print(f"mgpu-lab slurm {args.action}: {str(err).removeprefix('slurm: ')}", file=sys.stderr)
        return 1
    return 0


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
    _add_assign(subparsers)
    _add_lab(subparsers)
    _add_refresh(subparsers)
    _add_grade(subparsers)
    _add_autograder(subparsers)
    _add_slurm(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``mgpu-lab`` with ``argv`` (default: ``sys.argv[1:]``).

    Args:
        argv: Command-line arguments without the program name.

    Returns:
        The exit code: 0 on success, 1 if a check failed, 2 on a usage error.

    Example:
        >>> main(["doctor", "--backend", "gloo"])   # real ranks: a few seconds
        mgpu-lab doctor
        versions
        ...
        result: all 3 check(s) passed
        0
    """
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)  # what follows `--` goes to the program started
    args = parser.parse_args(argv[:cut])
    args.passthrough = argv[cut + 1:]
    if args.passthrough and args.command != "lab":
        parser.error(f"only `mgpu-lab lab` passes options on (after --); got {' '.join(args.passthrough)}")
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return args.handler(args)
    except ValueError as err:  # bad option values: say so like argparse does
        parser.exit(2, f"mgpu-lab {args.command}: error: {err}\n")

"""What lesson 07's checks use to judge commands: calls in a fresh process, torchrun's parser, real runs.

:func:`..sim.outcome.outcomes` runs in the check's fresh process (every call of the
learner's function, each outcome as data); :func:`parse_torchrun` reads a command with
torchrun's own argument parser and :func:`judge_static` compares it with the job
it should start; :func:`run_commands` runs one command per simulated node.
"""
from __future__ import annotations

import contextlib
import io
import re


IFACE_HINT = "set NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME, both to the interface's name; values are strings"


def runnable(t, argv, args=None):
    """The learner's command, or when grading, the command rebuilt from what torchrun read of it (``args``)."""
    if not t.grading:
        return argv
    args = parse_torchrun(argv)[0] if args is None else args
    return ["torchrun", f"--nnodes={args.nnodes}", f"--nproc-per-node={args.nproc_per_node}",
            f"--node-rank={args.node_rank}", f"--master-addr={args.master_addr}",
            f"--master-port={args.master_port}", args.training_script]


def judge_interface(t, env, want: str) -> None:
    # NCCL reads a prefix, or with "=" exactly that name (NCCL's docs); gloo reads the name
    for name in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        if env.get(name) != want and not (name.startswith("NCCL") and env.get(name) == "=" + want):
            why = ("NCCL only reads NCCL_SOCKET_IFNAME; gloo (CPU collectives, also used beside NCCL) "
                   "only reads GLOO_SOCKET_IFNAME" if name not in env else IFACE_HINT)
            t.fail(why, f"{name}={want!r}", f"{name}={env.get(name)!r}")


WORLD_HINT = ("--nnodes counts machines and --nproc-per-node the processes on each; the world size, "
              "nnodes * nproc_per_node, is no option of torchrun")


def key(args: tuple) -> str:
    """A dict key for one call's arguments."""
    return repr(args)  # not the tuple: (True, 0, 2) == (1, 0, 2) as dict keys




def parse_torchrun(argv):
    """Read ``argv`` with torchrun's own parser; ``(args, "")`` or ``(None, why not)``."""
    from torch.distributed.run import get_args_parser

    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        return None, f"return a list of strings, not {argv!r}"[:300]
    rest = after_launcher(argv)
    if rest is None:
        return None, (f"start the command with 'torchrun' (or python -m torch.distributed.run), "
                      f"not {argv[:3]!r}")
    with contextlib.redirect_stderr(io.StringIO()) as err:
        try:
            parser = get_args_parser()
            parser.set_defaults(master_port=None)  # left out reads as None: torch 2.11's parser says 29500 itself
            return parser.parse_args(rest), ""
        except SystemExit:
            return None, "torchrun cannot read it: " + " ".join(err.getvalue().strip().splitlines()[-1:])


def after_launcher(argv):
    """torchrun's own arguments: what follows ``torchrun`` or ``python -m torch.distributed.run`` (None: neither)."""
    if re.fullmatch(r"(.*/)?torchrun", argv[0]):
        return argv[1:]
    if re.fullmatch(r"(.*/)?python[\d.]*", argv[0]) and argv[1:3] == ["-m", "torch.distributed.run"]:
        return argv[3:]
    return None


def nnodes_of(args) -> tuple | None:
    """``(min, max)`` of ``--nnodes`` as torchrun reads it (None: unreadable)."""
    from torch.distributed.run import parse_min_max_nnodes

    try:
        return parse_min_max_nnodes(args.nnodes)
    except (ValueError, RuntimeError):
        return None


def judge_static(t, args, script, nnodes, nproc, node_rank, addr, port, hint: str = "") -> None:
    """Fail the case unless torchrun would run this node's part of the job as asked."""
    problems = []
    if nnodes_of(args) != (nnodes, nnodes):
        problems.append(f"--nnodes={nnodes} (got {args.nnodes!r})")
    if args.nproc_per_node != str(nproc):
        problems.append(f"--nproc-per-node={nproc} (got {args.nproc_per_node!r})")
    if args.node_rank != node_rank:
        problems.append(f"--node-rank={node_rank} (got {args.node_rank})")
    if args.master_addr != addr:
        problems.append(f"--master-addr={addr} (got {args.master_addr!r}"
                        + (", torchrun's default when it is left out)" if args.master_addr == "127.0.0.1" else ")"))
    if args.master_port != port:
        got = "left out: torchrun then uses 29500" if args.master_port is None else f"got {args.master_port}"
        problems.append(f"--master-port={port} ({got})")
    if args.training_script != script or args.training_script_args:
        problems.append(f"the script {script!r} last, with no arguments after it "
                        f"(got {[args.training_script, *args.training_script_args]!r})")
    if problems:
        world = nnodes * nproc
        confused = nnodes != nproc and world not in (nnodes, nproc) and str(world) in (
            args.nproc_per_node, str(args.nnodes).split(":")[0])
        t.fail("torchrun reads your command differently: it needs " + "; ".join(problems)
               + (f" ({hint})" if hint else "") + (f"; {WORLD_HINT}" if confused else ""), "; ".join(problems), "")

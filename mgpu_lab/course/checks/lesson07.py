"""Checks of lesson 07 (multi-node): global_rank, torchrun_command, node_env.

The learner's functions run in fresh processes. What they return is judged the
way a cluster would judge it: torchrun's own argument parser reads the
commands, and then the commands (and the environment variables) start real
``torchrun`` on two simulated nodes (:mod:`mgpu_lab.cluster.multinode`) with a small
script that reports RANK, LOCAL_RANK, WORLD_SIZE and GROUP_RANK and runs an
all_reduce; every run is bounded by a timeout.
"""
from __future__ import annotations

import contextlib
import io
import re

from ._core import exercise

RUN_TIMEOUT = 120.0  # seconds for one real run on simulated nodes, torchrun start-up included
PG_TIMEOUT = 5  # seconds a rank of the check's script waits for the others
RANK_HINT = "the ranks of node n follow those of nodes 0..n-1: global_rank = node_rank * nproc_per_node + local_rank"


def _outcomes(fn, calls):
    """Runs in a fresh process: ``fn(*args)`` for every args tuple, each outcome as data."""
    out = []
    for args in calls:
        try:
            out.append(("ok", fn(*args)))
        except NotImplementedError:
            raise
        except Exception as exc:  # noqa: BLE001 - the checker judges the exception
            out.append(("raised", type(exc).__name__, str(exc)))
    return out


def _key(args: tuple) -> str:
    return repr(args)  # not the tuple: (True, 0, 2) == (1, 0, 2) as dict keys


def _shown(outcome) -> str:
    return f"raised {outcome[1]}: {outcome[2]}" if outcome[0] == "raised" else f"returned {outcome[1]!r}"


# -- global_rank -------------------------------------------------------------------
@exercise("07.global_rank", points=6, description="global_rank(node_rank, local_rank, nproc_per_node): the "
          "global rank torchrun gives that process; ValueError for out-of-range or non-int arguments")
def _global_rank(t, global_rank):
    examples = [((1, 3, 4), 7), ((0, 2, 4), 2), ((2, 0, 8), 16)]
    grid = [(n, l, 4) for n in range(3) for l in range(4)]
    bad_range = [(-1, 0, 4), (0, 4, 4), (0, -1, 4), (0, 0, 0), (1, 0, -2)]
    bad_type = [(True, 0, 2), (0, 1.0, 2), ("1", 0, 2), (0, 0, 2.0), (None, 0, 2)]
    calls = [a for a, _ in examples] + grid + bad_range + bad_type
    got = {}
    with t.case("global_rank(1, 3, 4) == 7, global_rank(0, 2, 4) == 2, global_rank(2, 0, 8) == 16",
                hint=RANK_HINT):
        got = dict(zip(map(_key, calls), t.call(_outcomes, global_rank, calls)))
        for args, expected in examples:
            if got[_key(args)] != ("ok", expected):
                t.fail(RANK_HINT, f"global_rank{args} == {expected}", _shown(got[_key(args)]))
    with t.case("3 nodes x 4 processes: ranks 0..11, each once, node 0's first", hint=RANK_HINT):
        if not got:
            t.fail("the first case did not finish")
        ranks = [got[_key(a)][1] if got[_key(a)][0] == "ok" else None for a in grid]
        if ranks != list(range(12)):
            t.fail(RANK_HINT, "[0, 1, ..., 11] for (node 0, local 0..3), (node 1, local 0..3), ...", ranks)
    cases = [
        ("ValueError for a negative node_rank: global_rank(-1, 0, 4)", bad_range[:1], False,
         "node ranks start at 0: raise ValueError naming the bad node_rank"),
        ("ValueError for local_rank outside 0..nproc_per_node-1: global_rank(0, 4, 4), global_rank(0, -1, 4)",
         bad_range[1:3], False, "a node runs nproc_per_node processes, local ranks 0..nproc_per_node-1: "
                                "raise ValueError otherwise (4 of 4 is one too many)"),
        ("ValueError for nproc_per_node < 1: global_rank(0, 0, 0), global_rank(1, 0, -2)", bad_range[3:], False,
         "every node runs at least one process: raise ValueError for nproc_per_node < 1"),
        ("ValueError for arguments that are not plain ints (True, 1.0, '1', None)", bad_type, True,
         "check isinstance(x, int) and not isinstance(x, bool) for each argument; raise ValueError otherwise"),
    ]
    for name, args_list, hidden, hint in cases:
        with t.case(name, hidden=hidden, hint=hint):
            if not got:
                t.fail("the first case did not finish")
            for args in args_list:
                outcome = got[_key(args)]
                if outcome[0] != "raised" or outcome[1] != "ValueError":
                    t.fail(hint, f"global_rank{args!r} raises ValueError", _shown(outcome))


# -- torchrun_command ---------------------------------------------------------------
def parse_torchrun(argv):
    """Read ``argv`` with torchrun's own parser; ``(args, "")`` or ``(None, why not)``."""
    from torch.distributed.run import get_args_parser

    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        return None, f"return a list of strings, not {argv!r}"[:300]
    rest = _after_launcher(argv)
    if rest is None:
        return None, (f"start the command with 'torchrun' (or python -m torch.distributed.run), "
                      f"not {argv[:3]!r}")
    with contextlib.redirect_stderr(io.StringIO()) as err:
        try:
            return get_args_parser().parse_args(rest), ""
        except SystemExit:
            return None, "torchrun cannot read it: " + " ".join(err.getvalue().strip().splitlines()[-1:])


def _after_launcher(argv):
    if re.fullmatch(r"(.*/)?torchrun", argv[0]):
        return argv[1:]
    if re.fullmatch(r"(.*/)?python[\d.]*", argv[0]) and argv[1:3] == ["-m", "torch.distributed.run"]:
        return argv[3:]
    return None


def _nnodes(args) -> tuple | None:
    from torch.distributed.run import parse_min_max_nnodes

    try:
        return parse_min_max_nnodes(args.nnodes)
    except (ValueError, RuntimeError):
        return None


def _judge_static(t, args, script, nnodes, nproc, node_rank, addr, port, hint: str = "") -> None:
    """Fail the case unless torchrun would run this node's part of the job as asked."""
    problems = []
    if _nnodes(args) != (nnodes, nnodes):
        problems.append(f"--nnodes={nnodes} (got {args.nnodes!r})")
    if args.nproc_per_node != str(nproc):
        problems.append(f"--nproc-per-node={nproc} (got {args.nproc_per_node!r})")
    if args.node_rank != node_rank:
        problems.append(f"--node-rank={node_rank} (got {args.node_rank})")
    if args.master_addr != addr:
        problems.append(f"--master-addr={addr} (got {args.master_addr!r})")
    if args.master_port != port:
        problems.append(f"--master-port={port} (got {args.master_port})")
    if args.training_script != script or args.training_script_args:
        problems.append(f"the script {script!r} last, with no arguments after it "
                        f"(got {[args.training_script, *args.training_script_args]!r})")
    if problems:
        t.fail("torchrun reads your command differently: it needs " + "; ".join(problems)
               + (f" ({hint})" if hint else ""), "; ".join(problems), "")


def run_commands(cluster, argvs, env: dict):
    """Run one command per node on the simulated nodes; return (result, the ranks' reports)."""
    from mgpu_lab.cluster.multinode import probe_reports

    env = {**env, "ALLREDUCE_CHECK_JSON": "1"}
    result = cluster.run(argvs, env=env, timeout=RUN_TIMEOUT, after_failure=3, echo=False)
    return result, probe_reports(result)


# A grader runs these commands as root outside the submission's sandbox: only what the cases judged.
GRADED_ENV = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_DEBUG", "NCCL_DEBUG_SUBSYS")


def _runnable(t, argv, args):
    """The learner's command, or when grading, the command rebuilt from what torchrun read and the cases judged."""
    if not t.grading:
        return argv
    return ["torchrun", f"--nnodes={args.nnodes}", f"--nproc-per-node={args.nproc_per_node}",
            f"--node-rank={args.node_rank}", f"--master-addr={args.master_addr}",
            f"--master-port={args.master_port}", args.training_script]


def _where(cluster) -> str:
    return cluster.banner().split(" · ", 1)[1]


def _failure_text(result) -> str:
    return " | ".join(line for line in result.key_lines(limit=2, width=200)) or result.summary()


@exercise("07.torchrun_command", points=7, description="torchrun_command(script, nnodes, nproc_per_node, "
          "node_rank, master_addr, master_port): this node's torchrun argv with static rendezvous, run "
          "for real on 2 simulated nodes")
def _torchrun_command(t, torchrun_command):
    from mgpu_lab.cluster.multinode import SimCluster

    with SimCluster(2) as cluster:
        _judge_torchrun_command(t, torchrun_command, cluster)


def _judge_torchrun_command(t, torchrun_command, cluster):
    from mgpu_lab.cluster.multinode import PROBE_SCRIPT

    script, addr, port = str(PROBE_SCRIPT), cluster.master_addr, cluster.port()
    shape = (script, 2, 2)
    other = ("train.py", 4, 8, 3, "node0", 29400)
    hidden = ("/home/me/a.py", 16, 1, 15, "10.0.0.1", 1234)
    calls = [(*shape, 0, addr, port), (*shape, 1, addr, port), other, hidden]
    got, parsed = [], [None] * len(calls)
    with t.case("returns a list of strings that torchrun can read, starting with 'torchrun'",
                hint="e.g. ['torchrun', f'--nnodes={nnodes}', ..., script]; every item a str"):
        got = t.call(_outcomes, torchrun_command, calls)
        for i, outcome in enumerate(got):
            if outcome[0] == "ok":
                parsed[i], why = parse_torchrun(outcome[1])
            else:
                why = _shown(outcome)
            if parsed[i] is None and i < 2:
                t.fail(why, "['torchrun', '--nnodes=2', ...]", repr(outcome[1])[:300] if outcome[0] == "ok"
                       else _shown(outcome))
    hint = "--nnodes, --nproc-per-node, --node-rank, --master-addr, --master-port from the arguments, the script last"
    with t.case("node 0: --nnodes=2 --nproc-per-node=2 --node-rank=0, --master-addr and --master-port as given, "
                "then the script", hint=hint):
        if parsed[0] is None:
            t.fail("not judged: the first case failed")
        _judge_static(t, parsed[0], script, 2, 2, 0, addr, port, hint)
    rank_hint = "pass node_rank on: f'--node-rank={node_rank}'"
    with t.case("node 1's command says --node-rank=1", hint=rank_hint):
        if parsed[1] is None:
            t.fail("not judged: the first case failed")
        _judge_static(t, parsed[1], script, 2, 2, 1, addr, port, rank_hint)
    with t.case("static rendezvous: no --standalone, no --rdzv-backend/--rdzv-endpoint",
                hint="static rendezvous is torchrun's default; --standalone starts a one-node job of its own on "
                     "each node, and c10d would ignore --node-rank"):
        if parsed[0] is None:
            t.fail("not judged: the first case failed")
        for p in parsed[:2]:
            if p.standalone or p.rdzv_backend != "static" or p.rdzv_endpoint:
                t.fail("", "rdzv_backend static, standalone off",
                       f"standalone={p.standalone}, rdzv_backend={p.rdzv_backend!r}, rdzv_endpoint={p.rdzv_endpoint!r}")
    with t.case("run for real on 2 simulated nodes: RANK 0..3, LOCAL_RANK 0..1, GROUP_RANK = node, WORLD_SIZE 4, "
                "all_reduce sum 10 on every rank", hint="the commands must start one job of 2 nodes x 2 processes"):
        if any(c.passed is False for c in t.cases):
            t.fail("not run until the cases above pass: a wrong command makes torchrun wait, not fail")
        env = {"GLOO_SOCKET_IFNAME": cluster.interface, "ALLREDUCE_CHECK_TIMEOUT": str(PG_TIMEOUT)}
        result, reports = run_commands(cluster, [_runnable(t, got[i][1], parsed[i]) for i in (0, 1)], env)
        seen = sorted((int(r["RANK"]), int(r["LOCAL_RANK"]), int(r["GROUP_RANK"]), int(r["WORLD_SIZE"]), r["node"],
                       r["sum"]) for r in reports)
        expected = [(r, r % 2, r // 2, 4, r // 2, 10.0) for r in range(4)]
        if seen != expected:
            t.fail(f"on {_where(cluster)}: {_failure_text(result)}",
                   "(RANK, LOCAL_RANK, GROUP_RANK, WORLD_SIZE, node, sum): " + repr(expected),
                   repr(seen) if seen else "no rank reported: " + result.summary().replace("\n", " "))
    for args, hidden_case in ((other, False), (hidden, True)):
        i = calls.index(args)
        where = "use each argument where it belongs: --nnodes=nnodes, --nproc-per-node=nproc_per_node"
        with t.case(f"another job: {args[1]} nodes x {args[2]} processes, this is node {args[3]}, master "
                    f"{args[4]}:{args[5]}, script {args[0]}", hidden=hidden_case, hint=where):
            if parsed[i] is None:
                t.fail("", "a command torchrun reads", _shown(got[i]) if got else "")
            _judge_static(t, parsed[i], *args, where)


# -- node_env -------------------------------------------------------------------------
@exercise("07.node_env", points=5, description="node_env(interface, debug=False): the environment variables that "
          "make NCCL and gloo use that interface (and NCCL log at INFO level when debug)")
def _node_env(t, node_env):
    from mgpu_lab.cluster.multinode import SimCluster

    with SimCluster(2) as cluster:
        _judge_node_env(t, node_env, cluster)


def _judge_node_env(t, node_env, cluster):
    from mgpu_lab.cluster.multinode import PROBE_SCRIPT

    calls = [("eth0",), ("ib0",), ("eth0", True), ("eth0", False), (cluster.interface,)]
    got = []
    iface_hint = "set NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME, both to the interface's name; values are strings"
    for i, name in enumerate(("node_env('eth0'): NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME are 'eth0'",
                              "node_env('ib0'): both name ib0")):
        with t.case(name, hint=iface_hint):
            got = got or t.call(_outcomes, node_env, calls)
            env = got[i][1] if got[i][0] == "ok" else None
            if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
                t.fail("return a dict of str to str", "{'NCCL_SOCKET_IFNAME': ..., 'GLOO_SOCKET_IFNAME': ...}",
                       _shown(got[i]))
            want = calls[i][0]
            for key in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
                if env.get(key) != want:
                    why = ("NCCL only reads NCCL_SOCKET_IFNAME; gloo (CPU collectives, also used beside NCCL) "
                           "only reads GLOO_SOCKET_IFNAME" if key not in env else iface_hint)
                    t.fail(why, f"{key}={want!r}", f"{key}={env.get(key)!r}")
    with t.case("node_env('eth0', debug=True) adds NCCL_DEBUG=INFO; debug=False leaves it out",
                hint="NCCL_DEBUG=INFO makes NCCL log how it sets up (interfaces, transports); add it only when debug"):
        if not got:
            t.fail("the first case did not finish")
        on, off = (got[2][1] if got[2][0] == "ok" else {}), (got[3][1] if got[3][0] == "ok" else {})
        if not isinstance(on, dict) or on.get("NCCL_DEBUG") != "INFO":
            t.fail("", "NCCL_DEBUG='INFO' with debug=True", _shown(got[2]))
        if not isinstance(off, dict) or off.get("NCCL_DEBUG") in ("INFO", "TRACE"):
            t.fail("", "no NCCL_DEBUG=INFO with debug=False", _shown(got[3]))
    with t.case("node_env('eth0', True) keeps the interface variables",
                hint="debug adds to the interface variables, it does not replace them", hidden=True):
        on = got[2][1] if got and got[2][0] == "ok" else {}
        if not isinstance(on, dict) or on.get("GLOO_SOCKET_IFNAME") != "eth0" or on.get("NCCL_SOCKET_IFNAME") != "eth0":
            t.fail("", "both *_SOCKET_IFNAME='eth0'", repr(on))
    with t.case("gloo across 2 simulated nodes with your variables: the all_reduce completes",
                hint="without GLOO_SOCKET_IFNAME gloo uses the address of the host name, 127.0.0.1 here, "
                     "which the other node cannot reach"):
        if not got:
            t.fail("the first case did not finish")
        mine = got[4][1] if got[4][0] == "ok" else None
        if not isinstance(mine, dict):
            t.fail("node_env must return a dict", "a dict", _shown(got[4]))
        env = {**{str(k): str(v) for k, v in mine.items() if not t.grading or k in GRADED_ENV},
               "ALLREDUCE_CHECK_TIMEOUT": "3"}
        result, reports = run_commands(cluster, cluster.torchrun(PROBE_SCRIPT, fork=True), env)
        if len(reports) != 2 or not all(r["ok"] for r in reports):
            t.fail(f"on {_where(cluster)} with {mine}: {_failure_text(result)}", "both ranks: all_reduce sum 3",
                   f"{len(reports)} rank(s) finished; " + result.summary().replace("\n", " "))

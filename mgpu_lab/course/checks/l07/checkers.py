"""Checks of lesson 07 (multi-node): global_rank, torchrun_command, node_env.

The learner's functions run in fresh processes, every call of a check in one
process. What they return is judged the way a cluster would judge it: torchrun's
own argument parser reads the commands, and the variables are compared with what
NCCL and gloo read. Only an answer that passes those cases is then run for real:
one ``torchrun`` per simulated node (:mod:`mgpu_lab.cluster.multinode`), with a
small script that reports RANK, LOCAL_RANK, WORLD_SIZE and GROUP_RANK and runs
an all_reduce; every run is bounded by a timeout. A wrong command makes torchrun
wait rather than fail, so the wrong answers fail within a second, before any run.
"""
from __future__ import annotations

from .._core import exercise
from ..sim.outcome import in_words, outcomes
from .judges import judge_interface, runnable, IFACE_HINT, judge_static, key, parse_torchrun
from .ranks import failure_text, fast, PG_TIMEOUT, run_commands, where


RANK_HINT = "the ranks of node n follow those of nodes 0..n-1: global_rank = node_rank * nproc_per_node + local_rank"


# -- global_rank -------------------------------------------------------------------
@exercise("07.global_rank", points=6, description="global_rank(node_rank, local_rank, nproc_per_node): the "
          "global rank torchrun gives that process; ValueError for out-of-range or non-int arguments")
def _global_rank(t, global_rank):
    """Judges 30 calls made in one process.

    Catches: node and local rank swapped, a missing factor, node 0 or local rank
    0 rejected; no ValueError for a negative node rank, a local rank outside
    0..nproc_per_node-1 (4 of 4 included) or nproc_per_node < 1; bools, floats,
    strings or None accepted, or TypeError raised for them (the one, hidden,
    case about types).
    """
    examples = [((1, 3, 4), 7), ((0, 2, 4), 2), ((2, 0, 8), 16)]
    grid = [(n, l, 4) for n in range(3) for l in range(4)]
    bad_range = [(-1, 0, 4), (0, 4, 4), (0, -1, 4), (0, 0, 0), (1, 0, -2)]
    bad_type = [(True, 0, 2), (0, 1.0, 2), ("1", 0, 2), (0, 0, 2.0), (None, 0, 2)]
    calls = [a for a, _ in examples] + grid + bad_range + bad_type
    got = {}
    with t.case("global_rank(1, 3, 4) == 7, global_rank(0, 2, 4) == 2, global_rank(2, 0, 8) == 16",
                hint=RANK_HINT):
        got = dict(zip(map(key, calls), t.call(outcomes, global_rank, calls)))
        for args, expected in examples:
            if got[key(args)] != ("ok", expected):
                t.fail(RANK_HINT, f"global_rank{args} == {expected}", in_words(got[key(args)]))
    with t.case("3 nodes x 4 processes: ranks 0..11, each once, node 0's first", hint=RANK_HINT):
        if not got:
            t.fail("the first case did not finish")
        ranks = [got[key(a)][1] if got[key(a)][0] == "ok" else None for a in grid]
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
                outcome = got[key(args)]
                if outcome[0] != "raised" or outcome[1] != "ValueError":
                    t.fail(hint, f"global_rank{args!r} raises ValueError", in_words(outcome))


# -- torchrun_command ---------------------------------------------------------------
STATIC = ("10.213.7.1", 29517)  # node 0's address and a port that is not torchrun's default (29500)


@exercise("07.torchrun_command", points=7, description="torchrun_command(script, nnodes, nproc_per_node, "
          "node_rank, master_addr, master_port): this node's torchrun argv with static rendezvous, run "
          "for real on 2 simulated nodes")
def _torchrun_command(t, torchrun_command):
    """Judges four calls with torchrun's own parser, then runs node 0's and node 1's commands for real.

    Catches: a string or non-str items; not starting with torchrun (or python -m
    torch.distributed.run); the script first (the options become its
    arguments); the node rank hard-coded or off by one; nnodes and nproc_per_node
    swapped, or the world size given as either; --master-addr or --master-port
    left out (torchrun's defaults, 127.0.0.1:29500); --standalone or c10d instead
    of static rendezvous. The real run (2 nodes x 2 processes, only once the
    other cases pass) adds --start-method=fork --run-path to the commands: the
    same job, started seconds faster.
    """
    from mgpu_lab.cluster.multinode import PROBE_SCRIPT

    script = str(PROBE_SCRIPT)
    other = ("train.py", 4, 8, 3, "node0", 29400)
    hidden = ("/home/me/a.py", 16, 1, 15, "10.0.0.1", 1234)
    calls = [(script, 2, 2, 0, *STATIC), (script, 2, 2, 1, *STATIC), other, hidden]
    got, parsed = [], [None] * len(calls)
    with t.case("returns a list of strings that torchrun can read, starting with 'torchrun'",
                hint="e.g. ['torchrun', f'--nnodes={nnodes}', ..., script]; every item a str"):
        got = t.call(outcomes, torchrun_command, calls)
        for i, outcome in enumerate(got):
            if outcome[0] == "ok":
                parsed[i], why = parse_torchrun(outcome[1])
            else:
                why = in_words(outcome)
            if parsed[i] is None and i < 2:
                t.fail(why, "['torchrun', '--nnodes=2', ...]", repr(outcome[1])[:300] if outcome[0] == "ok"
                       else in_words(outcome))
    hint = "--nnodes, --nproc-per-node, --node-rank, --master-addr, --master-port from the arguments, the script last"
    with t.case(f"node 0: --nnodes=2 --nproc-per-node=2 --node-rank=0 --master-addr={STATIC[0]} "
                f"--master-port={STATIC[1]}, then the script", hint=hint):
        if parsed[0] is None:
            t.fail("not judged: the first case failed")
        judge_static(t, parsed[0], script, 2, 2, 0, *STATIC, hint)
    rank_hint = "pass node_rank on: f'--node-rank={node_rank}'"
    with t.case("node 1's command says --node-rank=1", hint=rank_hint):
        if parsed[1] is None:
            t.fail("not judged: the first case failed")
        judge_static(t, parsed[1], script, 2, 2, 1, *STATIC, rank_hint)
    with t.case("static rendezvous: no --standalone, no --rdzv-backend/--rdzv-endpoint",
                hint="static rendezvous is torchrun's default; --standalone starts a one-node job of its own on "
                     "each node, and c10d would ignore --node-rank"):
        if parsed[0] is None:
            t.fail("not judged: the first case failed")
        for p in parsed[:2]:
            if p is not None and (p.standalone or p.rdzv_backend != "static" or p.rdzv_endpoint):
                t.fail("", "rdzv_backend static, standalone off",
                       f"standalone={p.standalone}, rdzv_backend={p.rdzv_backend!r}, rdzv_endpoint={p.rdzv_endpoint!r}")
    for args, hidden_case in ((other, False), (hidden, True)):
        i = calls.index(args)
        belongs = "use each argument where it belongs: --nnodes=nnodes, --nproc-per-node=nproc_per_node"
        with t.case(f"another job: {args[1]} nodes x {args[2]} processes, this is node {args[3]}, master "
                    f"{args[4]}:{args[5]}, script {args[0]}", hidden=hidden_case, hint=belongs):
            if parsed[i] is None:
                t.fail("", "a command torchrun reads", in_words(got[i]) if got else "")
            judge_static(t, parsed[i], *args, belongs)
    with t.case("run for real on 2 simulated nodes: RANK 0..3, LOCAL_RANK 0..1, GROUP_RANK = node, WORLD_SIZE 4, "
                "all_reduce sum 10 on every rank", hint="the commands must start one job of 2 nodes x 2 processes"):
        if not all(c.passed for c in t.cases):
            t.fail("not run until the cases above pass: a wrong command makes torchrun wait, not fail")
        _run_static(t, torchrun_command, script)


def _run_static(t, torchrun_command, script) -> None:
    from mgpu_lab.cluster.multinode import SimCluster

    with SimCluster(2) as cluster:
        addr, port = cluster.master_addr, cluster.port()
        got = t.call(outcomes, torchrun_command, [(script, 2, 2, r, addr, port) for r in (0, 1)])
        argvs = [outcome[1] for outcome in got if outcome[0] == "ok" and parse_torchrun(outcome[1])[0]]
        if len(argvs) != 2:
            t.fail("with this cluster's address and port your function gave no command torchrun reads",
                   "two commands", "; ".join(map(in_words, got)))
        env = {"GLOO_SOCKET_IFNAME": cluster.interface, "ALLREDUCE_CHECK_TIMEOUT": str(PG_TIMEOUT)}
        result, reports = run_commands(cluster, [fast(runnable(t, argv)) for argv in argvs], env)
        seen = sorted((int(r["RANK"]), int(r["LOCAL_RANK"]), int(r["GROUP_RANK"]), int(r["WORLD_SIZE"]),
                       r["node"], r["sum"]) for r in reports)
        expected = [(r, r % 2, r // 2, 4, r // 2, 10.0) for r in range(4)]
        if seen != expected:
            t.fail(f"on {where(cluster)}: {failure_text(result)}",
                   "(RANK, LOCAL_RANK, GROUP_RANK, WORLD_SIZE, node, sum): " + repr(expected),
                   repr(seen) if seen else "no rank reported: " + result.summary().replace("\n", " "))


# A grader runs these commands as root outside the submission's sandbox: only what the cases judged.
GRADED_ENV = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_DEBUG", "NCCL_DEBUG_SUBSYS")


# -- node_env -------------------------------------------------------------------------
TRANSPORTS = ("NCCL_IB_DISABLE", "NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE")


@exercise("07.node_env", points=5, description="node_env(interface, debug=False): the environment variables that "
          "make NCCL's and gloo's sockets use that interface (and NCCL log at INFO level when debug)")
def _node_env(t, node_env):
    """Judges five calls made in one process, then, once they pass, gloo across 2 simulated nodes.

    Catches: no dict, or values that are not strings (a bool, None); NCCL's or
    gloo's variable missing, hard-coded to eth0, or an exclusion (^eth0); a
    transport switched off (NCCL_IB_DISABLE=1 would move NCCL's data from
    InfiniBand onto sockets); NCCL_DEBUG=INFO always or never, or debug
    replacing the interface variables. The real run (only once the other cases
    pass) starts torchrun on both nodes with the variables.
    """
    calls = [("eth0",), ("ib0",), ("eth0", True), ("eth0", False)]
    got = []
    with t.case("node_env('eth0'): a dict of str to str; NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME are 'eth0'",
                hint=IFACE_HINT):
        got = t.call(outcomes, node_env, calls)
        for args, outcome in zip(calls, got):
            env = outcome[1] if outcome[0] == "ok" else None
            if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
                t.fail("return a dict of str to str: os.environ takes strings only",
                       "{'NCCL_SOCKET_IFNAME': ..., 'GLOO_SOCKET_IFNAME': ...}", f"node_env{args}: {in_words(outcome)}")
        judge_interface(t, got[0][1], "eth0")
    with t.case("node_env('ib0'): both name ib0, and no transport is switched off (NCCL keeps InfiniBand)",
                hint="NCCL_SOCKET_IFNAME picks the interface of NCCL's sockets (its bootstrap, and its data only "
                     "where there is no InfiniBand); over InfiniBand NCCL moves the data with IB verbs"):
        if not got:
            t.fail("the first case did not finish")
        env = got[1][1] if got[1][0] == "ok" and isinstance(got[1][1], dict) else {}
        judge_interface(t, env, "ib0")
        off = [f"{name}={value}" for outcome in got if outcome[0] == "ok" and isinstance(outcome[1], dict)
               for name, value in outcome[1].items() if name in TRANSPORTS and str(value) not in ("0", "")]
        if off:
            t.fail(f"{off[0]} switches a transport off: NCCL_IB_DISABLE=1 moves NCCL's data from InfiniBand onto "
                   "TCP sockets (much slower); these variables rule a transport out while debugging, they do not "
                   "pick an interface", "no *_DISABLE variable", off[0])
    with t.case("node_env('eth0', debug=True) adds NCCL_DEBUG=INFO; debug=False leaves it out",
                hint="NCCL_DEBUG=INFO makes NCCL log how it sets up (interfaces, transports); add it only when debug"):
        if not got:
            t.fail("the first case did not finish")
        on, off = (got[2][1] if got[2][0] == "ok" else {}), (got[3][1] if got[3][0] == "ok" else {})
        if not isinstance(on, dict) or on.get("NCCL_DEBUG") != "INFO":
            t.fail("", "NCCL_DEBUG='INFO' with debug=True", in_words(got[2]))
        if not isinstance(off, dict) or off.get("NCCL_DEBUG") in ("INFO", "TRACE"):
            t.fail("", "no NCCL_DEBUG=INFO with debug=False", in_words(got[3]))
    with t.case("node_env('eth0', True) keeps the interface variables",
                hint="debug adds to the interface variables, it does not replace them", hidden=True):
        on = got[2][1] if got and got[2][0] == "ok" else {}
        if not isinstance(on, dict) or on.get("GLOO_SOCKET_IFNAME") != "eth0" \
                or on.get("NCCL_SOCKET_IFNAME") not in ("eth0", "=eth0"):
            t.fail("", "both *_SOCKET_IFNAME='eth0'", repr(on))
    with t.case("gloo across 2 simulated nodes with your variables: the all_reduce completes",
                hint="without GLOO_SOCKET_IFNAME gloo uses the address of the host name, 127.0.0.1 here, "
                     "which the other node cannot reach"):
        if not all(c.passed for c in t.cases):
            t.fail("not run until the cases above pass: with the wrong variables gloo waits for a connection "
                   "that never comes")
        _run_node_env(t, node_env)


def _run_node_env(t, node_env) -> None:
    from mgpu_lab.cluster.multinode import PROBE_SCRIPT, SimCluster

    with SimCluster(2) as cluster:
        got = t.call(outcomes, node_env, [(cluster.interface,)])[0]
        mine = got[1] if got[0] == "ok" else None
        if not isinstance(mine, dict):
            t.fail("node_env must return a dict", "a dict", in_words(got))
        env = {**{str(k): str(v) for k, v in mine.items() if not t.grading or k in GRADED_ENV},
               "ALLREDUCE_CHECK_TIMEOUT": "3"}
        result, reports = run_commands(cluster, cluster.torchrun(PROBE_SCRIPT, fork=True), env)
        if len(reports) != 2 or not all(r["ok"] for r in reports):
            t.fail(f"on {where(cluster)} with {mine}: {failure_text(result)}", "both ranks: all_reduce sum 3",
                   f"{len(reports)} rank(s) finished; " + result.summary().replace("\n", " "))

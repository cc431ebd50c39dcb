"""Checks of lesson 07 (multi-node): hierarchical_allreduce, torchrun_command, pick_interface.

hierarchical_allreduce runs in 4 real ranks as 2 nodes x 2 (LOCAL_WORLD_SIZE=2), and
torch's flight recorder says what each rank communicated, in which group.
torchrun_command and pick_interface run in fresh processes, every call of a check
in one process, and are judged the way a cluster would judge them: torchrun's own
argument parser reads the commands, and the interface must hold the peer's subnet.
Only an answer that passes those cases is then run for real: one ``torchrun`` per
simulated node (:mod:`mgpu_lab.cluster.multinode`), with a small script that
reports RANK, LOCAL_RANK, WORLD_SIZE and GROUP_RANK and runs an all_reduce; every
run is bounded by a timeout. A wrong command makes torchrun wait rather than fail,
so the wrong answers fail within a second, before any run. Without root (no network
namespaces) the nodes all fall back to 127.0.0.1: the real run still runs, and its
failures are reported, but a run that worked fails all the same (no points), saying it
did not run across interfaces and why.
"""
from __future__ import annotations

import json

from .._core import exercise
from ..sim.outcome import in_words, outcomes
from .judges import (hang_text, hier_expected, judge_budget, judge_leaders, judge_static, node_of, NO_ROUTE,
                     parse_torchrun, pick_hint, PICKS, runnable, two_expected)
from .ranks import failure_text, fast, hier_probe, PG_TIMEOUT, run_commands, TWO_CALLS, two_level_probe, where


# -- hierarchical_allreduce ------------------------------------------------------------
@exercise("07.hierarchical_allreduce", points=3, description="hierarchical_allreduce(tensor): the sum over all "
          "ranks, with only one rank per node (its leader) communicating across nodes; judged on 4 ranks as 2 "
          "nodes x 2 (LOCAL_WORLD_SIZE=2)")
def _hierarchical_allreduce(t, hierarchical_allreduce):
    """One launch of 4 ranks, three calls each; what each rank communicated comes from torch's flight recorder.

    Catches: a flat all_reduce over the world (every rank crosses nodes); nodes taken as rank % LOCAL_WORLD_SIZE
    (a "node" group that spans both nodes); the leaders' all-reduce on the world group; the broadcast
    within the node forgotten (non-leaders keep a partial sum); the reduce within the node forgotten (the
    leaders sum only their own values); broadcast or reduce given the node-local rank 0 where torch wants a
    global rank.
    """
    expected, got = hier_expected(), None
    with t.case("2 nodes x 2 ranks: every rank returns what all_reduce (sum) gives, a tensor of the input's "
                "shape and dtype (float32 (5,), float64 (2, 3), int64 (4,), one call after the other)",
                hint="the result on every rank of every node is the sum of all 4 ranks' tensors"):
        got = t.ranks(hier_probe, 4, hierarchical_allreduce, timeout=HIER_TIMEOUT)
        if any(g["stuck"] for g in got):
            why, got = hang_text(got), None
            t.fail(why, "every rank returns from every call", "a collective that waited in vain")
        for r, g in enumerate(got):
            for call, (res, exp) in enumerate(zip(g["results"], expected)):
                if res != exp:
                    why = _hier_why(r, res, exp, call)
                    right = [q for q in range(4) if node_of(q) == node_of(r) and got[q]["results"][call] == exp]
                    if right and why.endswith("sum over the 4 ranks"):
                        why = (f"rank {right[0]} of the same node holds the right sum but rank {r} does not: the "
                               "result never came back from the node's leader to the other ranks of the node")
                    t.fail(why, f"rank {r}, call {call}: {exp}", f"{res}")
    with t.case("only one rank per node (its leader) communicates across nodes; the other rank talks within its "
                "node only (every collective of every group, from torch's flight recorder, and every send and "
                "receive)",
                hint="a rank that is not its node's leader talks to ranks of its own node only; what the other "
                     "nodes contribute reaches it through its leader"):
        if got is None:
            t.fail("not judged: the first case did not finish")
        judge_leaders(t, got)
    with t.case("the nodes are rank // LOCAL_WORLD_SIZE: every rank combines its values in a group of exactly "
                "its node's ranks (0 and 1 on node 0, 2 and 3 on node 1)",
                hint="torchrun numbers the ranks node after node: node = rank // LOCAL_WORLD_SIZE"):
        if got is None:
            t.fail("not judged: the first case did not finish")
        for r, g in enumerate(got):
            node = [q for q in range(4) if node_of(q) == node_of(r)]
            if not any(ranks is not None and sorted(ranks) == node for _, ranks in g["comm"] + g["p2p"]):
                groups = sorted({tuple(ranks) for _, ranks in g["comm"] + g["p2p"] if ranks is not None})
                t.fail(f"rank {r} took part in no collective of its node, ranks {node}: it communicated in the "
                       f"groups {groups}; nodes are rank // LOCAL_WORLD_SIZE (LOCAL_WORLD_SIZE=2 here), not "
                       "rank % LOCAL_WORLD_SIZE, and a flat all_reduce has no node groups at all",
                       f"a group of ranks {node}", groups)


# Seconds for the 4 ranks' three calls (about 1 s alone); a collective that waits in vain gives up after
# GROUP_TIMEOUT, so this bound is only for an answer stuck outside a collective. Lesson 07's mutant tests judge 4
# answers at once (16 ranks on 2 cores): there the launches took 0.9-14.6 s, and a right answer ran past the
# 20 s this was in 1 of 10 logged idle runs (2026-11-29).
HIER_TIMEOUT = 60.0
# after ranks.GROUP_TIMEOUT and is reported at once: this bounds only what no collective waits on (an endless loop)


def _hier_why(r: int, res, exp, call: int) -> str:
    if res[0] != exp[0] or res[1] != exp[1]:
        return (f"rank {r} returned {res[0]} of shape {res[1]}: a right answer returns the summed tensor, with the "
                "input's shape and dtype")
    own = [q for q in range(4) if node_of(q) == node_of(r)]
    if res[2] == _partial(own, call):
        return (f"rank {r} holds the sum of its own node (ranks {own}) only: the other node's values never reached "
                "it (the all-reduce between the leaders, or the broadcast within the node, is missing)")
    if res[2] == _partial([q for q in range(4) if q % 2 == 0], call):
        return (f"rank {r} holds the sum of the leaders' own tensors only: the values of the other rank of each "
                "node never reached its leader (the reduce within the node is missing)")
    return f"rank {r}'s result differs from all_reduce's sum over the 4 ranks"


def _partial(ranks: list, call: int):
    from .ranks import HIER_CALLS, hier_input

    dtype, shape = HIER_CALLS[call]
    return sum(hier_input(q, dtype, shape) for q in ranks).tolist()


# -- two_level_allreduce --------------------------------------------------------------
TWO_SHAPES = "float32 (1001,), float64 (5, 5), int64 (7,)"
TWO_TIMEOUT = 40.0  # seconds for one launch's five calls (about 2 s); a collective that waits in vain gives up
# after ranks.GROUP_TIMEOUT and ends the calls, so even a hang in every call ends well within it
SUM_HINT = "every rank of every node returns the sum of all ranks' tensors, of the input's shape and dtype"
BUDGET_HINT = {"across": "each rank may send at most 2(N-1)/N x S/L bytes across nodes: every rank's network link "
                         "carries an equal share, and none carries the node's whole sum",
               "within": "each rank may send at most 2(L-1)/L x S bytes within its node: what one all-reduce of the "
                         "whole tensor inside the node costs, and no more"}


@exercise("07.two_level_allreduce", points=8, description="two_level_allreduce(tensor): all_reduce's sum, each rank "
          "sending at most 2(N-1)/N x S/L bytes across nodes and 2(L-1)/L x S within its node; judged on 2 nodes x 2 "
          "and 2 nodes x 3 ranks (LOCAL_WORLD_SIZE), bytes per link from the recorded collectives and their groups")
def _two_level_allreduce(t, two_level_allreduce):
    """Two launches (2 nodes x 2, 2 nodes x 3 ranks), five calls each, every collective and send recorded.

    Catches: a flat all_reduce over the world (every rank sends 2(W-1)/W of the tensor across nodes);
    the hierarchical all-reduce (one rank per node carries the whole sum across, the other links idle;
    the node's reduce and broadcast move the whole tensor twice within the node); shards that lose the
    last elements when L does not divide the size; a tensor made without device= (the last call runs
    with the default device meta); a hang or deadlock, reported within seconds.
    """
    runs = {}
    for per_node in (2, 3):
        with t.case(f"2 nodes x {per_node} ranks: every rank returns what all_reduce (sum) gives, of the input's "
                    f"shape and dtype ({TWO_SHAPES})", hint=SUM_HINT):
            got = t.ranks(two_level_probe, 2 * per_node, two_level_allreduce, per_node, timeout=TWO_TIMEOUT)
            runs[per_node] = got
            judge_sums(t, got, range(3))
    for link in ("across", "within"):
        for per_node in (2, 3):
            with t.case(f"2 nodes x {per_node} ranks: each rank sends at most "
                        + ("2(N-1)/N x S/L bytes across nodes" if link == "across" else "2(L-1)/L x S bytes within "
                           "its node") + " (every collective and send recorded; S padded to a multiple of L x N)",
                        hint=BUDGET_HINT[link]):
                judged(t, runs, per_node, range(3))
                judge_budget(t, runs[per_node], link, per_node, range(3))
    with t.case("2 nodes x 3 ranks, an int64 tensor of 5 elements, fewer than the 6 ranks: the sum, within both "
                "budgets", hint="a tensor smaller than the job is an all-reduce like any other: every rank takes part, and "
                     "the budgets hold, with S padded to a multiple of L x N"):
        judged(t, runs, 3, [3])
        judge_sums(t, runs[3], [3])
        judge_budget(t, runs[3], "across", 3, [3])
        judge_budget(t, runs[3], "within", 3, [3])
    with t.case("every tensor it communicates is on the input's device (a call with torch's default device set to "
                "meta: a tensor made without device= is not on it, as a CPU tensor on a GPU rank)",
                hint="a tensor made without naming a device lands on the default device (the CPU): on a GPU rank "
                     "NCCL refuses it; make every buffer on the input's device"):
        judged(t, runs, 3, [])
        judge_device(t, runs[3], len(TWO_CALLS) - 1)


def judged(t, runs: dict, per_node: int, calls) -> None:
    """Fail the case as not judged when the run of ``per_node`` ranks per node did not finish or got ``calls`` wrong."""
    if per_node not in runs:
        t.fail(f"not judged: the run of 2 nodes x {per_node} ranks did not finish (see the case above)")
    expected = two_expected(2 * per_node)
    for r, entries in enumerate(runs[per_node]):
        for call in calls:
            if call >= len(entries) or entries[call]["error"] or entries[call]["result"][0::3] != expected[call][0::2]:
                t.fail(f"not judged: rank {r}'s result of call {call} is not all_reduce's sum (see the cases "
                       "above); bytes count only for an all-reduce that works")


def judge_sums(t, per_rank: list, calls) -> None:
    """Fail the case unless every rank returned the sum in every call of ``calls``; name errors and hangs."""
    world = len(per_rank)
    expected = two_expected(world)
    for call in calls:
        dtype, shape, _ = TWO_CALLS[call]
        for r, entries in enumerate(per_rank):
            if call >= len(entries):
                t.fail(f"rank {r} never made call {call}: an earlier call failed", "a result", "none")
            entry, want = entries[call], expected[call]
            if entry["error"]:
                t.fail(_error_why(per_rank, call, world), "every rank returns", f"rank {r}: {entry['error']}")
            res = entry["result"]
            if [res[0], res[1]] != want[:2]:
                t.fail(f"rank {r} returned {res[0]} of shape {res[1]} for a {dtype} tensor of shape {list(shape)}: "
                       "return the summed tensor, with the input's shape and dtype", want[:2], res[:2])
            if res[3] != want[2]:
                t.fail(_sum_why(res[3], want[2], r, per_rank, call), f"rank {r}, {dtype} {tuple(shape)}: "
                       f"{want[2]}"[:300], str(res[3])[:300])


def _error_why(per_rank: list, call: int, world: int) -> str:
    stuck = [r for r, e in enumerate(per_rank) if call < len(e) and e[call].get("stuck")]
    if stuck:
        from .ranks import GROUP_TIMEOUT

        return (f"call {call} hangs on ranks {stuck} (each gave up after {GROUP_TIMEOUT:g} s, or every rank waited "
                "in a send or receive no other rank could match): every rank of a group must call the same "
                "collectives on it in the same order, and every send needs its receive")
    return f"your code raised in call {call} of {world} ranks"


def _sum_why(got, want, r: int, per_rank: list, call: int) -> str:
    from .ranks import hier_input

    world = len(per_rank)
    per_node = world // 2
    dtype, shape, _ = TWO_CALLS[call]
    node = [q for q in range(world) if q // per_node == r // per_node]
    flat_got, flat_want = _flat(got), _flat(want)
    own = _flat(hier_input(r, dtype, shape).tolist())
    if flat_got == _flat(sum(hier_input(q, dtype, shape) for q in node).tolist()):
        return (f"rank {r} holds the sum of its own node (ranks {node}) only: the other node's values never "
                "reached it")
    wrong = [i for i, (a, b) in enumerate(zip(flat_got, flat_want)) if a != b]
    if wrong and wrong[0] > 0 and wrong == list(range(wrong[0], len(flat_want))):
        return (f"rank {r}: elements {wrong[0]}..{len(flat_want) - 1} (the last ones) are wrong, the others right: "
                "when L does not divide the tensor's size, the elements past an equal split must be summed too")
    mine = [i for i in wrong if flat_got[i] == own[i]]
    if mine:
        return (f"rank {r} still holds its own input in {len(mine)} of {len(flat_want)} elements (e.g. element "
                f"{mine[0]}): the sums that other ranks of its node worked out never came back to it")
    return f"rank {r}'s result differs from all_reduce's sum over the {world} ranks in {len(wrong)} elements"


def _flat(values) -> list:
    return [v for x in values for v in _flat(x)] if isinstance(values, list) else [values]


def judge_device(t, per_rank: list, call: int) -> None:
    """Fail unless every rank's call ``call`` (default device meta) communicated only tensors on the input's device."""
    expected = two_expected(len(per_rank))[call]
    for r, entries in enumerate(per_rank):
        if call >= len(entries):
            t.fail("not judged: an earlier call failed", "a result", "none")
        entry = entries[call]
        elsewhere = [e for e in entry["events"] if e[4] and e[4] != "cpu"]
        if entry["error"] or elsewhere:
            t.fail("", "every tensor it sends, receives or all-reduces on the input's device (cpu)",
                   f"rank {r}: " + (entry["error"] or f"{elsewhere[0][0]} of a tensor on {elsewhere[0][4]}"))
        if entry["result"][2] != "cpu" or entry["result"][3] != expected[2]:
            t.fail("return the sum on the input's device", "the sum on cpu", f"{entry['result'][:3]}")
        if not entry["events"]:
            t.fail("not judged: the call communicated nothing", "collectives or sends", "none")


# -- torchrun_command ---------------------------------------------------------------
STATIC = ("10.213.7.1", 29517)  # node 0's address and a port that is not torchrun's default (29500)


@exercise("07.torchrun_command", points=2, description="torchrun_command(script, nnodes, nproc_per_node, "
          "node_rank, master_addr, master_port): this node's torchrun argv with static rendezvous, run "
          "for real on 2 simulated nodes", references=("mgpu_lab.cluster.commands:torchrun_commands",))
def _torchrun_command(t, torchrun_command):
    """Judges four calls with torchrun's own parser (one case, every problem named), then runs node 0's and
    node 1's commands for real.

    Catches: a string or non-str items; not starting with torchrun (or python -m
    torch.distributed.run); the script first (the options become its
    arguments); the node rank hard-coded or off by one; nnodes and nproc_per_node
    swapped, or the world size given as either; --master-addr or --master-port
    left out (torchrun's defaults, 127.0.0.1:29500); --standalone or c10d instead
    of static rendezvous. The real run (2 nodes x 2 processes, only once the
    other case passes) adds --start-method=fork --run-path to the commands: the
    same job, started seconds faster.
    """
    from mgpu_lab.cluster.multinode import PROBE_SCRIPT

    script = str(PROBE_SCRIPT)
    other = ("train.py", 4, 8, 3, "node0", 29400)
    hidden = ("/home/me/a.py", 16, 1, 15, "10.0.0.1", 1234)
    calls = [(script, 2, 2, 0, *STATIC), (script, 2, 2, 1, *STATIC), other, hidden]
    with t.case(f"torchrun reads each command as its job: node 0 and node 1 of 2 nodes x 2 processes with static "
                f"rendezvous at {STATIC[0]}:{STATIC[1]} (the script last), and two other jobs (one hidden)",
                hint="each number of the job in the option torchrun reads it from, static rendezvous at node 0's "
                     "address and port, and the script last"):
        got = t.call(outcomes, torchrun_command, calls)
        problems = [p for i, (args, outcome) in enumerate(zip(calls, got))
                    if (p := _read_wrong(t, args, outcome, i))]
        if problems:
            t.fail(" | ".join(problems), "commands torchrun reads as these jobs", f"{len(problems)} of 4 read wrong")
    with t.case("run for real on 2 simulated nodes: RANK 0..3, LOCAL_RANK 0..1, GROUP_RANK = node, WORLD_SIZE 4, "
                "all_reduce sum 10 on every rank", hint="the commands must start one job of 2 nodes x 2 processes"):
        if not all(c.passed for c in t.cases):
            t.fail("not run until the cases above pass: a wrong command makes torchrun wait, not fail")
        _run_static(t, torchrun_command, script)


def _read_wrong(t, args: tuple, outcome, i: int) -> str:
    """What is wrong with call ``i``'s command, in words ("" when torchrun reads it as the job ``args``)."""
    from .._core import CaseFailed

    hints = ["", "node 1's command must tell torchrun it is node 1: with another node rank both nodes claim the "
             "same place in the job"] + ["use each argument where it belongs: --nnodes counts machines, "
                                         "--nproc-per-node the processes on each"] * 2
    parsed, why = parse_torchrun(outcome[1]) if outcome[0] == "ok" else (None, in_words(outcome))
    if parsed is None:
        said = f"{why}: torchrun reads a list of strings (an argv): the launcher, its options, the script"
        return said if i < 3 else "another job (hidden): " + said
    said = []
    if i < 2 and (parsed.standalone or parsed.rdzv_backend != "static" or parsed.rdzv_endpoint):
        said.append(f"node {i}: static rendezvous is torchrun's default; --standalone starts a one-node job of its "
                    f"own on each node, and c10d would ignore --node-rank (standalone={parsed.standalone}, "
                    f"rdzv_backend={parsed.rdzv_backend!r}, rdzv_endpoint={parsed.rdzv_endpoint!r})")
    try:
        judge_static(t, parsed, *args, hints[i])
    except CaseFailed as failed:
        said.append(failed.hint if i < 3 else "another job (hidden) is read wrong: " + hints[i])
    return "; ".join(said)


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
        judge_across(t, cluster, "that node 1's torchrun reaches node 0's store at --master-addr across the "
                                 "network and the 4 ranks form one job")


NOT_ACROSS = "not run across interfaces here"  # the words of a real run that could only use 127.0.0.1


def judge_across(t, cluster, proves: str) -> None:
    """After a real run that worked: fail (no points) when the nodes were not network namespaces, every one on
    127.0.0.1, saying so, why, and what the run would prove where it can cross interfaces."""
    if not cluster.isolated:
        t.fail(f"{NOT_ACROSS}: {cluster.reason}. The simulated nodes get interfaces and addresses of their own only "
               "in network namespaces, which need root (CAP_NET_ADMIN); here every node was on 127.0.0.1, where "
               f"this worked but proves nothing about crossing machines. As root this case proves {proves}, and "
               "awards its point", "2 nodes in network namespaces, joined on eth0", "every node on 127.0.0.1")


# A grader runs these commands as root outside the submission's sandbox: only what the cases judged.
GRADED_ENV = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_DEBUG", "NCCL_DEBUG_SUBSYS")


# -- pick_interface ---------------------------------------------------------------------
@exercise("07.pick_interface", points=3, description="pick_interface(addrs, peer): from `ip -j addr` output, the "
          "interface whose subnet holds the peer's address (the most specific one); ValueError naming the "
          "interfaces when none does")
def _pick_interface(t, pick_interface):
    """Judges six calls made in one process, then, once they pass, gloo across 2 simulated nodes.

    Catches: the first interface (loopback) or the first with an IPv4 address; the text's leading digits
    compared instead of the subnet; the first subnet that holds the peer instead of the most specific one;
    IPv6 ignored (or compared with IPv4 subnets); no ValueError, or one that names no interface, when no
    subnet holds the peer. The real run takes `ip -j addr` inside node 0, node 1's address as the peer, and
    runs gloo across the nodes with GLOO_SOCKET_IFNAME set to the answer.
    """
    calls = [(addrs, peer) for _, addrs, peer, _, _ in PICKS] + [(NO_ROUTE[1], NO_ROUTE[0])]
    got = None
    with t.case("the interface whose subnet holds the peer, the most specific one: " + "; ".join(
            name for name, *_ in PICKS), hint="the interface whose subnet (its address and prefix length) holds the "
                                               "peer's address, the longest prefix where several do"):
        got = t.call(outcomes, pick_interface, calls)
        wrong = [(pick_hint(expected, got[i], peer, addrs) + "; " + hint, expected, in_words(got[i]))
                 for i, (name, addrs, peer, expected, hint) in enumerate(PICKS) if got[i] != ("ok", expected)]
        if wrong:
            t.fail(" | ".join(w[0] for w in wrong), ", ".join(w[1] for w in wrong), ", ".join(w[2] for w in wrong))
    with t.case("no subnet holds 192.168.9.9: ValueError that names the interfaces it looked at",
                hint="when no interface's subnet holds the peer, say so with the interfaces there are: the cluster "
                     "network is missing or the peer's address is wrong"):
        if got is None:
            t.fail("not judged: the first case did not finish")
        outcome = got[-1]
        if outcome[0] != "raised" or outcome[1] != "ValueError":
            t.fail("", "ValueError", in_words(outcome))
        missing = [n for n in ("eth0", "ib0", "docker0") if n not in outcome[2]]
        if missing:
            t.fail(f"the message names no {missing[0]}: name the interfaces (and their subnets) so that the reader "
                   "sees which network is missing", "a message naming eth0, docker0, ib0, ...", outcome[2])
    with t.case("gloo across 2 simulated nodes with GLOO_SOCKET_IFNAME = your pick from node 0's `ip -j addr` "
                "and node 1's address: the all_reduce completes",
                hint="without the right interface gloo uses the address of the host name, 127.0.0.1 here"):
        if not all(c.passed for c in t.cases):
            t.fail("not run until the cases above pass: with the wrong interface gloo waits for a connection "
                   "that never comes")
        _run_pick(t, pick_interface)


def _run_pick(t, pick_interface) -> None:
    from mgpu_lab.cluster.commands import torchrun_commands
    from mgpu_lab.cluster.multinode import PROBE_SCRIPT, SimCluster

    with SimCluster(2) as cluster:
        seen = cluster.run([["ip", "-j", "addr"], ["ip", "-j", "addr"]], timeout=30, echo=False)
        addrs = json.loads("".join(seen.nodes[0].lines) or "[]")
        peer = cluster.nodes[1].addr
        got = t.call(outcomes, pick_interface, [(addrs, peer)])[0]
        if got[0] != "ok" or not isinstance(got[1], str):
            t.fail(f"on node 0 of {where(cluster)}, peer {peer}", cluster.interface, in_words(got))
        env = {"GLOO_SOCKET_IFNAME": got[1], "ALLREDUCE_CHECK_TIMEOUT": "3"}
        result, reports = run_commands(cluster, torchrun_commands(cluster, PROBE_SCRIPT, fork=True), env)
        if len(reports) != 2 or not all(r["ok"] for r in reports):
            t.fail(f"on {where(cluster)} with GLOO_SOCKET_IFNAME={got[1]}: {failure_text(result)}",
                   "both ranks: all_reduce sum 3", f"{len(reports)} rank(s) finished; "
                   + result.summary().replace("\n", " "))
        judge_across(t, cluster, "that the interface you picked from node 0's own `ip -j addr` is the one gloo "
                                 "needs to reach node 1")

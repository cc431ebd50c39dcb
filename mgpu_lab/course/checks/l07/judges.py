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


# -- hierarchical_allreduce ------------------------------------------------------------
def hier_expected() -> list:
    """``[dtype, shape, values]`` of every call of the check: the sum over the 4 ranks, as all_reduce gives it."""
    from .ranks import HIER_CALLS, hier_input

    out = []
    for dtype, shape in HIER_CALLS:
        total = sum(hier_input(r, dtype, shape) for r in range(4))
        out.append([str(total.dtype), list(shape), total.tolist()])
    return out


def hang_text(got: list) -> str:
    """What a hang looked like: where each rank's last collective was when it gave up, or that it returned."""
    from .ranks import GROUP_TIMEOUT

    call = min(g["stuck"][0] for g in got if g["stuck"])
    where = []
    for r, g in enumerate(got):
        if not g["stuck"]:
            where.append(f"rank {r} returned")
        elif g["comm"]:
            op, ranks = g["comm"][-1]
            where.append(f"rank {r}'s last collective: {op} over ranks {ranks}")
        else:
            where.append(f"rank {r} never got into a collective")
    return (f"your code hangs in call {call}: " + "; ".join(where) + f" (each gave up after waiting "
            f"{GROUP_TIMEOUT:g} s). Every rank of a group must call the same collectives on it in the same "
            "order: a rank that calls another collective, or uses another group, waits forever")


def node_of(rank: int) -> int:
    from .ranks import PER_NODE

    return rank // PER_NODE


def crossing(comm: list) -> list:
    """The entries of one rank's communication whose group spans more than one node (or is unknown)."""
    return [(op, ranks) for op, ranks in comm if ranks is None or len({node_of(r) for r in ranks}) > 1]


def judge_leaders(t, got: list) -> None:
    """At most one rank per node communicates across nodes, and every group that crosses nodes holds one per node."""
    talkers = {r: crossing(g["comm"] + g["p2p"]) for r, g in enumerate(got) if crossing(g["comm"] + g["p2p"])}
    for node in sorted({node_of(r) for r in range(len(got))}):
        mine = [r for r in talkers if node_of(r) == node]
        if len(mine) > 1:
            r = mine[-1]
            t.fail(f"ranks {mine} of node {node} all communicate across nodes, e.g. rank {r}: "
                   f"{talkers[r][0][0]} in the group of ranks {talkers[r][0][1]}. A right answer gathers a "
                   "node's values on one rank of that node, and only those leaders talk to the other nodes",
                   "one rank per node in communication that crosses nodes",
                   "; ".join(f"rank {q}: {talkers[q][:3]}" for q in mine))
    for r, entries in talkers.items():
        for op, ranks in entries:
            if ranks is None or len({node_of(q) for q in ranks}) != len(ranks):
                t.fail(f"rank {r}'s {op} crossed nodes in the group of ranks {ranks}, which holds more than one "
                       "rank of a node: the group between the nodes holds one leader per node",
                       "groups across nodes of one rank per node", f"{op} in {ranks}")
    if not talkers:
        t.fail("no rank communicated across nodes, so no node learned the other's values",
               "each node's leader in a collective across nodes", "none")


# -- pick_interface ----------------------------------------------------------------------
def iface(name: str, *addrs: str, up: bool = True) -> dict:
    """One entry of ``ip -j addr``: ``addrs`` as ``"10.0.0.2/24"`` (IPv4 or IPv6)."""
    info = [{"family": "inet6" if ":" in a else "inet", "local": a.split("/")[0], "prefixlen": int(a.split("/")[1]),
             "scope": "host" if a.startswith(("127.", "::1")) else "global", "valid_life_time": 4294967295,
             "preferred_life_time": 4294967295} for a in addrs]
    flags = ["BROADCAST", "MULTICAST", "UP", "LOWER_UP"] if up else ["BROADCAST"]
    return {"ifindex": 1, "ifname": name, "flags": flags,
            "mtu": 1500, "operstate": "UP" if up else "DOWN", "link_type": "ether", "address": "02:00:00:00:00:01",
            "addr_info": info}


LO = iface("lo", "127.0.0.1/8", "::1/128")
NODE = [LO, iface("eth0", "10.1.0.5/24", "fe80::1/64"), iface("docker0", "172.17.0.1/16"),
        iface("ib0", "10.2.0.5/16", "fd00:2::5/64"), iface("eno2", up=False)]

PICKS = [  # (name, addrs, peer, expected interface, hint)
    ("eth0 10.1.0.5/24, docker0 172.17.0.1/16, ib0 10.2.0.5/16, lo: peer 10.1.0.7 is on eth0's subnet",
     NODE, "10.1.0.7", "eth0", "the interface whose subnet (its address and prefix length) holds the peer's address"),
    ("peer 10.2.200.9: on ib0's /16, not eth0's /24 (10.1.0.0-10.1.0.255), though both begin with 10.",
     NODE, "10.2.200.9", "ib0", "a subnet is the address with its prefix length: compare the network, not the "
     "leading digits of the text"),
    ("overlapping subnets, eth0 10.0.0.2/8 and ib0 10.7.0.2/16: peer 10.7.1.1 goes to ib0, the most specific, as "
     "the kernel routes it", [LO, iface("eth0", "10.0.0.2/8"), iface("ib0", "10.7.0.2/16")], "10.7.1.1", "ib0",
     "where several subnets hold the peer, the kernel sends through the longest prefix (the smallest subnet)"),
    ("an IPv6 peer fd00:2::9: ib0, whose fd00:2::5/64 holds it", NODE, "fd00:2::9", "ib0",
     "IPv6 addresses too: compare the peer with the subnets of its own family"),
]
NO_ROUTE = ("192.168.9.9", NODE)  # no subnet of NODE holds it


def pick_hint(expected: str, outcome, peer: str, addrs: list) -> str:
    """What a wrong pick did, in words."""
    if outcome[0] == "raised":
        return f"your function raised {outcome[1]} for peer {peer}, whose subnet is on {expected}"
    got = outcome[1]
    names = [a["ifname"] for a in addrs]
    if got == names[0]:
        return f"you returned the first interface, {got}: loopback carries nothing between nodes"
    if got not in names:
        return f"{got!r} is not an interface name of the input (the 'ifname' of an entry)"
    return f"{got} does not hold {peer} in its subnet as tightly as {expected}"


# -- two_level_allreduce ------------------------------------------------------------------
def two_expected(world: int) -> list:
    """``[dtype, shape, values]`` of every call of :data:`.ranks.TWO_CALLS`: the sum over ``world`` ranks."""
    from .ranks import TWO_CALLS, hier_input

    out = []
    for dtype, shape, _ in TWO_CALLS:
        total = sum(hier_input(r, dtype, shape) for r in range(world))
        out.append([str(total.dtype), list(shape), total.tolist()])
    return out


def budgets(numel: int, element_size: int, per_node: int, nodes: int) -> tuple:
    """``(across, within, padded bytes)``: what one rank may send across nodes and within its node.

    S is the tensor's bytes padded to a multiple of ``per_node * nodes`` elements (the slack: fewer than
    that many elements), and the budgets are ``2 (N - 1) / N * S / L`` and ``2 (L - 1) / L * S``.

    Example:
        >>> budgets(1001, 4, 3, 2)   # 1001 float32 padded to 1002: 4008 bytes
        (1336.0, 5344.0, 4008)
    """
    group = per_node * nodes
    padded = -(-numel // group) * group * element_size
    return 2 * (nodes - 1) / nodes * padded / per_node, 2 * (per_node - 1) / per_node * padded, padded


def sent_by_link(events: list, rank: int, per_node: int) -> dict:
    """What one rank sent in one call, by link: ``{"across": bytes, "within": bytes, "ops": [...]}``.

    A collective over a group of g ranks and B bytes (the whole tensor) costs each rank what a ring
    sends: ``2 (g - 1) / g * B`` for all_reduce, ``(g - 1) / g * B`` for reduce_scatter, all_gather and
    all_to_all, ``B`` for broadcast, reduce and anything else; a send costs its bytes, a receive
    nothing. It crosses nodes when its group (a send: this rank and the peer) holds ranks of more
    than one node, or when its group is unknown.

    Example:
        >>> got = sent_by_link([["all_reduce", 400, [0, 2], None, "cpu"], ["send", 40, None, 1, "cpu"]], 0, 2)
        >>> got["across"], got["within"]
        (400.0, 40.0)
    """
    from mgpu_lab.comm.cost_model import bus_factor

    out = {"across": 0.0, "within": 0.0, "ops": []}
    for op, nbytes, ranks, peer, _ in events:
        if op == "recv":
            continue
        group = ([rank, peer] if peer is not None else None) if op == "send" else ranks
        if op == "send":
            sent = float(nbytes)
        elif op == "barrier" or group is None:
            sent = float(nbytes)
        elif op == "all_to_all":
            sent = (len(group) - 1) / len(group) * nbytes
        else:
            try:
                sent = bus_factor(op, len(group)) * nbytes
            except ValueError:
                sent = float(nbytes)
        link = "within" if group is not None and len({q // per_node for q in group}) == 1 else "across"
        out[link] += sent
        out["ops"].append((link, op, group, round(sent, 1)))
    return out


def _in_words(ops: list, link: str) -> str:
    shown = [f"{op} over ranks {group}: {sent:g} B" for where, op, group, sent in ops if where == link]
    return "; ".join(shown[:4]) + (f"; ... ({len(shown)} in all)" if len(shown) > 4 else "") or "nothing"


def judge_budget(t, per_rank: list, link: str, per_node: int, calls: range) -> None:
    """Fail the case when a rank sent more than its budget on ``link`` ("across" or "within") in one of ``calls``."""
    import torch

    from .ranks import TWO_CALLS

    world = len(per_rank)
    nodes = world // per_node
    for call in calls:
        dtype, shape, _ = TWO_CALLS[call]
        numel = int(torch.Size(shape).numel())
        across, within, padded = budgets(numel, getattr(torch, dtype).itemsize, per_node, nodes)
        limit = across if link == "across" else within
        sent = [sent_by_link(calls_[call]["events"], r, per_node) for r, calls_ in enumerate(per_rank)]
        worst = max(range(world), key=lambda r: sent[r][link])
        if sent[worst][link] > limit + 1e-6:
            t.fail(_over_why(sent, worst, link, per_node, numel * getattr(torch, dtype).itemsize, limit),
                   f"at most {limit:g} bytes {link} per rank ({dtype} {tuple(shape)}: S = {padded} bytes padded)",
                   f"rank {worst}: {sent[worst][link]:g} bytes: {_in_words(sent[worst]['ops'], link)}")


def _over_why(sent: list, worst: int, link: str, per_node: int, size: int, limit: float) -> str:
    """Why one rank went over its budget, naming the known designs."""
    node = [q for q in range(len(sent)) if q // per_node == worst // per_node]
    idle = [q for q in node if sent[q]["across"] == 0]
    if link == "across" and idle:
        return (f"rank {worst} sent {sent[worst]['across']:g} bytes across nodes while ranks {idle} of its node sent "
                f"nothing across: one rank carries what the node has to send and the other links stay idle. "
                f"Every rank has a link to the network; each may send {limit:g} bytes across here")
    mixed = [(op, group) for on, op, group, b in sent[worst]["ops"] if on == "across" and group is not None
             and len(group) == per_node and op != "send"]
    if link == "across" and mixed:
        return (f"rank {worst}'s {mixed[0][0]} ran in the group of ranks {mixed[0][1]}, as many ranks as a node has "
                "but from several nodes: torchrun numbers ranks node after node, node = rank // LOCAL_WORLD_SIZE, "
                "not rank % LOCAL_WORLD_SIZE")
    where = "across nodes" if link == "across" else "within its node"
    whole = [op for on, op, group, b in sent[worst]["ops"] if on == link and b >= size * 0.99]
    if whole:
        return (f"rank {worst}'s {whole[0]} sent the whole tensor's worth ({size} bytes) or more {where}, and its "
                f"budget {where} is {limit:g} bytes here: no rank can afford to move the whole tensor that way")
    return (f"rank {worst} sent {sent[worst][link]:g} bytes {where}, more than its budget of {limit:g}: "
            "count what each of your collectives sends per rank with the ring costs above")

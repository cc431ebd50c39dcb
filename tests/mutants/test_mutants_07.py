"""Lesson 07's checks against named wrong answers made from the solution, and correct variants.

Every mutant is a solution cell of ``solutions/07_multi_node.ipynb`` with one
learner bug put in; its check must fail with a message that names the bug, and
it fails before any torchrun starts (the real runs come only after every other
case passes). Every variant is a correct answer written differently; it must
get full marks, real torchrun runs on simulated nodes included.
"""
from __future__ import annotations

import pytest

from mutation import ExerciseMutants, Mutant, Variant, drop_statement, mutant_tests, replace

pytestmark = pytest.mark.timeout(400)
NOTEBOOK = "07_multi_node.ipynb"
NAMESPACE: dict = {}
exec("import json, os\nimport torch\nimport torch.distributed as dist\n", NAMESPACE)  # the notebook's first cell

HIER = ExerciseMutants("07.hierarchical_allreduce", NOTEBOOK, ("hierarchical_allreduce",), mutants=[
    Mutant("a flat all_reduce over every rank",
           replace("    dist.reduce(tensor, dst=leader, group=node_groups[node])\n    if rank == leader:\n"
                   "        dist.all_reduce(tensor, group=leaders)\n"
                   "    dist.broadcast(tensor, src=leader, group=node_groups[node])\n",
                   "    dist.all_reduce(tensor)\n"),
           ("all communicate across nodes", "only those leaders talk to the other nodes")),
    Mutant("nodes as rank % LOCAL_WORLD_SIZE",
           (replace("node, nodes = rank // per_node, world // per_node",
                    "node, nodes = rank % per_node, world // per_node"),
            replace("list(range(n * per_node, (n + 1) * per_node))", "list(range(n, world, per_node))"),
            replace("leaders = dist.new_group([n * per_node for n in range(nodes)])",
                    "leaders = dist.new_group(list(range(nodes)))"),
            replace("leader = node * per_node", "leader = node")),
           ("not rank % local_world_size", "all communicate across nodes")),
    Mutant("the leaders' all-reduce on the world group",
           replace("dist.all_reduce(tensor, group=leaders)", "dist.all_reduce(tensor)"),
           "hangs"),
    Mutant("the broadcast within the node forgotten",
           drop_statement("dist.broadcast(tensor, src=leader"), "never came back from the node's leader"),
    Mutant("the reduce within the node forgotten",
           drop_statement("dist.reduce(tensor, dst=leader"), "the reduce within the node is missing"),
    Mutant("the node-local rank 0 given where torch wants a global rank",
           (replace("dist.reduce(tensor, dst=leader,", "dist.reduce(tensor, dst=0,"),
            replace("dist.broadcast(tensor, src=leader,", "dist.broadcast(tensor, src=0,")),
           "your code raised"),
    Mutant("the non-leaders return a fresh tensor, not the one the broadcast filled",
           replace("    return tensor\n",
                   "    return tensor.clone() if rank == leader else torch.zeros_like(tensor)\n"),
           "never came back"),
], variants=[
    Variant("all_reduce inside the node, group_src, the last rank of a node leads, groups made once", """
_groups = {}


def hierarchical_allreduce(tensor):
    n = int(os.environ["LOCAL_WORLD_SIZE"])
    world, rank = dist.get_world_size(), dist.get_rank()
    if n not in _groups:
        nodes = [dist.new_group(list(range(first, first + n))) for first in range(0, world, n)]
        _groups[n] = (nodes, dist.new_group([first + n - 1 for first in range(0, world, n)]))
    nodes, heads = _groups[n]
    mine = nodes[rank // n]
    out = tensor.clone()
    dist.all_reduce(out, group=mine)
    if rank % n == n - 1:
        dist.all_reduce(out, group=heads)
    dist.broadcast(out, group=mine, group_src=n - 1)
    return out
"""),
    Variant("new_subgroups_by_enumeration for the nodes, reduce with group_dst", """
def hierarchical_allreduce(tensor):
    per = int(os.environ["LOCAL_WORLD_SIZE"])
    world = dist.get_world_size()
    mine, _ = dist.new_subgroups_by_enumeration([list(range(s, s + per)) for s in range(0, world, per)])
    leaders = dist.new_group(list(range(0, world, per)))
    dist.reduce(tensor, group=mine, group_dst=0)
    if dist.get_rank() % per == 0:
        dist.all_reduce(tensor, group=leaders)
    dist.broadcast(tensor, group=mine, group_src=0)
    return tensor
"""),
])

BODY = ("    dist.reduce_scatter_single(mine, padded, group=node_groups[node])\n"
        "    dist.all_reduce(mine, group=rails[local])\n"
        "    dist.all_gather_single(padded, mine, group=node_groups[node])\n")
TWO = ExerciseMutants("07.two_level_allreduce", NOTEBOOK, ("two_level_allreduce",), mutants=[
    Mutant("the hierarchical design: one leader per node crosses the network",
           replace(BODY, "    dist.reduce(padded, dst=node * per_node, group=node_groups[node])\n"
                         "    if local == 0:\n        dist.all_reduce(padded, group=rails[0])\n"
                         "    dist.broadcast(padded, src=node * per_node, group=node_groups[node])\n"),
           ("sent nothing across", "other links stay idle")),
    Mutant("a flat all_reduce over every rank", replace(BODY, "    dist.all_reduce(padded)\n"),
           "no rank can afford to move the whole tensor"),
    Mutant("nodes as rank % LOCAL_WORLD_SIZE",
           (replace("nodes, node, local = world // per_node, rank // per_node, rank % per_node",
                    "nodes, node, local = world // per_node, rank % per_node, rank // per_node"),
            replace("[dist.new_group(list(range(n * per_node, (n + 1) * per_node))) for n in range(nodes)]",
                    "[dist.new_group(list(range(n, world, per_node))) for n in range(per_node)]"),
            replace("[dist.new_group(list(range(i, world, per_node))) for i in range(per_node)]",
                    "[dist.new_group(list(range(i * per_node, (i + 1) * per_node))) for i in range(nodes)]")),
           "not rank % local_world_size"),
    Mutant("floor-sized pieces: the elements past an equal split keep this rank's own value",
           (replace("piece = -(-flat.numel() // per_node)", "piece = flat.numel() // per_node"),
            replace("padded[:flat.numel()] = flat", "padded[:] = flat[:padded.numel()]"),
            replace("return padded[:flat.numel()].reshape(tensor.shape)",
                    "return torch.cat([padded, flat[padded.numel():]]).reshape(tensor.shape)")),
           "the last ones"),
    Mutant("the step between the nodes left out", drop_statement("dist.all_reduce(mine"),
           "the other node's values never reached it"),
    Mutant("the pieces never gathered back within the node", drop_statement("dist.all_gather_single("),
           "never came back to it"),
    Mutant("a buffer made without device= (a CPU tensor on a GPU rank)",
           replace("padded = torch.zeros(piece * per_node, dtype=tensor.dtype, device=tensor.device)",
                   "padded = torch.zeros(piece * per_node, dtype=tensor.dtype)"),
           "input's device"),
    Mutant("the flat tensor returned, not the input's shape",
           replace("return padded[:flat.numel()].reshape(tensor.shape)", "return padded[:flat.numel()]"),
           "the input's shape"),
], variants=[
    Variant("all_to_all to share out the pieces, groups made once by new_subgroups_by_enumeration", """
_made = {}


def two_level_allreduce(tensor):
    L = int(os.environ["LOCAL_WORLD_SIZE"])
    W, me = dist.get_world_size(), dist.get_rank()
    if L not in _made:
        node, _ = dist.new_subgroups_by_enumeration([list(range(s, s + L)) for s in range(0, W, L)])
        across, _ = dist.new_subgroups_by_enumeration([list(range(i, W, L)) for i in range(L)])
        _made[L] = (node, across)
    node, across = _made[L]
    n = tensor.numel()
    k = (n + L - 1) // L
    buf = tensor.new_zeros(k * L)
    buf[:n] = tensor.flatten()
    got = torch.empty_like(buf)
    dist.all_to_all_single(got, buf, group=node)
    piece = got.view(L, k).sum(0)
    dist.all_reduce(piece, group=across)
    out = [torch.empty_like(piece) for _ in range(L)]
    dist.all_gather(out, piece, group=node)
    return torch.cat(out)[:n].view_as(tensor)
"""),
    Variant("list forms of reduce_scatter and all_gather, pieces padded to a multiple of L x N", """
def two_level_allreduce(tensor):
    per = int(os.environ["LOCAL_WORLD_SIZE"])
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = {}
    for first in range(0, world, per):
        groups[("node", first // per)] = dist.new_group(list(range(first, first + per)))
    for lr in range(per):
        groups[("rail", lr)] = dist.new_group(list(range(lr, world, per)))
    mine_node, mine_rail = groups[("node", rank // per)], groups[("rail", rank % per)]
    x = tensor.reshape(-1)
    step = world
    total = (x.numel() + step - 1) // step * step
    x = torch.cat([x, torch.zeros(total - x.numel(), dtype=x.dtype, device=x.device)])
    parts = list(x.chunk(per))
    piece = torch.zeros_like(parts[0])
    dist.reduce_scatter(piece, parts, group=mine_node)
    dist.all_reduce(piece, group=mine_rail)
    pieces = [torch.zeros_like(piece) for _ in parts]
    dist.all_gather(pieces, piece, group=mine_node)
    return torch.cat(pieces)[:tensor.numel()].reshape(tensor.shape)
"""),
])

TORCHRUN = ExerciseMutants("07.torchrun_command", NOTEBOOK, ("torchrun_command",), mutants=[
    Mutant("node rank hard-coded to 0", replace('f"--node-rank={node_rank}"', '"--node-rank=0"'),
           ("claim the same place in the job", "not run until the cases above pass")),
    Mutant("node rank off by one", replace("--node-rank={node_rank}", "--node-rank={node_rank + 1}"),
           "--node-rank=0 (got 1)"),
    Mutant("nnodes and nproc_per_node swapped",
           (replace("--nnodes={nnodes}", "--nnodes={nproc_per_node}"),
            replace("--nproc-per-node={nproc_per_node}", "--nproc-per-node={nnodes}")),
           ("--nnodes=4 (got '8')", "use each argument where it belongs")),
    Mutant("--nnodes given the world size", replace("--nnodes={nnodes}", "--nnodes={nnodes * nproc_per_node}"),
           "--nnodes counts machines"),
    Mutant("--master-port left out", replace(', f"--master-port={master_port}"', ""),
           "--master-port=29517 (left out: torchrun then uses 29500)"),
    Mutant("--master-addr left out", replace('f"--master-addr={master_addr}", ', ""),
           "--master-addr=10.213.7.1 (got '127.0.0.1', torchrun's default"),
    Mutant("--standalone added", replace('["torchrun", ', '["torchrun", "--standalone", '),
           "--standalone starts a one-node job"),
    Mutant("c10d rendezvous instead of static",
           replace('f"--master-addr={master_addr}", f"--master-port={master_port}"',
                   '"--rdzv-backend=c10d", f"--rdzv-endpoint={master_addr}:{master_port}"'),
           ("static rendezvous", "rdzv_backend='c10d'")),
    Mutant("script before the options", (replace('["torchrun", ', '["torchrun", script, '), replace(", script]", "]")),
           "the script"),
    Mutant("one string instead of a list", (replace("return [", 'return " ".join(['), replace("script]", "script])")),
           "return a list of strings"),
], variants=[
    Variant("options and values as separate items, underscores", '''
def torchrun_command(script, nnodes, nproc_per_node, node_rank, master_addr, master_port):
    argv = ["torchrun"]
    for option, value in (("--nnodes", nnodes), ("--nproc_per_node", nproc_per_node), ("--node_rank", node_rank),
                          ("--master_addr", master_addr), ("--master_port", master_port)):
        argv += [option, str(value)]
    return argv + [str(script)]
'''),
    Variant("python -m torch.distributed.run, static rendezvous named, no restarts", '''
import sys

def torchrun_command(script, nnodes, nproc_per_node, node_rank, master_addr, master_port):
    return [sys.executable, "-m", "torch.distributed.run", "--rdzv-backend=static", f"--nnodes={nnodes}:{nnodes}",
            f"--nproc-per-node={nproc_per_node}", f"--node-rank={node_rank}", "--max-restarts=0",
            f"--master-addr={master_addr}", f"--master-port={master_port}", script]
'''),
])

PICK = ExerciseMutants("07.pick_interface", NOTEBOOK, ("pick_interface",), mutants=[
    Mutant("the first subnet that holds the peer, not the most specific",
           replace("(best is None or net.prefixlen > best[0])", "best is None"), "longest prefix"),
    Mutant("the leading digits of the text compared instead of the subnet",
           replace("target in net", "peer.split('.')[0] == info['local'].split('.')[0]"),
           ("ib0", "compare the network")),
    Mutant("IPv4 only", replace("net.version == target.version and", "net.version == 4 and"), "ipv6"),
    Mutant("no ValueError when no subnet holds the peer",
           replace("        raise ValueError(", "        return None\n        raise ValueError("), "valueerror"),
    Mutant("a ValueError that names no interface",
           replace("{', '.join(seen) or 'no addresses at all'}", "check the network"), "name the interfaces"),
    Mutant("the first interface returned (loopback)",
           replace("    return best[1]\n", "    return addrs[0]['ifname']\n"),
           "loopback carries nothing between nodes"),
], variants=[
    Variant("ip_network(strict=False), sorted by prefix length", """
import ipaddress

def pick_interface(addrs, peer):
    ip = ipaddress.ip_address(peer)
    found = []
    for a in addrs:
        for i in a.get("addr_info") or []:
            net = ipaddress.ip_network(f"{i['local']}/{i['prefixlen']}", strict=False)
            if ip.version == net.version and ip in net:
                found.append((net.prefixlen, a["ifname"]))
    if not found:
        names = [a["ifname"] for a in addrs]
        raise ValueError(f"{peer} is on none of the subnets of {names}")
    return sorted(found)[-1][1]
"""),
    Variant("integer arithmetic on the address bits", """
import ipaddress

def pick_interface(addrs, peer):
    p = ipaddress.ip_address(peer)
    best, best_len = None, -1
    for entry in addrs:
        for info in entry.get("addr_info", []):
            local = ipaddress.ip_address(info["local"])
            if local.version != p.version:
                continue
            bits = local.max_prefixlen
            mask = ((1 << info["prefixlen"]) - 1) << (bits - info["prefixlen"])
            if int(local) & mask == int(p) & mask and info["prefixlen"] > best_len:
                best, best_len = entry["ifname"], info["prefixlen"]
    if best is None:
        raise ValueError("no route to " + peer + " from " + ", ".join(e["ifname"] for e in addrs))
    return best
"""),
])

def not_across_here() -> str:
    """Without network namespaces (no root: CI's user part) the real runs cannot cross interfaces, and the
    check says so in their cases, unpaid; as root a variant must earn them."""
    from mgpu_lab.cluster import netns
    from mgpu_lab.course.checks.l07.checkers import NOT_ACROSS

    return NOT_ACROSS if netns.problem() else ""


TORCHRUN.unpaid_here = PICK.unpaid_here = not_across_here
SPECS = [HIER, TWO, TORCHRUN, PICK]


def no_torchrun_started(mutant, result):
    """A mutant that fails the quick cases must not start torchrun: the real runs wait for them."""
    real = [c for c in result.cases if c.name.startswith(("run for real", "gloo across"))]
    if mutant in HIER.mutants or mutant in TWO.mutants:
        return
    assert all("not run until the cases above pass" in c.hint for c in real), str(result)


test_mutant_fails_naming_its_bug, test_correct_variant_passes, test_every_exercise_has_five_mutants_and_two_variants = \
    mutant_tests(SPECS, "07", NAMESPACE, after=no_torchrun_started, at_once=4)

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

GLOBAL_RANK = ExerciseMutants("07.global_rank", NOTEBOOK, ("global_rank",), mutants=[
    Mutant("node and local rank swapped",
           replace("return node_rank * nproc_per_node + local_rank", "return local_rank * nproc_per_node + node_rank"),
           ("global_rank(1, 3, 4) == 7", "node_rank * nproc_per_node + local_rank")),
    Mutant("node rank not multiplied", replace("return node_rank * nproc_per_node + local_rank",
                                               "return node_rank + local_rank"),
           "the ranks of node n follow those of nodes 0..n-1"),
    Mutant("local rank == nproc_per_node allowed (off by one)",
           replace("if not 0 <= local_rank < nproc_per_node:", "if not 0 <= local_rank <= nproc_per_node:"),
           "4 of 4 is one too many"),
    Mutant("negative node rank allowed", drop_statement("must be >= 0"), "node ranks start at 0"),
    Mutant("node 0 rejected (node_rank < 1)", replace("if node_rank < 0:", "if node_rank < 1:"),
           ("global_rank(0, 2, 4) == 2", "raised valueerror")),
    Mutant("local rank 0 rejected", replace("if not 0 <= local_rank", "if not 1 <= local_rank"),
           ("global_rank(2, 0, 8) == 16", "raised valueerror")),
    Mutant("bools accepted", replace("isinstance(value, bool) or ", ""), "not isinstance(x, bool)"),
    Mutant("TypeError for non-ints", replace('raise ValueError(f"{name}={value!r} must be an int")',
                                             'raise TypeError(f"{name}={value!r} must be an int")'),
           ("raises valueerror", "raised typeerror")),
], variants=[
    Variant("type() is int, the rank from a range of the node's ranks", '''
def global_rank(node_rank, local_rank, nproc_per_node):
    args = {"node_rank": node_rank, "local_rank": local_rank, "nproc_per_node": nproc_per_node}
    bad = [f"{k}={v!r}" for k, v in args.items() if type(v) is not int]
    if bad:
        raise ValueError("not ints: " + ", ".join(bad))
    if nproc_per_node < 1 or node_rank < 0 or local_rank not in range(nproc_per_node):
        raise ValueError(f"out of range: {args}")
    first = node_rank * nproc_per_node
    return range(first, first + nproc_per_node)[local_rank]
'''),
    Variant("one check per argument, numbers.Integral", '''
import numbers

def global_rank(node_rank, local_rank, nproc_per_node):
    def whole(name, value, low, high=None):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ValueError(f"{name}={value!r} is not an int")
        if value < low or (high is not None and value >= high):
            raise ValueError(f"{name}={value} is out of range")
    whole("nproc_per_node", nproc_per_node, 1)
    whole("node_rank", node_rank, 0)
    whole("local_rank", local_rank, 0, nproc_per_node)
    return nproc_per_node * node_rank + local_rank
'''),
])

TORCHRUN = ExerciseMutants("07.torchrun_command", NOTEBOOK, ("torchrun_command",), mutants=[
    Mutant("node rank hard-coded to 0", replace('f"--node-rank={node_rank}"', '"--node-rank=0"'),
           ("f'--node-rank={node_rank}'", "not run until the cases above pass")),
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

NODE_ENV = ExerciseMutants("07.node_env", NOTEBOOK, ("node_env",), mutants=[
    Mutant("gloo's variable forgotten", replace(', "GLOO_SOCKET_IFNAME": interface', ""),
           ("gloo_socket_ifname='eth0'", "gloo", "only reads gloo_socket_ifname")),
    Mutant("NCCL's variable forgotten", replace('"NCCL_SOCKET_IFNAME": interface, ', ""),
           "nccl only reads nccl_socket_ifname"),
    Mutant("interface hard-coded to eth0", replace('": interface', '": "eth0"', count=0),
           "nccl_socket_ifname='ib0'"),
    Mutant("interface excluded instead of chosen (^eth0)",
           replace('"NCCL_SOCKET_IFNAME": interface', '"NCCL_SOCKET_IFNAME": "^" + interface'),
           ("nccl_socket_ifname='eth0'", "'^eth0'")),
    Mutant("InfiniBand switched off", replace('env = {"NCCL_SOCKET_IFNAME"', 'env = {"NCCL_IB_DISABLE": "1", '
                                                                           '"NCCL_SOCKET_IFNAME"'),
           ("nccl_ib_disable=1 switches a transport off", "infiniband")),
    Mutant("debug always on", replace("if debug:", "if True:"), "no nccl_debug=info with debug=false"),
    Mutant("debug replaces the interface variables", replace("env.update(", "env = dict("),
           "keeps the interface variables"),
    Mutant("NCCL_DEBUG given a bool", replace('NCCL_DEBUG="INFO"', "NCCL_DEBUG=True"),
           ("a dict of str to str", "os.environ takes strings only")),
], variants=[
    Variant("dict.fromkeys, debug merged in", '''
def node_env(interface, debug=False):
    env = dict.fromkeys(("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"), str(interface))
    return {**env, "NCCL_DEBUG": "INFO"} if debug else env
'''),
    Variant("NCCL's exact-name syntax (=eth0), NCCL_DEBUG=WARN when not debugging, IB explicitly on", '''
def node_env(interface: str, debug: bool = False) -> dict:
    return {"GLOO_SOCKET_IFNAME": interface, "NCCL_SOCKET_IFNAME": "=" + interface, "NCCL_IB_DISABLE": "0",
            "NCCL_DEBUG": "INFO" if debug else "WARN"}
'''),
])

SPECS = [GLOBAL_RANK, TORCHRUN, NODE_ENV]


def no_torchrun_started(mutant, result):
    """A mutant that fails the quick cases must not start torchrun: the real runs wait for them."""
    real = [c for c in result.cases if c.name.startswith(("run for real", "gloo across"))]
    assert all("not run until the cases above pass" in c.hint for c in real), str(result)


test_mutant_fails_naming_its_bug, test_correct_variant_passes, test_every_exercise_has_five_mutants_and_two_variants = \
    mutant_tests(SPECS, "07", NAMESPACE, after=no_torchrun_started)

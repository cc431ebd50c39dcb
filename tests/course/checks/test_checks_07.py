"""Checkers of lesson 07 against the solution, a stub, and the wrong answers they exist for.

The right answers are the ones in solutions/07_multi_node.ipynb, read from the
notebook itself. torchrun_command and node_env are judged by real torchrun runs
on simulated nodes (network namespaces where possible, else 127.0.0.1).
"""
from __future__ import annotations

import sys
from pathlib import Path

import cloudpickle
import pytest

from checking import case_starting, solutions_from, stub
from mgpu_lab.cluster import netns
from mgpu_lab.course.checks import check, exercises

pytestmark = pytest.mark.timeout(400)
# The answers below travel to the check's processes by value, as notebook functions do.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
NOTEBOOK = Path(__file__).resolve().parents[3] / "solutions" / "07_multi_node.ipynb"
IDS = ["07.global_rank", "07.node_env", "07.torchrun_command"]
NO_NETNS = netns.problem()


SOLUTION = solutions_from(NOTEBOOK, ("global_rank", "torchrun_command", "node_env"))
_case = case_starting



def _fails(result, *starts: str, hint_words: str = ""):
    """Exactly the cases named ``starts...`` fail (the first with a hint containing ``hint_words``)."""
    assert all(any(c.name.startswith(s) for c in result.cases) for s in starts), str(result)
    failing = sorted((c for c in result.cases if c.name.startswith(starts)),
                     key=lambda c: [c.name.startswith(s) for s in starts].index(True))
    assert all(not c.passed for c in failing), str(result)
    assert hint_words in failing[0].hint, str(result)
    assert all(c.passed for c in result.cases if c not in failing), str(result)
    assert result.status == "failed" and result.points == result.max_points - len(failing)


def test_the_lesson_registers_its_three_exercises():
    assert [e.id for e in exercises("07")] == IDS
    assert {e.id: e.points for e in exercises("07")} == {"07.global_rank": 6, "07.node_env": 5,
                                                        "07.torchrun_command": 7}


@pytest.mark.parametrize("exercise_id, name", [("07.global_rank", "global_rank"),
                                               ("07.torchrun_command", "torchrun_command"),
                                               ("07.node_env", "node_env")])
def test_solution_gets_full_marks(exercise_id, name):
    result = check(exercise_id, SOLUTION[name])
    assert result.status == "passed" and result.points == result.max_points, str(result)


@pytest.mark.parametrize("exercise_id", IDS)
def test_stub_is_not_attempted(exercise_id):
    result = check(exercise_id, stub)
    assert result.status == "not attempted" and result.points == 0


# -- global_rank ---------------------------------------------------------------------
def swapped(node_rank, local_rank, nproc_per_node):
    return local_rank * nproc_per_node + node_rank


def unchecked(node_rank, local_rank, nproc_per_node):
    return node_rank * nproc_per_node + local_rank


def off_by_one(node_rank, local_rank, nproc_per_node):
    """local_rank == nproc_per_node slips through."""
    if isinstance(node_rank, bool) or not all(isinstance(v, int) for v in (node_rank, local_rank, nproc_per_node)):
        raise ValueError("ints only")
    if node_rank < 0 or nproc_per_node < 1 or not 0 <= local_rank <= nproc_per_node:
        raise ValueError("out of range")
    return node_rank * nproc_per_node + local_rank


def bools_allowed(node_rank, local_rank, nproc_per_node):
    if not all(isinstance(v, int) for v in (node_rank, local_rank, nproc_per_node)):
        raise ValueError("ints only")
    if node_rank < 0 or nproc_per_node < 1 or not 0 <= local_rank < nproc_per_node:
        raise ValueError("out of range")
    return node_rank * nproc_per_node + local_rank


def type_error(node_rank, local_rank, nproc_per_node):
    if not all(type(v) is int for v in (node_rank, local_rank, nproc_per_node)):
        raise TypeError("ints only")
    if node_rank < 0 or nproc_per_node < 1 or not 0 <= local_rank < nproc_per_node:
        raise ValueError("out of range")
    return node_rank * nproc_per_node + local_rank


def test_global_rank_with_the_formula_backwards():
    result = check("07.global_rank", swapped)
    assert not _case(result, "global_rank(1, 3, 4) == 7").passed
    assert not _case(result, "3 nodes x 4 processes").passed
    assert "node_rank * nproc_per_node + local_rank" in _case(result, "global_rank(1, 3, 4)").hint


def test_global_rank_without_validation():
    result = check("07.global_rank", unchecked)
    _fails(result, "ValueError for a negative", "ValueError for local_rank", "ValueError for nproc_per_node",
           "ValueError for arguments", hint_words="node ranks start at 0")


def test_global_rank_off_by_one_in_the_local_rank_check():
    _fails(check("07.global_rank", off_by_one), "ValueError for local_rank", hint_words="4 of 4 is one too many")


def test_global_rank_that_takes_a_bool_or_raises_type_error():
    _fails(check("07.global_rank", bools_allowed), "ValueError for arguments")
    _fails(check("07.global_rank", type_error), "ValueError for arguments")


# -- torchrun_command ---------------------------------------------------------------------
def always_node_zero(script, nnodes, nproc_per_node, node_rank, master_addr, master_port):
    return ["torchrun", f"--nnodes={nnodes}", f"--nproc-per-node={nproc_per_node}", "--node-rank=0",
            f"--master-addr={master_addr}", f"--master-port={master_port}", script]


def swapped_counts(script, nnodes, nproc_per_node, node_rank, master_addr, master_port):
    return ["torchrun", f"--nnodes={nproc_per_node}", f"--nproc-per-node={nnodes}", f"--node-rank={node_rank}",
            f"--master-addr={master_addr}", f"--master-port={master_port}", script]


def standalone(script, nnodes, nproc_per_node, node_rank, master_addr, master_port):
    return ["torchrun", "--standalone", f"--nnodes={nnodes}", f"--nproc-per-node={nproc_per_node}",
            f"--node-rank={node_rank}", f"--master-addr={master_addr}", f"--master-port={master_port}", script]


def script_first(script, nnodes, nproc_per_node, node_rank, master_addr, master_port):
    return ["torchrun", script, f"--nnodes={nnodes}", f"--nproc-per-node={nproc_per_node}",
            f"--node-rank={node_rank}", f"--master-addr={master_addr}", f"--master-port={master_port}"]


def one_string(script, nnodes, nproc_per_node, node_rank, master_addr, master_port):
    return (f"torchrun --nnodes={nnodes} --nproc-per-node={nproc_per_node} --node-rank={node_rank} "
            f"--master-addr={master_addr} --master-port={master_port} {script}")


def python_dash_m(script, nnodes, nproc_per_node, node_rank, master_addr, master_port):
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc_per_node={nproc_per_node}",
            f"--node_rank={node_rank}", f"--master_addr={master_addr}", f"--master_port={master_port}", script]


def test_torchrun_command_with_a_hard_coded_node_rank_is_not_run():
    result = check("07.torchrun_command", always_node_zero)
    _fails(result, "node 1's command", "run for real", "another job", hint_words="f'--node-rank={node_rank}'")
    assert "not run until the cases above pass" in _case(result, "run for real").hint


def test_torchrun_command_with_nnodes_and_nproc_swapped():
    result = check("07.torchrun_command", swapped_counts)
    failed = [c.name for c in result.cases if not c.passed]
    assert failed and all(name.startswith(("another job", "run for real")) for name in failed), str(result)
    assert "--nnodes=4 (got '8')" in _case(result, "another job: 4 nodes").hint


def test_torchrun_command_with_standalone():
    _fails(check("07.torchrun_command", standalone), "static rendezvous", "run for real",
           hint_words="--standalone starts a one-node job")


def test_torchrun_command_with_the_script_before_the_options():
    result = check("07.torchrun_command", script_first)
    assert not _case(result, "node 0:").passed and "the script" in _case(result, "node 0:").hint
    assert not _case(result, "run for real").passed


def test_torchrun_command_that_returns_one_string():
    result = check("07.torchrun_command", one_string)
    assert not _case(result, "returns a list of strings").passed
    assert "return a list of strings" in _case(result, "returns a list of strings").hint
    assert result.points == 0


@pytest.mark.slow
def test_torchrun_command_as_python_dash_m_with_underscores_passes():
    result = check("07.torchrun_command", python_dash_m)
    assert result.status == "passed", str(result)


# -- node_env -------------------------------------------------------------------------
def nccl_only(interface, debug=False):
    env = {"NCCL_SOCKET_IFNAME": interface}
    if debug:
        env["NCCL_DEBUG"] = "INFO"
    return env


def always_debug(interface, debug=False):
    return {"NCCL_SOCKET_IFNAME": interface, "GLOO_SOCKET_IFNAME": interface, "NCCL_DEBUG": "INFO"}


def debug_replaces(interface, debug=False):
    if debug:
        return {"NCCL_DEBUG": "INFO"}
    return {"NCCL_SOCKET_IFNAME": interface, "GLOO_SOCKET_IFNAME": interface}


def hard_coded_eth0(interface, debug=False):
    env = {"NCCL_SOCKET_IFNAME": "eth0", "GLOO_SOCKET_IFNAME": "eth0"}
    return {**env, "NCCL_DEBUG": "INFO"} if debug else env


def test_node_env_without_gloo_fails_the_real_run_too():
    result = check("07.node_env", nccl_only)
    first = _case(result, "node_env('eth0')")
    assert not first.passed and "gloo" in first.hint and "GLOO_SOCKET_IFNAME" in first.expected
    assert not _case(result, "node_env('ib0')").passed
    run = _case(result, "gloo across 2 simulated nodes")
    if NO_NETNS:  # on 127.0.0.1 every address works: only the variables' check can catch it
        assert run.passed
    else:
        assert not run.passed and "127.0.0.1" in run.got + run.hint, str(result)


def test_node_env_that_always_turns_debugging_on():
    _fails(check("07.node_env", always_debug), "node_env('eth0', debug=True)", hint_words="NCCL_DEBUG=INFO")


def test_node_env_whose_debug_replaces_the_interface():
    _fails(check("07.node_env", debug_replaces), "node_env('eth0', True) keeps")


@pytest.mark.skipif(bool(NO_NETNS), reason=f"network namespaces unavailable: {NO_NETNS}")
def test_node_env_that_ignores_its_argument():
    # eth0 happens to be right for the simulated nodes: the ib0 case catches it
    _fails(check("07.node_env", hard_coded_eth0), "node_env('ib0')")

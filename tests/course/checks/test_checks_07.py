"""Checkers of lesson 07 against the solution, a stub, and answers that are no mutant of it.

The right answers are the ones in solutions/07_multi_node.ipynb, read from the
notebook itself; torchrun_command and pick_interface run them for real on simulated
nodes (network namespaces where possible, else 127.0.0.1). The wrong answers
made by editing the solution are in tests/mutants/test_mutants_07.py.
"""
from __future__ import annotations

import sys
from pathlib import Path

import cloudpickle
import pytest

from checking import solutions_from
from mgpu_lab.course.checks import check, exercises
from mgpu_lab.course.checks.l07.judges import parse_torchrun
from mgpu_lab.course.checks.l07.ranks import fast

pytestmark = pytest.mark.timeout(400)
# The answers below travel to the check's processes by value, as notebook functions do.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
NOTEBOOK = Path(__file__).resolve().parents[3] / "solutions" / "07_multi_node.ipynb"
IDS = ["07.hierarchical_allreduce", "07.two_level_allreduce", "07.pick_interface", "07.torchrun_command"]
NAMESPACE: dict = {}
exec("import json, os\nimport torch\nimport torch.distributed as dist\n", NAMESPACE)  # the notebook's first cell
SOLUTION = solutions_from(NOTEBOOK, ("hierarchical_allreduce", "two_level_allreduce", "torchrun_command",
                                     "pick_interface"), NAMESPACE)


def stub(*args, **kwargs):
    # defined here, not imported from checking: shipped by value, the check's process need not import
    # checking (and nbformat with it, seconds on a busy machine)
    raise NotImplementedError("write this")


def right_on_paper_only(script, nnodes, nproc_per_node, node_rank, master_addr, master_port):
    """Right for the ports the check reads; for any other port (the real run's) a torchrun that is not there."""
    launcher = "torchrun" if master_port in (29517, 29400, 1234) else "/nonexistent/bin/torchrun"
    return [launcher, f"--nnodes={nnodes}", f"--nproc-per-node={nproc_per_node}", f"--node-rank={node_rank}",
            f"--master-addr={master_addr}", f"--master-port={master_port}", script]


def test_the_lesson_registers_its_four_exercises_and_the_two_level_all_reduce_carries_half_the_points():
    points = {e.id: e.points for e in exercises("07")}
    assert points == {"07.hierarchical_allreduce": 3, "07.two_level_allreduce": 8, "07.pick_interface": 3,
                      "07.torchrun_command": 2}
    assert 2 * points["07.two_level_allreduce"] >= sum(points.values())


@pytest.mark.parametrize("exercise_id", IDS)
def test_stub_is_not_attempted(exercise_id):
    result = check(exercise_id, stub)
    assert result.status == "not attempted" and result.points == 0


def test_a_command_that_reads_right_but_does_not_run_fails_the_real_run_with_what_the_nodes_said():
    result = check("07.torchrun_command", right_on_paper_only)
    failed = [c for c in result.cases if not c.passed]
    assert [c.name[:13] for c in failed] == ["run for real "], str(result)
    assert "No such file or directory" in failed[0].hint, str(result)


def test_the_real_run_forks_the_workers_without_changing_the_job():
    for argv in (["torchrun", "--nnodes=2", "/abs/s.py"], [sys.executable, "-m", "torch.distributed.run", "/abs/s.py"]):
        before, after = parse_torchrun(argv)[0], parse_torchrun(fast(argv))[0]
        assert (after.start_method, after.run_path) == ("fork", True)
        assert {k: v for k, v in vars(after).items() if k not in ("start_method", "run_path")} == \
            {k: v for k, v in vars(before).items() if k not in ("start_method", "run_path")}


# -- trivially wrong answers pass no case that names a behaviour they lack -----------------------------------
def returns_its_input(tensor):
    return tensor


def returns_none(*args):
    return None


def test_an_answer_that_returns_its_input_unchanged_passes_no_case_of_the_hierarchy():
    result = check("07.hierarchical_allreduce", returns_its_input)
    assert result.points == 0, str(result)
    assert "own node" in str(result) or "differs from all_reduce" in str(result), str(result)


def test_an_answer_that_returns_none_passes_no_case_of_pick_interface():
    result = check("07.pick_interface", returns_none)
    assert result.points == 0, str(result)


def test_an_answer_that_returns_none_passes_no_case_of_torchrun_command():
    result = check("07.torchrun_command", returns_none)
    assert result.points == 0, str(result)


def flat_all_reduce(tensor):
    """The library call a learner tries first: one all_reduce over every rank, nodes ignored."""
    import torch.distributed as dist

    dist.all_reduce(tensor)
    return tensor


def p2p_to_everyone(tensor):
    """Every rank sends its tensor to every other rank and sums what it receives: right, but every rank
    crosses the network, with sends and receives that gloo's flight recorder does not see."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    works = [dist.isend(tensor.clone(), peer) for peer in range(world) if peer != rank]
    total = tensor.clone()
    for peer in range(world):
        if peer != rank:
            got = torch.empty_like(tensor)
            dist.recv(got, peer)
            total += got
    for work in works:
        work.wait()
    return total


def standalone_command(script, nnodes, nproc_per_node, node_rank, master_addr, master_port):
    """Lesson 04's one-machine command, copied: torchrun reads it, but it starts a job of one node."""
    return ["torchrun", "--standalone", f"--nproc-per-node={nproc_per_node}", script]


def bare_command(script, nnodes, nproc_per_node, node_rank, master_addr, master_port):
    """torchrun and the script, nothing else: torchrun's defaults (static, 1 node, 127.0.0.1:29500)."""
    return ["torchrun", script]


def first_with_an_address(addrs, peer):
    """The first interface that is not loopback: right on a machine with one network only."""
    return next(a["ifname"] for a in addrs if a["ifname"] != "lo" and a.get("addr_info"))


def test_trivially_wrong_answers_pass_only_the_cases_whose_behaviour_they_have():
    result = check("07.hierarchical_allreduce", flat_all_reduce)  # the right sum, but every rank crosses nodes
    assert [c.passed for c in result.cases] == [True, False, False], str(result)
    result = check("07.hierarchical_allreduce", p2p_to_everyone)  # the same, by sends and receives
    assert [c.passed for c in result.cases] == [True, False, True], str(result)
    assert "all communicate across nodes" in result.cases[1].hint, str(result)
    for answer in (standalone_command, bare_command):  # read by torchrun, but no job of 2 nodes
        result = check("07.torchrun_command", answer)
        assert [c.passed for c in result.cases] == [False, False], str(result)
    result = check("07.pick_interface", first_with_an_address)  # eth0 happens to be right for the first peer only
    assert [c.passed for c in result.cases] == [False] * 3, str(result)
    assert "longest prefix" in result.cases[0].hint and "ipv6" in result.cases[0].hint.lower(), str(result)


# -- two_level_allreduce: no case passes without its evidence ------------------------------------------------
def test_an_answer_that_returns_its_input_passes_no_case_of_the_two_level_all_reduce():
    """The budgets and the device case are judged only on an all-reduce that works: traffic of nothing is no
    evidence of a design within budget."""
    result = check("07.two_level_allreduce", returns_its_input)
    assert result.points == 0, str(result)
    assert "not judged" in str(result) and "own input" in str(result), str(result)


def test_right_sums_over_the_wrong_links_pass_only_the_cases_of_the_sum_and_the_device():
    """The flat all_reduce and the hierarchical one give the sum, and each fails the budget it overspends."""
    result = check("07.two_level_allreduce", flat_all_reduce)  # 2 (W-1)/W of the tensor across nodes, per rank
    assert [c.passed for c in result.cases] == [True, True, False, False, True, True, False, True], str(result)
    assert "the whole tensor" in result.cases[2].hint, str(result)
    result = check("07.two_level_allreduce", SOLUTION["hierarchical_allreduce"])  # the leader's link carries all
    assert [c.passed for c in result.cases] == [True, True, False, False, False, False, False, True], str(result)
    assert "other links stay idle" in result.cases[2].hint, str(result)
    result = check("07.two_level_allreduce", p2p_to_everyone)  # sends counted on the links to their peers
    assert [c.passed for c in result.cases][:4] == [True, True, False, False], str(result)


def test_the_budgets_count_padding_to_a_multiple_of_l_times_n_and_ring_costs_per_link():
    from mgpu_lab.course.checks.l07.judges import budgets, sent_by_link

    assert budgets(7, 8, 3, 2) == (2 * 1 / 2 * 96 / 3, 2 * 2 / 3 * 96, 96)  # 7 int64 padded to 12: 96 bytes
    ops = [["reduce_scatter", 120, [3, 4, 5], None, "cpu"], ["all_reduce", 40, [2, 5], None, "cpu"],
           ["all_gather", 120, [3, 4, 5], None, "cpu"], ["send", 8, None, 0, "cpu"], ["recv", 8, None, 4, "cpu"],
           ["broadcast", 16, None, None, "cpu"]]
    got = sent_by_link(ops, 5, 3)
    assert (got["within"], got["across"]) == (160.0, 40.0 + 8 + 16)  # an unknown group counts as crossing


def calls_the_library(script, nnodes, nproc_per_node, node_rank, master_addr, master_port):
    """The library's commands for a cluster made up on the spot: the answer, not the learner's."""
    from types import SimpleNamespace

    from mgpu_lab.cluster.commands import torchrun_commands

    nodes = [SimpleNamespace(rank=r, addr=master_addr) for r in range(nnodes)]
    cluster = SimpleNamespace(nodes=nodes, master_addr=master_addr, port=lambda: master_port)
    return torchrun_commands(cluster, script, nproc_per_node=nproc_per_node)[node_rank]


def test_an_answer_that_calls_the_library_s_commands_passes_no_case():
    result = check("07.torchrun_command", calls_the_library)
    assert result.points == 0 and "your code calls mgpu_lab.cluster.commands.torchrun_commands" in str(result), \
        str(result)


# -- the real runs: across interfaces as root, said and unpaid on 127.0.0.1 -----------------------------------
REAL = {"07.torchrun_command": ("torchrun_command", "run for real"), "07.pick_interface": ("pick_interface", "gloo across")}


def judge_the_solution(exercise_id: str, isolated: bool):
    """The solution's result: full marks where the nodes are network namespaces; else every case but the real
    run's, which worked and fails unpaid, saying it did not cross interfaces, why, and what it would prove."""
    from mgpu_lab.course.checks.l07.checkers import NOT_ACROSS

    name, real = REAL[exercise_id]
    result = check(exercise_id, SOLUTION[name])
    if isolated:
        assert result.points == result.max_points, str(result)
        return
    assert [c.name.startswith(real) for c in result.cases if not c.passed] == [True], str(result)
    assert result.points == result.max_points - 1, str(result)
    failed = next(c for c in result.cases if not c.passed)
    assert NOT_ACROSS in failed.hint and "root" in failed.hint and "As root this case proves" in failed.hint, \
        str(result)


@pytest.mark.parametrize("exercise_id", sorted(REAL))
def test_the_solution_gets_every_point_across_interfaces_and_none_for_the_real_run_on_127_0_0_1(exercise_id):
    """As root (CI's root part, nbval of notebook 07) the nodes are network namespaces and the solution gets full
    marks; as an ordinary user (CI's user part) they share 127.0.0.1 and the real run is said not to count."""
    from mgpu_lab.cluster import netns

    judge_the_solution(exercise_id, isolated=not netns.problem())


@pytest.mark.parametrize("exercise_id", sorted(REAL))
def test_without_root_the_real_run_says_it_did_not_cross_interfaces_and_awards_nothing(exercise_id, monkeypatch):
    """The branch an ordinary user meets, reached as root too: network namespaces reported impossible."""
    from mgpu_lab.cluster import netns

    monkeypatch.setattr(netns, "_problem", None)
    monkeypatch.setattr(netns, "_probe", lambda: "not root: creating network namespaces needs CAP_NET_ADMIN")
    judge_the_solution(exercise_id, isolated=False)

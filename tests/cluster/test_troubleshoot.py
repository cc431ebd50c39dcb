"""Tests for mgpu_lab.cluster.troubleshoot: every fault of lesson 07 fails as on a cluster, and its fix works.

The reproductions start real torchrun on simulated nodes (network namespaces,
root and iproute2 as on CI) and skip elsewhere.
"""
from __future__ import annotations

import re

import pytest

from mgpu_lab.cluster import netns, troubleshoot
from mgpu_lab.cluster.multinode import SimCluster
from mgpu_lab.cluster.troubleshoot import FAULTS, SAME_FIX, TABLE, TRAPS, reproduce, setup

pytestmark = pytest.mark.timeout(400)
NO_NETNS = netns.problem()
needs_netns = pytest.mark.skipif(bool(NO_NETNS), reason=f"network namespaces unavailable: {NO_NETNS}")

# What a learner would see in the logs on a cluster, per fault.
MESSAGES = {
    "wrong_interface": r"Gloo connectFullMesh failed .*remote=\[10\.213\.7\.254\]",
    "hostname_loopback": r"Gloo connectFullMesh failed .*remote=\[127\.0\.0\.1\]",
    "blocked_port": r"Timed out after \d+ seconds waiting for clients\. 1/2 clients joined",
    "world_size_mismatch": r"Timed out after \d+ seconds waiting for clients\. 2/3 clients joined",
    "late_node": r"\[node1\].*The client socket has timed out after \d+ms while trying to connect to \(10\.213\.7\.1",
    "c10d_no_is_host": r"RendezvousConnectionError: The connection to the C10d store has failed",
    "c10d_no_local_addr": r"while trying to connect to \(localhost, \d+\)",
    "exit_barrier": r"\[node0\].*Waiting 300 seconds for other agents to finish",
}


def test_every_fault_is_in_the_table_or_the_traps_and_says_its_fix():
    assert set(TABLE) | set(TRAPS) == set(FAULTS) == set(MESSAGES)
    for fault in FAULTS.values():
        assert fault.cause and fault.fix and re.search(r"\d+ (min|s)", fault.cluster_wait)


def test_unknown_fault_names_the_known_ones():
    with pytest.raises(KeyError, match="wrong_interface"):
        reproduce(["no_such_fault"])
    with SimCluster(2, netns=False) as cluster, pytest.raises(KeyError, match="known"):
        setup("nope", cluster)


def test_jobs_differ_from_their_fixes_only_where_the_fault_is():
    with SimCluster(2, netns=False) as cluster:
        jobs = {(k, fixed): setup(k, cluster, fixed) for k in FAULTS for fixed in (False, True)}
    flat = lambda job: " ".join(job["argv"][0]) + " | " + " ".join(job["argv"][1])
    assert jobs["wrong_interface", False]["env"]["GLOO_SOCKET_IFNAME"] == "docker0"
    assert jobs["wrong_interface", True]["env"]["GLOO_SOCKET_IFNAME"] == cluster.interface
    assert "GLOO_SOCKET_IFNAME" not in jobs["hostname_loopback", False]["env"]
    assert jobs["blocked_port", False]["drop"] == (1, 0) and jobs["blocked_port", True]["drop"] is None
    assert "--nnodes=3" in flat(jobs["world_size_mismatch", False])
    assert "--nnodes=2" in flat(jobs["world_size_mismatch", True])
    assert jobs["late_node", False]["delays"] == [0, "after node0"]
    assert "is_host=1" not in flat(jobs["c10d_no_is_host", False])
    assert "is_host=1" in flat(jobs["c10d_no_is_host", True])
    assert "--local-addr" not in flat(jobs["c10d_no_local_addr", False])
    assert "--abort-after-destroy" in flat(jobs["exit_barrier", False])
    assert "--abort-after-destroy" not in flat(jobs["exit_barrier", True])
    for job in jobs.values():  # every job is bounded by short timeouts of its own
        assert "--timeout 3" in flat(job)
    # The fixed jobs that reproduce() runs once for two faults are the same job, but for the port of each run
    same = lambda key: {**jobs[key, True], "argv": re.sub(r"(?<=[=:])\d{4,5}\b", "PORT", flat(jobs[key, True]))}
    for key, twin in SAME_FIX.items():
        assert same(key) == same(twin), (key, twin)
    distinct = [same(k) for k in FAULTS if k not in SAME_FIX]
    assert all(a != b for i, a in enumerate(distinct) for b in distinct[i + 1:])


@pytest.mark.slow
@needs_netns
def test_every_fault_fails_with_the_message_a_cluster_shows(capsys):
    runs = reproduce(list(FAULTS))
    out = capsys.readouterr().out
    for run in runs:
        log = "\n".join(run.result.lines())
        assert not run.result.ok and run.as_expected, f"{run.fault.key} did not fail:\n{log}"
        assert re.search(MESSAGES[run.fault.key], log), f"{run.fault.key}: message not found in\n{log}"
        assert any(re.search(run.fault.evidence, line) for line in run.evidence()), run.report()
        assert run.result.seconds < troubleshoot.RUN_TIMEOUT, f"{run.fault.key} needed the outer timeout"
        assert f"{run.fault.title}: FAILED" in out and run.fault.fix in out
    assert "still running" in runs[-1].result.nodes[0].status()  # exit barrier: node 0 waits on


@pytest.mark.slow
@needs_netns
def test_every_fix_works(capsys):
    runs = reproduce(list(FAULTS), fixed=True)
    for run in runs:
        assert run.result.ok and run.as_expected, "\n".join(run.result.lines())
        assert run.same_as == SAME_FIX.get(run.fault.key, "")
    out = capsys.readouterr().out
    assert f"troubleshoot: {len(FAULTS) - len(SAME_FIX)} job(s) at once" in out  # each distinct job once
    assert out.count(", fixed: OK") == len(FAULTS) and out.count("(the same job as the fix of ") == len(SAME_FIX)

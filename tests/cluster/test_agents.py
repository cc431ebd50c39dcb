"""Tests for mgpu_lab.cluster.agents: node torchruns forked from a server that imported torch once.

Each test proves the path it claims: a forked agent's parent is the server, a
started one's is this process.
"""
from __future__ import annotations

import os
import textwrap
import time

import psutil
import pytest

from mgpu_lab.cluster import agents, netns, noderunner
from mgpu_lab.cluster.commands import torchrun_commands
from mgpu_lab.cluster.multinode import SimCluster

pytestmark = pytest.mark.timeout(300)
NO_NETNS = netns.problem()
needs_netns = pytest.mark.skipif(bool(NO_NETNS), reason=f"network namespaces unavailable: {NO_NETNS}")

# A rank that says where it runs and who started its torchrun; then an all_reduce across the nodes.
SCRIPT = textwrap.dedent("""\
    import os, socket, tempfile
    import psutil
    import torch, torch.distributed as dist
    agent = psutil.Process(os.getppid())
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    hosts = [l.split()[1] for l in open("/etc/hosts") if l.strip() and not l.startswith("#")]
    print(f"rank {dist.get_rank()} host {socket.gethostname()} agent-parent {agent.ppid()} sum {t.item():g} "
          f"tmp {tempfile.gettempdir()} foo {os.environ.get('FOO')} hosts {','.join(hosts)}", flush=True)
    dist.destroy_process_group()
""")


def _line(result, node: int) -> dict:
    line = next(l for l in result.nodes[node].lines if l.startswith("rank "))
    words = line.split()
    return dict(zip(words[::2], words[1::2]))


@needs_netns
def test_a_forked_torchrun_runs_as_the_command_does_on_each_node(tmp_path):
    script = tmp_path / "where.py"
    script.write_text(SCRIPT)
    with SimCluster(2) as cluster:
        env = {"GLOO_SOCKET_IFNAME": cluster.interface, "LOGLEVEL": "INFO"}
        forked = cluster.run(torchrun_commands(cluster, script, fork=True), env=env, timeout=120, echo=False)
        server = agents._server
        # a variable torch may read at import: this run's torchrun is started as a command instead
        started = cluster.run(torchrun_commands(cluster, script, fork=True), env={**env, "FOO": "bar"}, timeout=120,
                              echo=False)
    assert forked.ok and started.ok, (forked.nodes[0].output[-2000:], started.nodes[0].output[-2000:])
    for node in (0, 1):
        seen = _line(forked, node)
        assert seen["host"] == f"node{node}" and seen["sum"] == "2" and seen["foo"] == "None"
        assert seen["agent-parent"] == str(server.proc.pid)  # forked from the server, not started
        assert f"node{node}" in seen["hosts"].split(",")  # the node's /etc/hosts, bound over /etc/hosts
        assert os.path.basename(seen["tmp"]).startswith("mgpu-lab-run-")  # the run's own TMPDIR
        other = _line(started, node)
        assert other["agent-parent"] == str(os.getpid()) and other["foo"] == "bar" and other["host"] == f"node{node}"
    # LOGLEVEL was read again by the fork: torchrun's INFO lines, with its log folder in the run's TMPDIR
    assert any("log_dir" in l and "mgpu-lab-run-" in l for l in forked.nodes[0].lines)


def test_exit_codes_are_torchruns_own(no_netns_cluster):
    cluster = no_netns_cluster
    bad = cluster.run([["torchrun", "--nnodes=2", "--no-such-flag", "x.py"]] * 2, timeout=60, echo=False)
    assert [n.returncode for n in bad.nodes] == [2, 2]  # argparse's usage error, as the command gives
    assert "unrecognized arguments: --no-such-flag" in bad.nodes[0].output


def test_a_killed_forked_torchrun_is_reaped_and_leaves_nothing(no_netns_cluster, tmp_path):
    script = tmp_path / "sleep.py"
    script.write_text("import time\ntime.sleep(600)\n")
    start = time.monotonic()
    argv = ["torchrun", "--standalone", "--nproc-per-node=1", "--run-path", "--start-method=fork", str(script)]
    result = no_netns_cluster.run([argv] * 2, timeout=8, echo=False)
    assert result.timed_out and time.monotonic() - start < 30
    server = psutil.Process(agents._server.proc.pid)
    time.sleep(0.3)
    assert server.children(recursive=True) == []  # agents and their ranks gone, no zombie left to reap


def test_the_server_ends_with_its_socket_and_kills_its_agents(tmp_path):
    script = tmp_path / "sleep.py"
    script.write_text("import time\ntime.sleep(600)\n")
    srv = agents.AgentServer(noderunner.environment({}))
    agent = srv.start(["torchrun", "--nproc-per-node=1", "--run-path", "--start-method=fork", str(script)],
                      noderunner.environment({}), tmp_path, None, None)
    deadline = time.monotonic() + 120
    while not psutil.Process(agent.pid).children() and time.monotonic() < deadline:
        time.sleep(0.2)
    family = [psutil.Process(agent.pid), *psutil.Process(agent.pid).children(recursive=True)]
    assert len(family) == 2 and agent.poll() is None
    srv._sock.close()  # as when the process that started it dies
    assert srv.proc.wait(30) == 0
    gone, alive = psutil.wait_procs(family, timeout=10)
    assert alive == [] or all(p.status() == psutil.STATUS_ZOMBIE for p in alive)
    agent.stdout.close()


def test_off_switch_and_what_may_differ(monkeypatch):
    monkeypatch.setenv("MGPU_LAB_FORK_TORCHRUN", "0")
    assert agents.server({}) is None
    srv = object.__new__(agents.AgentServer)
    srv.env = {"PATH": "/bin", "TMPDIR": "/tmp"}
    assert srv.fits({"PATH": "/bin", "TMPDIR": "/x", "GLOO_SOCKET_IFNAME": "eth0", "SLURM_NODEID": "1"})
    assert not srv.fits({"PATH": "/bin", "OMP_NUM_THREADS": "4"})  # read when torch is imported
    assert not srv.fits({"TMPDIR": "/tmp"})  # PATH missing


@pytest.fixture
def no_netns_cluster(monkeypatch):
    monkeypatch.setattr(netns, "problem", lambda: "simulated: no network namespaces here")
    with SimCluster(2) as cluster:
        yield cluster

"""Tests for mgpu_lab.cluster.multinode and mgpu_lab.cluster.netns: simulated nodes, runs, cleanup, torchrun for real.

Most tests need network namespaces (root and iproute2, as on CI) and skip with
the reason elsewhere; the fallback to 127.0.0.1 is tested everywhere by
making the capability check say no.
"""
from __future__ import annotations

import ast
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from mgpu_lab.cluster import multinode, netns, noderunner
from mgpu_lab.cluster.commands import torchrun_commands
from mgpu_lab.cluster.multinode import PROBE_SCRIPT, SimCluster, probe_reports

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[2]
NO_NETNS = netns.problem()
needs_netns = pytest.mark.skipif(bool(NO_NETNS), reason=f"network namespaces unavailable: {NO_NETNS}")


def mine() -> list[str]:
    """Namespaces (and /etc/netns entries) created by this test process."""
    found = set(netns.names())
    if netns.ETC.is_dir():
        found |= {p.name for p in netns.ETC.iterdir()}
    return sorted(n for n in found if n.startswith(f"{netns.PREFIX}{os.getpid()}c"))


@pytest.fixture(autouse=True)
def nothing_left():
    yield
    assert mine() == [], f"namespaces left behind: {mine()}"


def py(code: str) -> list[str]:
    return ["python", "-c", textwrap.dedent(code)]


@pytest.fixture
def no_netns(monkeypatch):
    """Make the capability check say no: every node on 127.0.0.1."""
    monkeypatch.setattr(netns, "problem", lambda: "simulated: no network namespaces here")


# -- namespaces ---------------------------------------------------------------------
@needs_netns
def test_cluster_creates_namespaces_and_removes_them_on_close():
    cluster = SimCluster(2)
    try:
        created = mine()
        assert len(created) == 3 and cluster.isolated and not cluster.reason
        assert [n.addr for n in cluster.nodes] == ["10.213.7.1", "10.213.7.2"]
        assert [n.hostname for n in cluster.nodes] == ["node0", "node1"]
        assert cluster.master_addr == "10.213.7.1" and cluster.interface == "eth0"
        hosts = (netns.ETC / cluster.nodes[0].netns / "hosts").read_text()
        assert "127.0.0.1 node0" in hosts and "10.213.7.2 node1" in hosts
        assert "10.213.7.1" in cluster.banner() and "network namespaces" in cluster.banner()
        # the machine's own network is untouched: no new interface in the root namespace
        assert "10.213.7" not in subprocess.run(["ip", "-br", "addr"], capture_output=True, text=True).stdout
    finally:
        cluster.close()
    assert mine() == [] and cluster.closed
    cluster.close()  # twice is fine
    with pytest.raises(RuntimeError, match="closed"):
        cluster.run([["true"], ["true"]])


@needs_netns
def test_namespaces_are_removed_when_the_body_raises():
    with pytest.raises(ZeroDivisionError):
        with SimCluster(2):
            assert len(mine()) == 3
            1 / 0
    assert mine() == []


@needs_netns
def test_nodes_have_their_own_hostname_hosts_file_and_address():
    code = """
        import socket
        me = socket.gethostname()
        print(me, socket.gethostbyname(me), socket.gethostbyname("node0"), socket.gethostbyname("node1"))
    """
    with SimCluster(2) as cluster:
        loop = cluster.run([py(code)] * 2, timeout=30, echo=False)
        cluster.hostname_loopback = False
        fixed = cluster.run([py(code)] * 2, timeout=30, echo=False)
    assert loop.ok and fixed.ok
    assert loop.nodes[0].lines == ["node0 127.0.0.1 127.0.0.1 10.213.7.2"]
    assert loop.nodes[1].lines == ["node1 127.0.0.1 10.213.7.1 127.0.0.1"]
    assert fixed.nodes[0].lines == ["node0 10.213.7.1 10.213.7.1 10.213.7.2"]


@needs_netns
def test_traffic_between_nodes_crosses_their_interfaces_and_loopback_is_private():
    server = """
        import socket
        s = socket.socket(); s.bind(("0.0.0.0", 31000)); s.listen(); s.settimeout(20)
        conn, peer = s.accept(); print("peer", peer[0], conn.recv(5).decode())
    """
    client = """
        import socket, time
        time.sleep(1)
        try:
            socket.create_connection(("127.0.0.1", 31000), timeout=2)
            print("loopback reached node0")
        except OSError as err:
            print("loopback:", type(err).__name__)
        s = socket.create_connection(("10.213.7.1", 31000), timeout=5); s.send(b"hello"); print("sent")
    """
    with SimCluster(2) as cluster:
        result = cluster.run([py(server), py(client)], timeout=40, echo=False)
    assert result.ok, result.lines()
    assert result.nodes[0].lines == ["peer 10.213.7.2 hello"]
    assert result.nodes[1].lines[0].startswith("loopback: ") and result.nodes[1].lines[1] == "sent"


@needs_netns
def test_drop_traffic_makes_connections_hang_until_the_block_ends():
    server = """
        import socket
        s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", 31001)); s.listen(); s.settimeout(6)
        try:
            s.accept(); print("accepted")
        except TimeoutError:
            print("nobody came")
    """
    client = """
        import socket, time
        time.sleep(0.5)
        try:
            socket.create_connection(("10.213.7.1", 31001), timeout=2); print("connected")
        except TimeoutError:
            print("timed out")
    """
    with SimCluster(2) as cluster:
        with cluster.drop_traffic(1, 0):
            dropped = cluster.run([py(server), py(client)], timeout=30, echo=False)
        through = cluster.run([py(server), py(client)], timeout=30, echo=False)
    assert dropped.nodes[1].lines == ["timed out"] and dropped.nodes[0].lines == ["nobody came"]
    assert through.nodes[1].lines == ["connected"] and through.nodes[0].lines == ["accepted"]


# -- runs: bounded, logged, cleaned up ---------------------------------------------------
SLEEPER = """
    import os, subprocess, sys, time
    # like torchrun's workers: a child in a session of its own
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    print("pids", os.getpid(), child.pid, flush=True)
    time.sleep(120)
"""


def _pids(result) -> list[int]:
    return [int(p) for n in result.nodes for line in n.lines if line.startswith("pids") for p in line.split()[1:]]


def test_each_run_has_a_temp_dir_of_its_own_removed_after_it(no_netns):
    """torchrun leaves its log folder (torchelastic_*) in the temp dir of every run: not in /tmp for good."""
    with SimCluster(2) as cluster:
        result = cluster.run([py("import tempfile; print(tempfile.gettempdir())")] * 2, timeout=30, echo=False)
        mine_too = cluster.run([py("import os; print(os.environ['TMPDIR'])")] * 2, env={"TMPDIR": "/var/tmp"},
                               timeout=30, echo=False)
    used = {n.lines[0] for n in result.nodes}
    assert len(used) == 1 and not used & {tempfile.gettempdir(), "/tmp"}
    assert not Path(used.pop()).exists()
    assert [n.lines for n in mine_too.nodes] == [["/var/tmp"]] * 2  # the caller's TMPDIR wins


@pytest.mark.parametrize("isolated", [True, False])
def test_a_run_is_stopped_at_its_timeout_and_leaves_no_process(isolated, request):
    if isolated and NO_NETNS:
        pytest.skip(f"network namespaces unavailable: {NO_NETNS}")
    if not isolated:
        request.getfixturevalue("no_netns")
    with SimCluster(2) as cluster:
        start = time.monotonic()
        result = cluster.run([py(SLEEPER)] * 2, timeout=4, echo=False)
        took = time.monotonic() - start
    pids = _pids(result)
    assert result.timed_out and not result.ok and result.stopped == "at the 4 s timeout"
    assert len(pids) == 4 and took < 15
    assert all(n.returncode is None and "still running" in n.status() for n in result.nodes)
    time.sleep(0.2)
    assert [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE] == []


@needs_netns
def test_processes_are_killed_when_a_run_raises_midway(monkeypatch):
    with SimCluster(2) as cluster:
        real_spawn, started = noderunner.spawn, []

        def spawn_then_fail(run, env, cwd, net):
            if started:
                raise OSError("simulated: cannot start node1")
            started.append(real_spawn(run, env, cwd, net))
            return started[-1]

        monkeypatch.setattr(noderunner, "spawn", spawn_then_fail)
        with pytest.raises(OSError, match="node1"):
            cluster.run([py(SLEEPER), py(SLEEPER)], delays=[0, 1.5], timeout=30, echo=False)
        assert started[0].poll() is not None
        assert all(netns.processes(n.netns) == [] for n in cluster.nodes)


@needs_netns
def test_stale_namespaces_of_a_killed_process_are_removed():
    code = f"""
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from mgpu_lab.cluster.multinode import SimCluster
        cluster = SimCluster(2)
        print("ready", flush=True)
        cluster.run([["sleep", "300"], ["sleep", "300"]], timeout=300, echo=False)
    """
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        prefix = f"{netns.PREFIX}{proc.pid}c"
        theirs = [n for n in netns.names() if n.startswith(prefix)]
        assert len(theirs) == 3
        # Both nodes' commands started: one process in each node's namespace (the two nodes start one after
        # the other, so waiting for the first alone raced with the second on a loaded machine).
        deadline = time.monotonic() + 20
        sleepers = []
        while len(sleepers) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
            sleepers = [p for n in theirs for p in netns.processes(n)]
        assert len(sleepers) == 2
    finally:
        proc.send_signal(signal.SIGKILL)  # no finally, no atexit: the namespaces stay behind
        proc.wait()
    # Whoever calls cleanup_stale first removes them: this test, or a SimCluster being made in
    # another test process at the same time (every SimCluster cleans up first). Nothing else does.
    removed = netns.cleanup_stale()
    assert {n for n in removed if n.startswith(prefix)} <= set(theirs)
    assert [n for n in netns.names() if n.startswith(prefix)] == []
    assert not any((netns.ETC / n).exists() for n in theirs)
    psutil.wait_procs(sleepers, timeout=5)
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in sleepers)


@needs_netns
def test_namespaces_of_living_processes_are_left_alone():
    with SimCluster(2):
        assert [n for n in netns.cleanup_stale() if n.startswith(f"{netns.PREFIX}{os.getpid()}c")] == []
        assert len(mine()) == 3


def test_fallback_puts_every_node_on_127_0_0_1(no_netns, capsys):
    with SimCluster(2) as cluster:
        assert not cluster.isolated and cluster.reason.startswith("simulated")
        assert [(n.addr, n.interface, n.netns) for n in cluster.nodes] == [("127.0.0.1", "lo", None)] * 2
        assert "not isolated (simulated" in cluster.banner()
        result = cluster.run([py("import os; print(os.environ['WHO'])")] * 2,
                             env=lambda node: {"WHO": f"node{node.rank}"}, timeout=30)
        with pytest.raises(RuntimeError, match="needs network namespaces"):
            with cluster.drop_traffic(1, 0):
                pass
        assert 1024 < cluster.port() < 65536
        assert mine() == []  # no namespace made (other test processes may be making theirs)
    assert [n.lines for n in result.nodes] == [["node0"], ["node1"]]
    out = capsys.readouterr().out
    assert "every node on 127.0.0.1, not isolated" in out and "[node1] node1" in out and "OK: 2 nodes" in out


def test_netns_true_where_impossible_is_an_error(no_netns):
    with pytest.raises(RuntimeError, match="netns=True.*simulated"):
        SimCluster(2, netns=True)


def test_env_delays_after_failure_and_the_summary(no_netns, capsys):
    with SimCluster(2) as cluster:
        result = cluster.run([py("import sys; print('boom'); sys.exit(3)"), py("import time; time.sleep(60)")],
                             timeout=30, after_failure=1)
        late = cluster.run([py("print('first')"), py("print('second')")], delays=[0, "after node0"], timeout=30,
                           echo=False)
        timed = cluster.run([py("print('a')"), py("print('b')")], delays=[0, 0.5], timeout=30, echo=False)
    assert result.stopped == "1 s after node0 failed" and not result.timed_out
    assert result.nodes[0].returncode == 3 and result.nodes[0].status().startswith("exit code 3")
    assert result.nodes[1].status().startswith("still running") and "1 s after node0 failed" in result.nodes[1].status()
    assert result.seconds < 20
    assert late.ok and timed.ok and late.nodes[1].lines == ["second"]
    out = capsys.readouterr().out
    assert "[node0] boom" in out and "FAILED: 2 nodes" in out


def test_run_arguments_are_checked(no_netns):
    with SimCluster(2) as cluster:
        for bad in ([["true"]], [["true"], []], [["true"], [1]]):
            with pytest.raises(ValueError, match="one non-empty list of strings per node"):
                cluster.run(bad)
        for delays in ([0], [0, -1], [0, "after node1"], [0, "later"], [0, True]):
            with pytest.raises(ValueError, match="delays"):
                cluster.run([["true"]] * 2, delays=delays)
        with pytest.raises(ValueError, match="timeout"):
            cluster.run([["true"]] * 2, timeout=0)
        with pytest.raises(ValueError, match="rdzv"):
            torchrun_commands(cluster, "x.py", rdzv="etcd")
    for nodes in (0, 17, True, "2"):
        with pytest.raises(ValueError, match="nodes="):
            SimCluster(nodes)


def test_torchrun_commands_static_c10d_and_fork(no_netns):
    with SimCluster(2) as cluster:
        static = torchrun_commands(cluster, "train.py", "--epochs", "1", nproc_per_node=2, port=29511)
        c10d = torchrun_commands(cluster, "train.py", rdzv="c10d", port=29400, rdzv_conf="join_timeout=5")
        bare = torchrun_commands(cluster, "train.py", rdzv="c10d", port=29400, is_host=False, local_addr=False)
        forked = torchrun_commands(cluster, "train.py", port=1, fork=True)
    assert static[1] == ["torchrun", "--nnodes=2", "--nproc-per-node=2", "--node-rank=1", "--master-addr=127.0.0.1",
                         "--master-port=29511", "train.py", "--epochs", "1"]
    assert c10d[0] == ["torchrun", "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
                       "--rdzv-endpoint=127.0.0.1:29400", "--rdzv-id=lesson07", "--rdzv-conf=is_host=1,join_timeout=5",
                       "--local-addr=127.0.0.1", "train.py"]
    assert "--rdzv-conf=join_timeout=5" in c10d[1] and not any("is_host" in a for a in c10d[1])
    assert not any(a.startswith(("--rdzv-conf", "--local-addr")) for a in bare[0])
    assert forked[0][3:5] == ["--run-path", "--start-method=fork"] and Path(forked[0][-1]).is_absolute()


def test_key_lines_pick_what_went_wrong():
    node = multinode.Node(0, "node0", "10.213.7.1", "eth0", None)
    lines = ["rank 0/2: hello", "Traceback (most recent call last):", '  File "x.py", line 3, in <module>',
             "    dist.init_process_group(backend, timeout=t)", "frame #0: c10::Error::Error() + 0x9d",
             "RuntimeError: Gloo connectFullMesh failed ... Connection refused, remote=[127.0.0.1]:1234",
             "[W socket.cpp:207] [c10d] The hostname of the client socket cannot be retrieved. err=-3"]
    result = multinode.RunResult([multinode.NodeRun(node, ["x"], {}, 1, lines, 2.0, "", True)], 30, 2.0, True)
    assert result.key_lines() == ["[node0] RuntimeError: Gloo connectFullMesh failed ... Connection refused, "
                                  "remote=[127.0.0.1]:1234"]
    assert result.lines("rank") == ["[node0] rank 0/2: hello"]
    assert "FAILED: 1 nodes" in str(result) and "exit code 1" in str(result)


# -- real torchrun on simulated nodes ------------------------------------------------------
GLOO = {"ALLREDUCE_CHECK_JSON": "1", "ALLREDUCE_CHECK_TIMEOUT": "20"}


def _ranks(result):
    return [(int(r["RANK"]), int(r["LOCAL_RANK"]), int(r["GROUP_RANK"]), int(r["WORLD_SIZE"]), r["node"], r["sum"])
            for r in probe_reports(result)]


@pytest.mark.slow
@needs_netns
def test_torchrun_static_rendezvous_across_two_namespaces():
    with SimCluster(2) as cluster:
        result = cluster.run(torchrun_commands(cluster, PROBE_SCRIPT, nproc_per_node=2),
                             env={**GLOO, "GLOO_SOCKET_IFNAME": "eth0"}, timeout=180, echo=False)
    assert result.ok, "\n".join(result.lines())
    assert _ranks(result) == [(r, r % 2, r // 2, 4, r // 2, 10.0) for r in range(4)]
    hosts = {r["hostname"] for r in probe_reports(result)}
    assert hosts == {"node0", "node1"}


@pytest.mark.slow
@needs_netns
def test_torchrun_c10d_rendezvous_across_two_namespaces_with_a_late_node():
    with SimCluster(2) as cluster:
        result = cluster.run(torchrun_commands(cluster, PROBE_SCRIPT, rdzv="c10d"),
                             env={**GLOO, "GLOO_SOCKET_IFNAME": "eth0"}, delays=[0, 3], timeout=180, echo=False)
    assert result.ok, "\n".join(result.lines())
    assert sorted(r[:4] for r in _ranks(result)) == [(0, 0, 0, 2), (1, 0, 1, 2)]
    assert {r["MASTER_ADDR"] for r in probe_reports(result)} == {"10.213.7.1"}


@pytest.mark.slow
def test_torchrun_across_two_nodes_on_127_0_0_1(no_netns):
    with SimCluster(2) as cluster:
        result = cluster.run(torchrun_commands(cluster, PROBE_SCRIPT, fork=True),
                             env={**GLOO, "GLOO_SOCKET_IFNAME": "lo"}, timeout=180, echo=False)
    assert result.ok, "\n".join(result.lines())
    assert [r[:4] for r in _ranks(result)] == [(0, 0, 0, 2), (1, 0, 1, 2)]


@pytest.mark.slow
@needs_netns
def test_gloo_without_an_interface_works_once_hosts_maps_the_hostname_to_the_real_address():
    """The loopback trap's other fix: /etc/hosts with the node's real address (the trap itself, and the
    GLOO_SOCKET_IFNAME fix, run in test_troubleshoot: fault hostname_loopback)."""
    with SimCluster(2) as cluster:
        cluster.hostname_loopback = False
        fixed = cluster.run(torchrun_commands(cluster, PROBE_SCRIPT, fork=True), env=GLOO, timeout=120, echo=False)
    assert fixed.ok, "\n".join(fixed.lines())


def test_probe_reports_parse_json_lines():
    node = multinode.Node(1, "node1", "a", "eth0", None)
    report = {"RANK": "3", "sum": 10.0}
    run = multinode.NodeRun(node, ["x"], {}, 0, ["noise", "ALLREDUCE_CHECK " + json.dumps(report),
                                                 "ALLREDUCE_CHECK {broken"], 1.0, "", True)
    assert probe_reports(multinode.RunResult([run], 10, 1.0, True)) == [{**report, "node": 1}]


def test_probe_reports_of_two_ranks_that_wrote_on_one_line():
    # Two ranks of a node share its pipe: unbuffered print() writes text and newline
    # apart, so one line can hold both reports (a CI run counted 3 of 4 ranks so).
    node = multinode.Node(0, "node0", "a", "eth0", None)
    a, b = {"RANK": "1", "sum": 10.0}, {"RANK": "0", "sum": 10.0}
    line = "ALLREDUCE_CHECK " + json.dumps(a) + "ALLREDUCE_CHECK " + json.dumps(b)
    run = multinode.NodeRun(node, ["x"], {}, 0, [line, ""], 1.0, "", True)
    assert probe_reports(multinode.RunResult([run], 10, 1.0, True)) == [{**b, "node": 0}, {**a, "node": 0}]


def test_the_probe_script_writes_each_report_in_one_write():
    tree = ast.parse(PROBE_SCRIPT.read_text())
    prints = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "print"
              and "ALLREDUCE_CHECK" in ast.unparse(n)]
    assert prints == [], "print() of a report writes its newline apart: reports of two ranks can share a line"


# -- mgpu-lab doctor --nodes N ---------------------------------------------------------------
def test_doctor_nodes_must_be_2_to_16():
    from mgpu_lab import doctor

    for bad in (1, 17, True, "2"):
        with pytest.raises(ValueError, match="nodes="):
            doctor.run_doctor(backends=["gloo"], nodes=bad)


def test_cli_passes_nodes_on(monkeypatch):
    from mgpu_lab import cli, doctor

    seen = {}
    monkeypatch.setattr(doctor, "run_doctor", lambda **kwargs: seen.update(kwargs) or 0)
    assert cli.main(["doctor", "--nodes", "2"]) == 0
    assert seen["nodes"] == 2


def test_doctor_reports_a_failed_node_check(monkeypatch, no_netns):
    """A node whose all_reduce never finishes gives FAILED with the log's key lines, not a crash."""
    import io

    from mgpu_lab import doctor, doctor_probes

    monkeypatch.setattr(multinode, "PROBE_SCRIPT", ROOT / "tests" / "no_such_script.py")
    out = io.StringIO()
    monkeypatch.setattr(doctor_probes, "check_backend", lambda backend, nprocs, timeout: (True, "OK (stand-in)"))
    code = doctor.run_doctor(backends=["gloo"], nodes=2, nprocs=1, out=out)
    text = out.getvalue()
    assert code == 1 and "nodes  FAILED" in text and "0 of 2 ranks finished" in text
    assert "no_such_script.py" in text and "lesson 07 troubleshooting table" in text


@pytest.mark.slow
def test_doctor_nodes_2_as_a_subprocess():
    proc = subprocess.run([str(Path(sys.executable).with_name("mgpu-lab")), "doctor", "--backend", "gloo",
                           "--nodes", "2"], cwd=ROOT, capture_output=True, text=True, timeout=280)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "multi-node: all_reduce + barrier across 2 simulated nodes x 2 rank(s)" in out
    assert re.search(r"nodes  OK in [\d.]+ s \(2 simulated nodes x 2 rank\(s\), torchrun with static rendezvous, "
                     r"gloo; all_reduce sum 10 on every rank\)", out)
    assert ("network namespaces joined by veth links" in out) == (not NO_NETNS)
    assert "  traceback OK in " in out and "  sandbox   OK: submissions run as " in out  # notebooks and grading
    assert "result: all 4 check(s) passed" in out
    # the workers are forks of each node's torchrun: they do not import torch again
    assert re.search(r"node0 ran: GLOO_SOCKET_IFNAME=\S+ torchrun .*--run-path --start-method=fork .*"
                     r"scripts/allreduce_check\.py --backend gloo", out), out

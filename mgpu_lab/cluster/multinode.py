"""Simulated nodes on one machine, each running the real ``torchrun``.

Where the machine allows it (Linux, root, iproute2), every simulated node is a
Linux network namespace with its own host name (``node0``, ``node1``, ...), its
own ``/etc/hosts`` and its own address ``10.213.7.<i+1>`` on its own ``eth0``,
joined to the others by veth links to a bridge in a namespace of its own (see
:mod:`mgpu_lab.cluster.netns`): traffic between nodes crosses real network interfaces,
and the machine's own network is never modified. Elsewhere every node is a
group of processes on ``127.0.0.1``, and the banner says so.

:meth:`SimCluster.run` starts one command per node at once (or some nodes
later), shows each node's output live prefixed ``[nodeI]``, keeps every node's
log (see :mod:`mgpu_lab.cluster.nodelogs`) and stops everything at its timeout (the
run itself is :mod:`mgpu_lab.cluster.noderunner`). Every run is bounded, because a
job that cannot form usually waits rather than fails. Processes and namespaces are
always removed, also when a run raises or times out; namespaces left by a
killed process are removed by the next :class:`SimCluster`.

Example:
    >>> from mgpu_lab.cluster.multinode import SimCluster
    >>> with SimCluster(2) as cluster:   # as root: network namespaces; else every node on 127.0.0.1
    ...     result = cluster.run(lambda node: ["python", "-c", f"print('node {node.rank} up')"], echo=False)
    >>> result.ok, len(result.nodes)
    (True, 2)
"""
from __future__ import annotations

import contextlib
import itertools
import shlex
import socket
import tempfile
import weakref
from pathlib import Path

import psutil

from mgpu_lab.core.shipped import course_dir

from . import netns
from .nodelogs import Node, NodeRun, RunResult, probe_reports  # noqa: F401 (re-exported)
from .noderunner import parse_starts, run_nodes

__all__ = ["SimCluster", "Node", "NodeRun", "RunResult", "PROBE_SCRIPT", "probe_reports"]  # results: nodelogs

MAX_NODES = 16
#: The lesson's all_reduce smoke test, a plain torchrun script (runs on clusters unchanged): the clone's
#: ``scripts/``, or the copy an installed wheel carries.
PROBE_SCRIPT = course_dir("scripts") / "allreduce_check.py"


class _Owned:
    """What a cluster must clean up (no reference back to it, for weakref.finalize)."""

    def __init__(self):
        self.net: netns.Network | None = None
        self.procs: set[psutil.Process] = set()

    def cleanup(self) -> None:
        netns.kill(list(self.procs))
        self.procs.clear()
        if self.net is not None:
            self.net.remove()


class SimCluster:
    """N simulated nodes on this machine (see the module docstring).

    Args:
        nodes: how many nodes (1..16).
        netns: None to use network namespaces where possible; True to require
            them (RuntimeError if impossible); False for 127.0.0.1.
        hostname_loopback: in each node's ``/etc/hosts`` its own host name is
            127.0.0.1, as in this machine's and many cloud images'; the other
            nodes' names map to their addresses. False maps every name to its
            node's address. Settable between runs.

    Attributes:
        nodes: the :class:`Node` objects; ``nodes[0]`` hosts the rendezvous.
        isolated: True when the nodes are network namespaces.
        reason: why they are not (empty when they are).

    Raises:
        ValueError: a bad ``nodes``. RuntimeError: ``netns=True`` where that is
            impossible, or creating the namespaces failed (nothing is left).

    Example:
        >>> with SimCluster(2) as cluster:   # as root ('10.213.7.1', 'eth0'), else ('127.0.0.1', 'lo')
        ...     (cluster.master_addr, cluster.interface) in {("10.213.7.1", "eth0"), ("127.0.0.1", "lo")}
        True
    """

    def __init__(self, nodes: int = 2, *, netns: bool | None = None, hostname_loopback: bool = True):
        from . import netns as ns_mod

        if isinstance(nodes, bool) or not isinstance(nodes, int) or not 1 <= nodes <= MAX_NODES:
            raise ValueError(f"nodes={nodes!r}: pass the number of simulated nodes, 1..{MAX_NODES}")
        problem = ns_mod.problem() if netns is not False else "netns=False asks for 127.0.0.1"
        if netns is True and problem:
            raise RuntimeError(f"netns=True, but network namespaces are impossible here: {problem}; "
                               "use netns=None to fall back to 127.0.0.1")
        self.isolated, self.reason = not problem, problem
        self._hostname_loopback = bool(hostname_loopback)
        self._owned = _Owned()
        self._finalizer = weakref.finalize(self, self._owned.cleanup)
        self._ports = itertools.count(29500)
        if not self.isolated:
            host = socket.gethostname()
            self.nodes = [Node(i, host, "127.0.0.1", "lo", None) for i in range(nodes)]
            return
        ns_mod.cleanup_stale()
        self._owned.net = net = ns_mod.Network(nodes)
        self.nodes = [Node(i, f"node{i}", net.addrs[i], "eth0", net.nodes[i]) for i in range(nodes)]
        try:
            net.write_hosts([n.hostname for n in self.nodes], self._hostname_loopback)
        except BaseException:
            self.close()
            raise

    # -- the network ------------------------------------------------------------------
    @property
    def hostname_loopback(self) -> bool:
        """Whether each node's own host name resolves to 127.0.0.1 there (settable)."""
        return self._hostname_loopback

    @hostname_loopback.setter
    def hostname_loopback(self, value: bool) -> None:
        self._hostname_loopback = bool(value)
        if self.isolated:
            self._owned.net.write_hosts([n.hostname for n in self.nodes], self._hostname_loopback)

    @property
    def master_addr(self) -> str:
        """The address of node 0, which hosts the rendezvous."""
        return self.nodes[0].addr

    @property
    def interface(self) -> str:
        """The interface that joins the nodes: ``eth0`` (``lo`` on 127.0.0.1)."""
        return self.nodes[0].interface

    def port(self) -> int:
        """A rendezvous port free on every node.

        In namespaces each cluster has ports of its own, counted up from 29500
        so that no run meets the closing sockets of the one before; on
        127.0.0.1, a port the operating system reports free.
        """
        if self.isolated:
            return next(self._ports)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1]

    @contextlib.contextmanager
    def drop_traffic(self, src: int, dst: int):
        """Within the block, what node ``src`` sends to node ``dst`` is dropped, as by a firewall.

        Connections from ``src`` to ``dst`` hang, then time out (no netfilter
        needed: ``src`` learns a hardware address for ``dst`` that nobody has).

        Raises:
            RuntimeError: the nodes are not network namespaces.
        """
        if not self.isolated:
            raise RuntimeError(f"drop_traffic needs network namespaces; here every node is on 127.0.0.1 "
                               f"({self.reason})")
        with self._owned.net.drop(src, dst):
            yield

    # -- commands ---------------------------------------------------------------------
    def torchrun(self, script, *script_args, rdzv: str = "c10d", **options) -> list[list[str]]:
        """Every node's torchrun command for one job with **c10d** rendezvous (lesson 10's elastic jobs).

        Commands with static rendezvous (``--node-rank``, ``--master-addr``) are built
        elsewhere, by the code that runs them.

        Args:
            script, script_args: the training script and its arguments.
            rdzv: ``"c10d"`` (the only one).
            options: ``nproc_per_node``, ``port``, ``is_host``, ``local_addr``,
                ``rdzv_conf``, ``nnodes``, ``fork`` as in ``torchrun_commands``.

        Returns:
            One argv per node, starting with ``torchrun``.

        Raises:
            ValueError: ``rdzv`` is not ``"c10d"``.
        """
        if rdzv != "c10d":
            raise ValueError(f"rdzv={rdzv!r}: SimCluster.torchrun builds c10d commands only; static rendezvous is "
                             "lesson 07's exercise (write torchrun_command), or call "
                             "mgpu_lab.cluster.commands.torchrun_commands")
        from .commands import torchrun_commands  # here: lesson 07's notebook imports this module, not its answers

        return torchrun_commands(self, script, *script_args, rdzv="c10d", **options)

    def banner(self, timeout: float | None = None) -> str:
        """The line that says what the nodes are."""
        where = ", ".join(f"node{n.rank} {n.addr} on {n.interface}" for n in self.nodes)
        if self.isolated:
            how = f"network namespaces joined by veth links to a bridge ({where})"
        else:
            how = f"every node on 127.0.0.1, not isolated ({self.reason})"
        return f"multinode: {len(self.nodes)} simulated nodes · {how}" + (
            f" · timeout {timeout:g} s" if timeout is not None else "")

    def run(self, argv, *, env=None, timeout: float = 60.0, delays=None, after_failure: float | None = None,
            echo: bool = True, cwd=None) -> RunResult:
        """Run one command per node at once; return every node's exit code and log.

        Args:
            argv: one argv per node (a list of lists), or a function of a
                :class:`Node` that returns its argv. ``torchrun`` and ``python``
                as argv[0] mean this environment's.
            env: variables to add on every node (a dict), one dict per node (a
                list) or a function of a :class:`Node`; a value None unsets one.
            timeout: seconds after which everything still running is stopped.
            delays: when each node starts: seconds after the run starts, or
                ``"after node0"`` (once node 0 has exited). Default: all at once.
            after_failure: once a node has failed (exit code not 0), let the
                others run this many seconds more, then stop them; they would
                wait for their own, often much longer, timeouts. None: wait
                for ``timeout``.
            echo: print the banner, each node's command and its output live,
                each line prefixed ``[nodeI]``, and the summary. Tracebacks
                and C++ stack frames are folded in this view (the log keeps them).
            cwd: working directory of the commands (default: the current one).

        Returns:
            A :class:`RunResult`. Nothing started by the run is left running.

        Raises:
            ValueError: bad arguments. RuntimeError: the cluster is closed.
        """
        if self.closed:
            raise RuntimeError("this SimCluster is closed; create a new one")
        n = len(self.nodes)
        argvs = [argv(node) for node in self.nodes] if callable(argv) else list(argv)
        if len(argvs) != n or not all(isinstance(a, (list, tuple)) and a and all(isinstance(s, str) for s in a)
                                      for a in argvs):
            raise ValueError(f"argv must give one non-empty list of strings per node ({n} nodes), got {argv!r}")
        envs = [env(node) if callable(env) else (env[node.rank] if isinstance(env, (list, tuple)) else env)
                for node in self.nodes]
        starts = parse_starts(delays, n)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ValueError(f"timeout={timeout!r}: pass the seconds after which the run is stopped, e.g. 60")
        runs = [NodeRun(node, list(a), {str(k): str(v) for k, v in (e or {}).items() if v is not None})
                for node, a, e in zip(self.nodes, argvs, envs)]
        if echo:
            print(self.banner(timeout), flush=True)
            for r, when in zip(runs, starts):
                shown = "".join(f"{k}={shlex.quote(v)} " for k, v in r.env.items())
                late = f"   (starts {when:g} s late)" if isinstance(when, float) and when else (
                    f"   (starts once node{when} has exited)" if isinstance(when, int) else "")
                print(f"[node{r.node.rank}] $ {shown}{shlex.join(r.argv)}{late}", flush=True)
        # torchrun leaves a log folder (torchelastic_*) and error files in the temp dir of every run:
        # they go into one of the run's own, removed after it
        with tempfile.TemporaryDirectory(prefix="mgpu-lab-run-", ignore_cleanup_errors=True) as tmp:
            return run_nodes(runs, [{"TMPDIR": tmp, **(e or {})} for e in envs], starts, timeout=timeout,
                             after_failure=after_failure, echo=echo, cwd=cwd, net=self._owned.net,
                             owned=self._owned.procs)

    # -- lifetime ---------------------------------------------------------------------
    def close(self) -> None:
        """Kill what is left and remove the namespaces (safe to call twice; also runs at exit)."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self) -> "SimCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("network namespaces" if self.isolated else "127.0.0.1")
        return f"SimCluster({len(self.nodes)} nodes, {state})"

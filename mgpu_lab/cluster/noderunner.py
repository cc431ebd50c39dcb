"""One run on simulated nodes: start each node's command on time, relay its output, stop everything.

The machinery under :meth:`mgpu_lab.cluster.multinode.SimCluster.run`, which
checks the arguments and then hands over here. :func:`run_nodes` starts one
command per node (inside the node's network namespace and with its host name,
or on 127.0.0.1), some of them late or once another node has exited; relays
every node's output live, prefixed ``[nodeI]``, into its :class:`NodeRun` log;
and stops the run at its timeout, or soon after a node has failed. Whatever the
run started, whole process trees included, is killed before it returns, also
when it raises (see :func:`stop`).

Example:
    >>> import sys
    >>> from mgpu_lab.cluster.multinode import SimCluster
    >>> with SimCluster(2, netns=False) as cluster:   # every node on 127.0.0.1 (net=None)
    ...     runs = [NodeRun(node, [sys.executable, "-c", "print('hi')"], {}) for node in cluster.nodes]
    ...     result = run_nodes(runs, [{}, {}], parse_starts([0, "after node0"], 2), timeout=30,
    ...                        after_failure=None, echo=True, cwd=None, net=None, owned=set())
    [node0] hi
    [node1] hi
    OK: 2 nodes in ... s
      node0 (127.0.0.1): exit code 0 after ... s
      node1 (127.0.0.1): exit code 0 after ... s
"""
from __future__ import annotations

import contextlib
import os
import re
import selectors
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil

from mgpu_lab.core import procenv

from . import agents, netns
from .nodelogs import NOISE, Condense, NodeRun, RunResult

__all__ = ["run_nodes", "parse_starts", "environment", "spawn", "stop"]

# Besides the rank variables (procenv), a node must not inherit these from the notebook: each run says what it wants.
_NODE_OWN = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "NCCL_DEBUG", "NCCL_DEBUG_SUBSYS")


def parse_starts(delays, n: int) -> list:
    """Each of ``n`` nodes' start: a float (seconds) or an int (the node whose exit it waits for).

    Args:
        delays: None (all at once), or one per node: seconds >= 0 or ``"after nodeJ"``.
        n: the number of nodes.

    Raises:
        ValueError: a bad ``delays``, with what each entry may be.
    """
    delays = [0.0] * n if delays is None else list(delays)
    out = []
    for i, d in enumerate(delays):
        match = re.fullmatch(r"after node(\d+)", d) if isinstance(d, str) else None
        if match and int(match.group(1)) < n and int(match.group(1)) != i:
            out.append(int(match.group(1)))
        elif isinstance(d, (int, float)) and not isinstance(d, bool) and d >= 0:
            out.append(float(d))
        else:
            out = None
            break
    if out is None or len(out) != n:
        raise ValueError(f"delays={delays!r}: give one per node ({n}), each seconds >= 0 or "
                         "'after nodeJ' (start once node J has exited)")
    return out


def environment(extra: dict) -> dict[str, str]:
    """A node's environment: this one without rank variables, this Python's first on PATH, then ``extra``."""
    return procenv.child_env({**dict.fromkeys(_NODE_OWN), **extra}, python_first=True)


def spawn(run: NodeRun, env: dict, cwd, net: netns.Network | None) -> subprocess.Popen | agents.Agent:
    """Start one node's command, in its namespace under its host name when ``net`` is given.

    ``torchrun`` is forked from an :class:`~mgpu_lab.cluster.agents.AgentServer`
    (the same torchrun, without importing torch again) where the environment allows it.
    """
    full = environment(env)
    if run.argv[0] == "torchrun" and (srv := agents.server(environment({}))) is not None and srv.fits(full):
        return srv.start(run.argv, full, cwd, net.nodes[run.node.rank] if net is not None else None,
                         run.node.hostname if net is not None else None)
    argv = list(run.argv)
    if argv[0] == "torchrun":
        local = Path(sys.executable).with_name("torchrun")
        argv[0] = str(local) if local.exists() else (shutil.which("torchrun") or "torchrun")
    elif argv[0] in ("python", "python3"):
        argv[0] = sys.executable
    if net is not None:
        own_host_name = [sys.executable, "-m", "mgpu_lab.core.libc", run.node.hostname]
        argv = [*net.exec_prefix(run.node.rank), *own_host_name, *argv]
    try:
        return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=full, cwd=cwd, start_new_session=True)
    except OSError as exc:  # the node says what a shell would, and exits 127, as it does inside a namespace
        said = f"{argv[0]}: {exc.strerror}"
        exit_127 = "import sys; print(sys.argv[1], file=sys.stderr); sys.exit(127)"
        return subprocess.Popen([sys.executable, "-c", exit_127, said],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)


def run_nodes(runs: list[NodeRun], envs: list[dict], starts: list, *, timeout: float, after_failure: float | None,
              echo: bool, cwd, net: netns.Network | None, owned: set[psutil.Process]) -> RunResult:
    """Run every node's command until all have exited, the timeout, or ``after_failure`` s after a failure.

    Args:
        runs: one :class:`NodeRun` per node, filled in as the run goes.
        envs: each node's variables to add (a value None unsets one).
        starts: each node's start, as :func:`parse_starts` returns it.
        timeout, after_failure, echo, cwd: as :meth:`SimCluster.run` takes them.
        net: the nodes' namespaces, or None when every node is on 127.0.0.1.
        owned: the cluster's set of processes to kill when it closes; every
            process of the run is in it while the run goes, so that a run
            interrupted in any way leaves nothing behind.

    Returns:
        The :class:`RunResult`. Nothing started by the run is left running.
    """
    job = _Job(runs, envs, starts, timeout, after_failure, echo, cwd, net, owned)
    try:
        while job.step():
            pass
    finally:
        job.close()
    result = job.result()
    if echo:
        print(result.summary(), flush=True)
    return result


class _Job:
    """The state of one :func:`run_nodes`: the nodes' processes, their output, the deadline."""

    def __init__(self, runs, envs, starts, timeout, after_failure, echo, cwd, net, owned):
        self.runs, self.envs, self.starts, self.timeout = runs, envs, starts, timeout
        self.after_failure, self.echo, self.cwd, self.net, self.owned = after_failure, echo, cwd, net, owned
        self.sel = selectors.DefaultSelector()
        self.procs: dict[int, subprocess.Popen] = {}
        self.began: dict[int, float] = {}
        self.ended: dict[int, float] = {}
        self.family: set[psutil.Process] = set()
        self.partial = {i: b"" for i in range(len(runs))}
        self.condense = [Condense() for _ in runs]
        self.t0 = time.monotonic()
        self.deadline, self.stopped, self.all_done_at = self.t0 + timeout, f"at the {timeout:g} s timeout", None

    def emit(self, i: int, data: bytes, final: bool = False) -> None:
        *complete, self.partial[i] = (self.partial[i] + data).split(b"\n")
        if final and self.partial[i]:
            complete, self.partial[i] = complete + [self.partial[i]], b""
        for raw in complete:
            line = raw.decode(errors="replace").rstrip("\r")
            self.runs[i].lines.append(line)
            if self.echo and not NOISE.search(line):
                for shown in self.condense[i](line):
                    print(f"[node{i}] {shown}", flush=True)

    def adopt(self, pid: int, recursive: bool) -> None:
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(pid)
            found = set(root.children(recursive=True)) if recursive else {root}
            self.family.update(found)
            self.owned.update(found)

    def start_due(self, now: float) -> None:
        for i, run in enumerate(self.runs):
            when = self.starts[i]
            due = now - self.t0 >= when if isinstance(when, float) else when in self.ended
            if i not in self.procs and due:
                self.procs[i] = proc = spawn(run, self.envs[i], self.cwd, self.net)
                self.began[i], run.started = now, True
                self.adopt(proc.pid, recursive=False)
                os.set_blocking(proc.stdout.fileno(), False)
                self.sel.register(proc.stdout, selectors.EVENT_READ, i)

    def reap(self, now: float) -> None:
        for i, proc in self.procs.items():
            if proc.poll() is None:
                self.adopt(proc.pid, recursive=True)  # torchrun's workers run in sessions of their own
            elif i not in self.ended:
                self.ended[i] = now
                self.runs[i].returncode, self.runs[i].seconds = proc.returncode, now - self.began[i]

    def step(self) -> bool:
        """Start, reap and read once (waiting at most 0.2 s); False when the run is over."""
        now = time.monotonic()
        self.start_due(now)
        self.reap(now)
        if len(self.ended) == len(self.runs):
            self.stopped = ""
            self.all_done_at = self.all_done_at or now
            if not self.sel.get_map() or now - self.all_done_at > 2.0:  # a pipe held by an orphan
                return False
        elif now >= self.deadline:
            return False
        failed = sorted((self.ended[i], i) for i, r in enumerate(self.runs) if r.returncode)
        if self.after_failure is not None and failed and failed[0][0] + self.after_failure < self.deadline:
            self.deadline = failed[0][0] + self.after_failure
            self.stopped = f"{self.after_failure:g} s after node{failed[0][1]} failed"
        pending = [self.t0 + w for i, w in enumerate(self.starts) if i not in self.procs and isinstance(w, float)]
        wait = max(0.0, min([self.deadline, now + 0.2, *pending]) - now)
        if not self.sel.get_map():
            time.sleep(wait)
        for key, _ in self.sel.select(wait) if self.sel.get_map() else ():
            with contextlib.suppress(BlockingIOError):
                data = os.read(key.fileobj.fileno(), 65536)
                if data:
                    self.emit(key.data, data)
                else:
                    self.sel.unregister(key.fileobj)
        return True

    def close(self) -> None:
        """Stop what is left, and read what the pipes still hold."""
        stop(self.procs, self.family, self.net, self.owned)
        for key in list(self.sel.get_map().values()):
            with contextlib.suppress(OSError):
                while data := os.read(key.fileobj.fileno(), 65536):
                    self.emit(key.data, data)
            self.sel.unregister(key.fileobj)
        for i, proc in self.procs.items():
            self.emit(i, b"", final=True)
            proc.stdout.close()
        self.sel.close()

    def result(self) -> RunResult:
        end = time.monotonic()
        for i, run in enumerate(self.runs):
            if run.returncode is None:
                run.seconds, run.stopped = (end - self.began[i] if i in self.began else 0.0), self.stopped
        return RunResult(self.runs, self.timeout, end - self.t0, self.net is not None, self.stopped)


def stop(procs: dict, family: set, net: netns.Network | None, owned: set) -> None:
    """Kill what is left of a run: every process tree, then whatever is still in the namespaces."""
    for proc in procs.values():
        with contextlib.suppress(psutil.Error):
            family |= set(psutil.Process(proc.pid).children(recursive=True))
    netns.kill(family)
    if net is not None:
        net.sweep()
    for proc in procs.values():
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
    owned.difference_update(family)

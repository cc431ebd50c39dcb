"""Linux network namespaces for simulated nodes: create, join, break and remove them.

The plumbing under :class:`mgpu_lab.cluster.multinode.SimCluster`. One cluster is a
"switch" namespace holding a bridge, and one namespace per node joined to the
bridge by a veth link. Node ``i`` has the address ``10.213.7.<i+1>/24`` on its
``eth0`` and its own ``/etc/hosts`` (``ip netns exec`` mounts
``/etc/netns/<name>/hosts`` over ``/etc/hosts``). Every node also gets a
``docker0`` interface with the same address on every node, linked to nothing:
as on real machines that run Docker, the interface a job must not pick. The
machine's own network (the root namespace) is never touched.

Namespace names carry the creating process id (``mgpu<pid>c<k>s`` for the
switch, ``mgpu<pid>c<k>n<i>`` for node ``i``), so :func:`cleanup_stale` can
remove what a killed process left behind.

Example:
    >>> from mgpu_lab.cluster import netns
    >>> netns.problem()                       # as root on Linux: nothing stands in the way
    ''
    >>> net = netns.Network(2)
    >>> net.nodes                             # e.g. ['mgpu4242c0n0', 'mgpu4242c0n1']
    ['mgpu...n0', 'mgpu...n1']
    >>> net.remove()
"""
from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psutil

__all__ = ["SUBNET", "DECOY", "problem", "names", "cleanup_stale", "processes", "kill", "Network"]

SUBNET = "10.213.7"  # the one private /24 of these namespaces: node i is 10.213.7.(i+1)
DECOY = ("docker0", f"{SUBNET}.254")  # on every node, same address: the wrong interface to pick
PREFIX = "mgpu"
NAME = re.compile(rf"^{PREFIX}(\d+)c(\d+)(s|n\d+)$")
ETC = Path("/etc/netns")
BOGUS_MAC = "02:00:00:00:de:ad"  # a hardware address no node has: frames sent to it vanish
_counter = itertools.count()
_problem: str | None = None


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``ip ARGS``; RuntimeError with its message when it fails and ``check``."""
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode:
        raise RuntimeError(f"`ip {' '.join(args)}` failed with exit code {proc.returncode}: "
                           f"{proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def problem() -> str:
    """Why simulated nodes cannot be network namespaces here; ``""`` when they can.

    Needs Linux, root (CAP_NET_ADMIN) and iproute2's ``ip``; found out once by
    creating a namespace with a veth link and a bridge and removing it.
    ``MGPU_LAB_NETNS=0`` asks for the 127.0.0.1 fallback.
    """
    global _problem
    if os.environ.get("MGPU_LAB_NETNS") == "0":
        return "MGPU_LAB_NETNS=0 asks for every node on 127.0.0.1"
    if _problem is None:
        _problem = _probe()
    return _problem


def _probe() -> str:
    if not sys.platform.startswith("linux"):
        return f"network namespaces are Linux only (this is {sys.platform})"
    if os.geteuid() != 0:
        return "not root: creating network namespaces needs CAP_NET_ADMIN"
    if shutil.which("ip") is None:
        return "iproute2's `ip` command is not installed (apt-get install iproute2)"
    name = f"{PREFIX}{os.getpid()}c{next(_counter)}s"
    try:
        ip("netns", "add", name)
        ip("-n", name, "link", "add", "mgpua", "type", "veth", "peer", "name", "mgpub")
        ip("-n", name, "link", "add", "br0", "type", "bridge")
    except (RuntimeError, OSError, subprocess.SubprocessError) as err:
        return f"cannot create a network namespace with veth links and a bridge: {err}"
    finally:
        ip("netns", "del", name, check=False)
    return ""


def names() -> list[str]:
    """The network namespaces mgpu_lab created (any process) that still exist."""
    if shutil.which("ip") is None:
        return []
    listed = ip("netns", "list", check=False).stdout.splitlines()
    return [line.split()[0] for line in listed if line.strip() and NAME.match(line.split()[0])]


def processes(name: str) -> list[psutil.Process]:
    """The processes inside namespace ``name``."""
    found = []
    for pid in ip("netns", "pids", name, check=False).stdout.split():
        with contextlib.suppress(psutil.Error, ValueError):
            found.append(psutil.Process(int(pid)))
    return found


def kill(procs) -> None:
    """SIGKILL these processes (psutil objects, checked against pid reuse) and reap them."""
    alive = []
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            if proc.is_running():
                proc.send_signal(signal.SIGKILL)
                alive.append(proc)
    psutil.wait_procs(alive, timeout=5)


def _remove(name: str) -> None:
    kill(processes(name))
    ip("netns", "del", name, check=False)
    shutil.rmtree(ETC / name, ignore_errors=True)


def cleanup_stale() -> list[str]:
    """Remove the namespaces (with their processes and hosts files) of dead creators.

    A process that was killed (a kernel restart, ``kill -9``) cannot clean up;
    its namespaces are removed here once its pid no longer exists. Namespaces
    of living processes, and every namespace not named ``mgpu<pid>c<k>...``,
    are left alone.

    Returns:
        The names removed.
    """
    found = set(names())
    if ETC.is_dir():
        found |= {p.name for p in ETC.iterdir() if NAME.match(p.name)}
    removed = []
    for name in sorted(found):
        pid = int(NAME.match(name).group(1))
        if pid != os.getpid() and not psutil.pid_exists(pid):
            _remove(name)
            removed.append(name)
    return removed


class Network:
    """A switch namespace with a bridge and ``nodes`` node namespaces linked to it.

    Args:
        nodes: how many node namespaces.

    Attributes:
        switch: the switch namespace's name.
        nodes: the node namespaces' names, node ``i`` at ``addrs[i]`` on ``eth0``.
        addrs: ``10.213.7.<i+1>``.

    Raises:
        RuntimeError: an ``ip`` command failed; what was created is removed.
    """

    def __init__(self, nodes: int):
        base = f"{PREFIX}{os.getpid()}c{next(_counter)}"
        self.switch = f"{base}s"
        self.nodes = [f"{base}n{i}" for i in range(nodes)]
        self.addrs = [f"{SUBNET}.{i + 1}" for i in range(nodes)]
        self._created: list[str] = []
        self._lock = threading.Lock()
        try:
            self._create()
        except BaseException:
            self.remove()
            raise

    def _create(self) -> None:
        sw = self.switch
        ip("netns", "add", sw)
        self._created.append(sw)
        ip("-n", sw, "link", "add", "br0", "type", "bridge")
        ip("-n", sw, "link", "set", "br0", "up")
        for i, (ns, addr) in enumerate(zip(self.nodes, self.addrs)):
            ip("netns", "add", ns)
            self._created.append(ns)
            ip("-n", sw, "link", "add", f"n{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            ip("-n", sw, "link", "set", f"n{i}", "master", "br0", "up")
            ip("-n", sw, "link", "add", f"d{i}", "type", "veth", "peer", "name", DECOY[0], "netns", ns)
            ip("-n", sw, "link", "set", f"d{i}", "up")  # not on the bridge: a link to nowhere
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            ip("-n", ns, "addr", "add", f"{DECOY[1]}/32", "dev", DECOY[0])
            for dev in ("lo", "eth0", DECOY[0]):
                ip("-n", ns, "link", "set", dev, "up")

    def write_hosts(self, hostnames: list[str], loopback_self: bool) -> None:
        """Give every node an ``/etc/hosts`` naming every node.

        Args:
            hostnames: node ``i``'s host name.
            loopback_self: map each node's own name to 127.0.0.1 there, as
                this machine's and many cloud images' ``/etc/hosts`` do.
        """
        for ns, own in zip(self.nodes, hostnames):
            lines = ["# written by mgpu_lab.cluster.netns for one simulated node", "127.0.0.1 localhost"]
            lines += [f"{'127.0.0.1' if name == own and loopback_self else addr} {name}"
                      for name, addr in zip(hostnames, self.addrs)]
            (ETC / ns).mkdir(parents=True, exist_ok=True)
            (ETC / ns / "hosts").write_text("\n".join(lines) + "\n")

    @contextlib.contextmanager
    def drop(self, src: int, dst: int):
        """Within the block, node ``src``'s packets to node ``dst`` vanish.

        What a firewall that drops packets does, without netfilter: ``src``
        believes ``dst``'s address belongs to a hardware address nobody has.
        """
        ns = self.nodes[src]
        ip("-n", ns, "neigh", "replace", self.addrs[dst], "lladdr", BOGUS_MAC, "dev", "eth0", "nud", "permanent")
        try:
            yield
        finally:
            ip("-n", ns, "neigh", "del", self.addrs[dst], "dev", "eth0", check=False)

    def exec_prefix(self, node: int) -> list[str]:
        """The argv prefix that runs a command inside node ``node``'s namespace."""
        return ["ip", "netns", "exec", self.nodes[node]]

    def sweep(self) -> None:
        """Kill every process still inside the node namespaces."""
        for ns in self.nodes:
            if ns in self._created:
                kill(processes(ns))

    def remove(self) -> None:
        """Kill the processes inside, delete the namespaces and hosts files (safe twice)."""
        with self._lock:
            for name in reversed(self._created):
                _remove(name)
            self._created.clear()

    @property
    def alive(self) -> bool:
        return bool(self._created)

"""A real SLURM cluster on this one machine: ``slurmctld``, one ``slurmd`` per node, ``munged``.

Lesson 07 explains an sbatch script line by line; this runs it for real.
:func:`up` starts Debian's SLURM (``slurm-wlm``) and ``munge`` as a small
cluster: a login/controller node ``ctl`` and compute nodes ``node0``,
``node1``, ... Every node is a Linux network namespace of its own (entered with
``nsenter --net``: ``ip netns exec`` would remount ``/sys``), joined to the
others by veth links to a bridge in a switch namespace, with its own host name
(a UTS namespace) and its own view of ``/etc/hosts`` (a file of this cluster's,
bind-mounted in a mount namespace of the node). The machine's own network
configuration and its ``/etc/hosts`` are never touched: every interface lives
in the cluster's namespaces, every file in the state folder.

The client commands (``sbatch``, ``squeue``, ``scontrol``, ``scancel``, ...)
run on the login node through :func:`run` (or ``mgpu-lab slurm run -- sbatch
job.sh``), as on a cluster where you log in to submit. Jobs run as the
submitting user (root here) with the submitter's environment, so the virtual
environment's ``torchrun`` is found.

:func:`down` stops everything and removes it (daemons, jobs, namespaces and
their links, the state folder), also after a crash: it finds what to remove
by the namespaces' names and the processes inside them, not only by what
:func:`up` wrote down. Needs Linux, root, ``ip``, ``nsenter``, ``unshare`` and
the packages ``slurm-wlm`` and ``munge``; :func:`problem` says what is missing.

Example:
    >>> import os, tempfile
    >>> from mgpu_lab.cluster import slurm_local
    >>> state = os.path.join(tempfile.mkdtemp(), "slurm")   # default: the one cluster `mgpu-lab slurm` manages
    >>> cluster = slurm_local.up(nodes=2, state=state)
    slurm: 2 nodes up (node0 node1) + login node ctl; ...
    >>> sorted(slurm_local.run(["srun", "--nodes=2", "hostname"], state=state).stdout.split())
    ['node0', 'node1']
    >>> "namespace mgpuslurm-node0" in slurm_local.down(state, quiet=True)   # everything it made, removed
    True
"""
from __future__ import annotations

import os
import platform
import secrets
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from . import netns

__all__ = ["problem", "up", "down", "run", "status", "Cluster", "STATE", "PREFIX"]

#: Where the cluster keeps its configuration, keys, spool folders and logs.
STATE = Path(os.environ.get("MGPU_LAB_SLURM_STATE", "/tmp/mgpu-lab-slurm"))
#: Namespace names: ``mgpuslurm-sw`` (the switch), ``mgpuslurm-ctl``, ``mgpuslurm-node0``, ...
PREFIX = "mgpuslurm-"
SUBNET = "10.214.0"
CTL_ADDR = f"{SUBNET}.1"
MAX_NODES = 8
PACKAGES = {"slurmctld": "slurm-wlm", "slurmd": "slurm-wlm", "sbatch": "slurm-wlm", "scontrol": "slurm-wlm",
            "munged": "munge", "nsenter": "util-linux", "unshare": "util-linux", "ip": "iproute2"}


@dataclass(frozen=True)
class Cluster:
    """A running local cluster: its nodes, state folder and configuration file."""

    nodes: tuple[str, ...]
    state: Path

    @property
    def conf(self) -> Path:
        return self.state / "slurm.conf"

    def banner(self) -> str:
        return (f"slurm: {len(self.nodes)} nodes up ({' '.join(self.nodes)}) + login node ctl; "
                f"each node a network namespace on {SUBNET}.0/24 (this machine's own network untouched); "
                f"{os.cpu_count()} CPU cores shared, no GPU (gres none); state and logs in {self.state}")


def problem() -> str:
    """Why a local cluster cannot start here ("" when it can)."""
    if platform.system() != "Linux":
        return f"a local SLURM cluster needs Linux (network namespaces); this is {platform.system()}"
    if os.geteuid() != 0:
        return "a local SLURM cluster needs root (it creates network namespaces and starts slurmd as root)"
    missing = sorted({PACKAGES[b] for b in PACKAGES if shutil.which(b) is None})
    if missing:
        return (f"missing {', '.join(missing)}: install with `apt-get install {' '.join(missing)}` "
                "(Debian/Ubuntu; the course uses Debian's slurm-wlm and munge)")
    return netns.problem()


def _ns(name: str) -> str:
    return PREFIX + name


def _sh(*argv: str) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"slurm: `{' '.join(argv)}` failed (exit {proc.returncode}): {proc.stderr.strip()}")


def _enter(node: str, state: Path) -> list[str]:
    """argv prefix: run in ``node``'s network namespace, with its host name and its /etc/hosts."""
    return ["nsenter", f"--net=/run/netns/{_ns(node)}", "unshare", "--mount", "--uts", "--propagation", "private",
            "sh", "-c", f'mount --bind "{state}/hosts" /etc/hosts && hostname "$0" && exec "$@"', node]


def _conf(state: Path, nodes: list[str]) -> str:
    cpus = os.cpu_count() or 1
    node_lines = [f"NodeName={n} NodeAddr={SUBNET}.{10 + i} CPUs={cpus} RealMemory=1024 State=UNKNOWN"
                  for i, n in enumerate(nodes)]
    return "\n".join([
        "# written by mgpu_lab.cluster.slurm_local: a cluster of network namespaces on one machine",
        "ClusterName=mgpulab", f"SlurmctldHost=ctl({CTL_ADDR})", "SlurmUser=root",
        "AuthType=auth/munge", f"AuthInfo=socket={state}/munge.socket", "CredType=cred/munge",
        f"StateSaveLocation={state}/ctld", f"SlurmdSpoolDir={state}/spool/%n",
        f"SlurmctldPidFile={state}/slurmctld.pid", f"SlurmdPidFile={state}/slurmd-%n.pid",
        f"SlurmctldLogFile={state}/log/slurmctld.log", f"SlurmdLogFile={state}/log/slurmd-%n.log",
        # every node claims the machine's cores: they are shared, as the banner says
        "SlurmdParameters=config_overrides",
        # no cgroup plugins: the nodes share one machine's cgroup tree
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
        "SchedulerType=sched/backfill", "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
        # a batch job starts as soon as it can, not up to 3 s later (the default delay is for clusters that
        # take in thousands of jobs a minute)
        "SchedulerParameters=batch_sched_delay=0",
        "ReturnToService=2", "MpiDefault=none", "JobCompType=jobcomp/none",
        # no slurmdbd: `scontrol show job` keeps finished jobs for MinJobAge seconds instead of sacct
        "AccountingStorageType=accounting_storage/none", "MinJobAge=3600",
        *node_lines, "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP", ""])


def _network(names: list[str]) -> None:
    _sh("ip", "netns", "add", _ns("sw"))
    _sh("ip", "-n", _ns("sw"), "link", "add", "br0", "type", "bridge")
    for dev in ("br0", "lo"):
        _sh("ip", "-n", _ns("sw"), "link", "set", dev, "up")
    for i, name in enumerate(names):
        addr = CTL_ADDR if name == "ctl" else f"{SUBNET}.{10 + i - 1}"
        _sh("ip", "netns", "add", _ns(name))
        # both ends are made inside the switch namespace: nothing appears in the machine's own
        _sh("ip", "-n", _ns("sw"), "link", "add", f"p{i}", "type", "veth", "peer", "name", "eth0",
            "netns", _ns(name))
        _sh("ip", "-n", _ns("sw"), "link", "set", f"p{i}", "master", "br0", "up")
        _sh("ip", "-n", _ns(name), "addr", "add", f"{addr}/24", "dev", "eth0")
        for dev in ("eth0", "lo"):
            _sh("ip", "-n", _ns(name), "link", "set", dev, "up")


def up(nodes: int = 2, state: Path | str = STATE, timeout: float = 30.0, echo: bool = True) -> Cluster:
    """Start a cluster of ``nodes`` compute nodes and wait until every node is idle.

    Raises:
        RuntimeError: it cannot start here (what is missing and how to get it), one is
            already up (run :func:`down` first), or the nodes did not come up in time
            (with the tail of the daemons' logs). What was started is removed again.
        ValueError: ``nodes`` outside 1..8.
    """
    if isinstance(nodes, bool) or not isinstance(nodes, int) or not 1 <= nodes <= MAX_NODES:
        raise ValueError(f"nodes={nodes!r}: a local cluster has 1 to {MAX_NODES} nodes, e.g. nodes=2")
    why = problem()
    if why:
        raise RuntimeError(f"slurm: cannot start a local cluster: {why}")
    state = Path(state)
    if _leftovers(state):
        raise RuntimeError(f"slurm: a local cluster is already up (or left over): {', '.join(_leftovers(state))}; "
                           "run `mgpu-lab slurm down` first")
    names = [f"node{i}" for i in range(nodes)]
    try:
        for sub in ("ctld", "log", *(f"spool/{n}" for n in names)):
            (state / sub).mkdir(parents=True, exist_ok=True)
        key = state / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o400)
        (state / "hosts").write_text("127.0.0.1 localhost\n" + f"{CTL_ADDR} ctl\n"
                                     + "".join(f"{SUBNET}.{10 + i} {n}\n" for i, n in enumerate(names)))
        (state / "slurm.conf").write_text(_conf(state, names))
        _sh("munged", "--force", f"--key-file={key}", f"--socket={state}/munge.socket",
            f"--pid-file={state}/munged.pid", f"--log-file={state}/log/munged.log", f"--seed-file={state}/munge.seed")
        _network(["ctl", *names])
        env = _env(state)
        # the daemons fork into the background; their namespaces live as long as they do
        subprocess.run([*_enter("ctl", state), "slurmctld"], env=env, check=True, capture_output=True)
        for n in names:
            subprocess.run([*_enter(n, state), "slurmd", "-N", n], env=env, check=True, capture_output=True)
        _wait_idle(state, nodes, timeout)
    except BaseException:
        down(state, quiet=True)
        raise
    cluster = Cluster(tuple(names), state)
    if echo:
        print(cluster.banner(), flush=True)
    return cluster


def _env(state: Path, extra: dict | None = None) -> dict[str, str]:
    env = {**os.environ, **(extra or {}), "SLURM_CONF": str(state / "slurm.conf")}
    # jobs inherit the submitter's environment: put this interpreter's torchrun first
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def _wait_idle(state: Path, nodes: int, timeout: float) -> None:
    deadline, states = time.monotonic() + timeout, ""
    while time.monotonic() < deadline:
        states = run(["sinfo", "-h", "-N", "-o", "%N %T"], state=state, check=False).stdout
        if states.count("idle") == nodes:
            return
        time.sleep(0.3)
    logs = "\n".join(f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-8:])
                     for p in sorted((state / "log").glob("*.log")))
    raise RuntimeError(f"slurm: the nodes were not idle after {timeout:g} s (sinfo: {states.strip() or 'nothing'})\n"
                       + logs)


def run(argv, state: Path | str = STATE, cwd=None, env: dict | None = None, timeout: float | None = 300,
        check: bool = True) -> subprocess.CompletedProcess:
    """Run a SLURM client command (``sbatch``, ``squeue``, ...) on the login node ``ctl``.

    Raises:
        RuntimeError: no cluster is up, or (``check``) the command failed, with its output.
    """
    state = Path(state)
    if not (state / "slurm.conf").is_file() or not Path(f"/run/netns/{_ns('ctl')}").exists():
        raise RuntimeError("slurm: no local cluster is up; start one with `mgpu-lab slurm up` "
                           "(or mgpu_lab.cluster.slurm_local.up())")
    argv = [str(a) for a in argv]
    proc = subprocess.run(["nsenter", f"--net=/run/netns/{_ns('ctl')}", *argv], cwd=cwd, env=_env(state, env),
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"slurm: `{' '.join(argv)}` failed (exit {proc.returncode}): "
                           f"{(proc.stderr or proc.stdout).strip()}")
    return proc


def status(state: Path | str = STATE) -> str:
    """``sinfo`` of the running cluster, or why there is none."""
    try:
        return run(["sinfo", "-N", "-l"], state=state).stdout
    except RuntimeError as err:
        return str(err)


def _namespaces() -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.splitlines()
    return [line.split()[0] for line in listed if line.split() and line.split()[0].startswith(PREFIX)]


def _daemons(state: Path) -> list[psutil.Process]:
    """munged/slurmctld/slurmd/slurmstepd of this cluster, found by their command lines and state folder."""
    found = []
    for proc in psutil.process_iter(["name", "cmdline", "environ"]):
        try:
            cmd = " ".join(proc.info["cmdline"] or [])
            if proc.info["name"] in ("munged", "slurmctld", "slurmd", "slurmstepd") and (
                    str(state) in cmd or str(state) in (proc.info["environ"] or {}).get("SLURM_CONF", "")):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def _leftovers(state: Path) -> list[str]:
    return _namespaces() + [f"{p.info['name']} (pid {p.pid})" for p in _daemons(state)] + (
        [str(state)] if state.exists() else [])


def down(state: Path | str = STATE, quiet: bool = False) -> list[str]:
    """Stop the cluster and remove everything it made; safe to call after a crash, and twice.

    Returns:
        What was removed (namespaces, processes, the state folder).
    """
    state = Path(state)
    removed = []
    victims = _daemons(state)
    if shutil.which("ip"):
        for name in _namespaces():
            victims += netns.processes(name)  # jobs and steps still running inside the nodes
    for proc in {p.pid: p for p in victims}.values():
        removed.append(f"process {proc.pid}")
    netns.kill(list({p.pid: p for p in victims}.values()))
    if shutil.which("ip"):
        for name in _namespaces():
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            removed.append(f"namespace {name}")
    if state.exists():
        shutil.rmtree(state, ignore_errors=True)
        removed.append(str(state))
    if not quiet:
        print("slurm: " + (f"removed {len(removed)} things: " + ", ".join(removed) if removed else "nothing was up"),
              flush=True)
    return removed

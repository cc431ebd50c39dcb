"""Lesson 07's troubleshooting table, reproduced live on simulated nodes.

Each :class:`Fault` is one way a multi-node job goes wrong on a cluster: how
it is set up on :class:`~mgpu_lab.cluster.multinode.SimCluster` nodes, what it takes
on a cluster with the default timeouts, and its fix. :func:`reproduce` runs
faults (each on two fresh simulated nodes, several at once), with timeouts of
a few seconds instead of the defaults' minutes, so that every run ends with
the message a cluster would print, and ``fixed=True`` runs the same job with
the fix applied.

Example:
    >>> from mgpu_lab.cluster.troubleshoot import reproduce
    >>> runs = reproduce(["blocked_port"])   # needs root: the nodes are network namespaces
    troubleshoot: 1 job(s) at once, each on 2 simulated nodes of its own, ...
    blocked port: FAILED after ... s here; a cluster waits 15 min (static rendezvous timeout)
    ...
      [node0] torch.distributed.DistStoreError: Timed out after 5 seconds waiting for clients. 1/2 clients joined.
    ...
    >>> [(run.fault.key, run.as_expected) for run in runs]
    [('blocked_port', True)]
"""
from __future__ import annotations

import contextlib
import re
import threading
from dataclasses import dataclass

from .multinode import PROBE_SCRIPT, SimCluster
from .nodelogs import LOG_PREFIX, RunResult

__all__ = ["Fault", "FAULTS", "TABLE", "TRAPS", "SAME_FIX", "FaultRun", "reproduce", "setup"]

PG_TIMEOUT = 3      # seconds a rank waits for the others (the script's --timeout), default 30 min
RDZV_TIMEOUT = 4    # seconds torchrun's rendezvous waits, default 15 min (static) / 10 min (c10d)
AFTER_FAILURE = 3   # seconds the other nodes may go on once one has failed
RUN_TIMEOUT = 120   # the bound on every run, start-up included (a loaded machine needs minutes to start 16 torchruns)


@dataclass(frozen=True)
class Fault:
    """One row of the troubleshooting table (or one trap).

    Attributes:
        key: its name in :data:`FAULTS`.
        title: the row's name.
        cause: what goes wrong, in words.
        fix: what to change.
        cluster_wait: how long a cluster waits before saying anything, with the defaults.
        evidence: a regex for the log line that names the fault (shown first in reports).
    """

    key: str
    title: str
    cause: str
    fix: str
    cluster_wait: str
    evidence: str


FAULTS = {f.key: f for f in [
    Fault("wrong_interface", "wrong interface",
          "NCCL/gloo are told to use docker0, which every node has with the same address: each rank "
          "advertises an address that, from any other node, is that node itself",
          "NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME = the interface that joins the nodes (here eth0; "
          "`ip -br addr` on a node lists them)",
          "30 min (gloo's process-group timeout; NCCL's is 10 min)",
          "Gloo connectFullMesh failed .*remote=\\[10\\.213\\.7\\.254\\]"),
    Fault("hostname_loopback", "host name resolving to 127.0.0.1",
          "without GLOO_SOCKET_IFNAME gloo binds to the address of the node's own host name, and "
          "/etc/hosts maps that to 127.0.0.1: the other node connects to its own loopback",
          "GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME) = the node's interface, or fix /etc/hosts so "
          "the host name resolves to the node's real address",
          "30 min (gloo's process-group timeout)",
          "Gloo connectFullMesh failed .*remote=\\[127\\.0\\.0\\.1\\]"),
    Fault("blocked_port", "blocked port",
          "a firewall drops node 1's packets to node 0, so node 1 never reaches MASTER_ADDR:MASTER_PORT",
          "open MASTER_PORT (and, for NCCL and gloo, the ephemeral ports) between the nodes, or pick a "
          "port that is open",
          "15 min (static rendezvous timeout)",
          "trying to connect to \\(10\\.213\\.7\\.1, \\d+\\)|1/2 clients joined"),
    Fault("world_size_mismatch", "mismatched world size",
          "--nnodes=3 on every node, but only 2 nodes were started: node 0 waits for a third",
          "--nnodes = the number of nodes started ($SLURM_JOB_NUM_NODES under SLURM), or an elastic "
          "range --nnodes=2:3 with c10d rendezvous",
          "15 min (static rendezvous timeout)",
          "Timed out after \\d+ seconds waiting for clients\\. 2/3 clients joined"),
    Fault("late_node", "one node started late",
          "node 1 starts only after node 0 has given up waiting for it",
          "start every node together (srun does), and give the rendezvous a timeout longer than the "
          "spread of start times (the defaults, 15 min static / 10 min c10d, are)",
          "15 min (static rendezvous timeout), then node 1 waits again",
          "1/2 clients joined|trying to connect to \\(10\\.213\\.7\\.1, \\d+\\)"),
    Fault("c10d_no_is_host", "c10d: no node hosts the store",
          "the rendezvous endpoint is an address; node 0 compares it with what its host name resolves to "
          "(127.0.0.1), concludes it is not the host, and every node waits for a store nobody runs",
          "--rdzv-conf=is_host=1 on the node whose address is the endpoint (is_host=0 elsewhere)",
          "2 min (2 x read_timeout of 60 s), then the job fails",
          "RendezvousConnectionError: The connection to the C10d store has failed"),
    Fault("c10d_no_local_addr", "c10d: workers told MASTER_ADDR=localhost",
          "without --local-addr node 0 publishes socket.getfqdn(), which is 'localhost' when its host "
          "name resolves to 127.0.0.1; node 1's ranks then look for node 0 on their own loopback",
          "--local-addr=<this node's address> on every node",
          "30 min (gloo's process-group timeout)",
          "trying to connect to \\(localhost, \\d+\\)"),
    Fault("exit_barrier", "a rank aborts after destroy_process_group",
          "node 1's rank dies after its work is done; node 1's torchrun fails at once, but node 0's "
          "torchrun waits in its exit barrier for node 1's torchrun, which never comes",
          "bound every job by a time limit (SLURM's --time, a timeout here); find why the rank "
          "aborted in node 1's log",
          "5 min (torchrun's exit barrier)",
          "Waiting 300 seconds for other agents to finish$|SIGABRT"),
]}
#: The troubleshooting table of the lesson, and the traps measured on the simulated nodes.
TABLE = ["wrong_interface", "hostname_loopback", "blocked_port", "world_size_mismatch", "late_node"]
TRAPS = ["hostname_loopback", "c10d_no_is_host", "c10d_no_local_addr", "exit_barrier"]
#: Faults whose fixed job is another fault's fixed job (the right interface, every node, all at once;
#: c10d with is_host and --local-addr): ``reproduce(..., fixed=True)`` runs such a job once for both.
SAME_FIX = {"hostname_loopback": "wrong_interface", "blocked_port": "wrong_interface",
            "world_size_mismatch": "wrong_interface", "c10d_no_local_addr": "c10d_no_is_host"}


def setup(key: str, cluster: SimCluster, fixed: bool = False) -> dict:
    """The job that shows fault ``key`` on ``cluster`` (or, ``fixed``, the job with its fix).

    Returns:
        Keyword arguments for :meth:`SimCluster.run` (``argv``, ``env``, ``delays``,
        ``after_failure``) plus ``drop``: ``(src, dst)`` nodes whose traffic is
        dropped, or None.

    Raises:
        KeyError: unknown ``key``.
    """
    from .commands import torchrun_commands  # here: lesson 07's notebook imports this module, not its answers

    if key not in FAULTS:
        raise KeyError(f"no fault {key!r}; known: {', '.join(FAULTS)}")
    iface = cluster.interface
    right = {"GLOO_SOCKET_IFNAME": iface, "NCCL_SOCKET_IFNAME": iface}
    args = (PROBE_SCRIPT, "--timeout", str(PG_TIMEOUT))
    static = dict(rdzv_conf=f"timeout={RDZV_TIMEOUT}", fork=True)
    job = {"argv": torchrun_commands(cluster, *args, **static), "env": right, "delays": None, "drop": None,
           "after_failure": AFTER_FAILURE}
    if key == "wrong_interface" and not fixed:
        job["env"] = {"GLOO_SOCKET_IFNAME": "docker0", "NCCL_SOCKET_IFNAME": "docker0"}
    elif key == "hostname_loopback" and not fixed:
        job["env"] = {}
    elif key == "blocked_port" and not fixed:
        job["drop"] = (1, 0)
    elif key == "world_size_mismatch":
        job["argv"] = torchrun_commands(cluster, *args, nnodes=len(cluster.nodes) + (0 if fixed else 1), **static)
    elif key == "late_node":
        job["delays"] = [0, 5] if fixed else [0, "after node0"]
        job["after_failure"] = None  # node 1 starts after node 0 failed: let it fail in its own time
        if fixed:  # the default rendezvous timeout, far longer than 5 s
            job["argv"] = torchrun_commands(cluster, *args, fork=True)
    elif key.startswith("c10d"):
        conf = f"read_timeout={RDZV_TIMEOUT},join_timeout={RDZV_TIMEOUT}"
        job["argv"] = torchrun_commands(cluster, *args, rdzv="c10d", rdzv_conf=conf, fork=True,
                                       is_host=fixed or key != "c10d_no_is_host",
                                       local_addr=fixed or key != "c10d_no_local_addr")
    elif key == "exit_barrier":
        extra = () if fixed else ("--abort-after-destroy", "1")
        job["argv"] = torchrun_commands(cluster, *args, *extra, fork=True)
        job["env"] = {**right, "LOGLEVEL": "INFO"}  # torchrun says it waits only at INFO level
    return job


@dataclass
class FaultRun:
    """One fault reproduced (or fixed): the fault, whether fixed, and the run's result."""

    fault: Fault
    fixed: bool
    result: RunResult
    same_as: str = ""  # fixed: the fault whose fixed job this was (the same job), if not this one

    @property
    def as_expected(self) -> bool:
        """The fixed job succeeded, or the faulty one failed."""
        return self.result.ok == self.fixed

    def evidence(self, limit: int = 2, width: int = 220) -> list[str]:
        """The log lines that name the fault (its ``evidence``), else the run's key lines."""
        rx = re.compile(self.fault.evidence)
        found = []
        for n in self.result.nodes:
            mine, seen = [], set()
            for line in n.lines:
                text = LOG_PREFIX.sub("", line).strip()
                if rx.search(text) and text not in seen and not text.startswith(("Exception raised", "frame #")):
                    seen.add(text)
                    mine.append(f"[node{n.node.rank}] " + (text if len(text) <= width else text[: width - 3] + "..."))
            found += mine[-limit:]
        return found or self.result.key_lines(limit=limit, width=width)

    def report(self, lines: int = 2) -> str:
        """What happened, what a learner sees in the logs, and the fix."""
        f, r = self.fault, self.result
        if self.fixed:
            head = f"{f.title}, fixed: {'OK' if r.ok else 'STILL FAILING'} in {r.seconds:.1f} s"
            head += f" (the same job as the fix of {FAULTS[self.same_as].title})" if self.same_as else ""
        else:
            verdict = "FAILED" if not r.ok else "did NOT fail (unexpected)"
            head = f"{f.title}: {verdict} after {r.seconds:.1f} s here; a cluster waits {f.cluster_wait}"
        body = [f"  {n.node.hostname}: {n.status()}" for n in r.nodes]
        if not self.fixed:
            body += [f"  {line}" for line in self.evidence(lines)]
            body += [f"  cause: {f.cause}", f"  fix:   {f.fix}"]
        return "\n".join([head, *body])


def _one(key: str, fixed: bool, out: dict, netns) -> None:
    with SimCluster(2, netns=netns) as cluster:
        job = setup(key, cluster, fixed)
        drop = job.pop("drop")
        with cluster.drop_traffic(*drop) if drop else contextlib.nullcontext():
            result = cluster.run(**job, timeout=RUN_TIMEOUT, echo=False)
        out[key] = FaultRun(FAULTS[key], fixed, result)


def reproduce(keys=None, fixed: bool = False, echo: bool = True, netns: bool | None = True) -> list[FaultRun]:
    """Run faults, each on two simulated nodes of its own, all at once; report each.

    Args:
        keys: fault names (default: :data:`TABLE`).
        fixed: run each job with its fix instead; a fixed job that is the same as another
            key's (:data:`SAME_FIX`) runs once, and both keys get its result.
        echo: print each fault's report (what failed, the key log lines, the fix).
        netns: as :class:`SimCluster`; True by default: on 127.0.0.1 most of
            these faults cannot happen, so reproducing them needs namespaces.

    Returns:
        One :class:`FaultRun` per key, in order.

    Raises:
        KeyError: an unknown key. RuntimeError: network namespaces are impossible
            here (with ``netns=True``), or a run raised.
    """
    keys = list(TABLE if keys is None else keys)
    unknown = [k for k in keys if k not in FAULTS]
    if unknown:
        raise KeyError(f"no fault {unknown[0]!r}; known: {', '.join(FAULTS)}")
    out: dict[str, FaultRun] = {}
    errors: list[BaseException] = []
    job_of = {k: SAME_FIX[k] if fixed and SAME_FIX.get(k) in keys else k for k in keys}
    jobs = [k for k in keys if job_of[k] == k]

    def work(key):
        try:
            _one(key, fixed, out, netns)
        except BaseException as err:  # noqa: BLE001 - re-raised below, in the caller's thread
            errors.append(err)

    if echo:
        print(f"troubleshoot: {len(jobs)} job(s) at once, each on 2 simulated nodes of its own, "
              f"{'with the fix' if fixed else 'each with one fault'}; rendezvous and process-group timeouts "
              f"of {RDZV_TIMEOUT} and {PG_TIMEOUT} s instead of minutes", flush=True)
    threads = [threading.Thread(target=work, args=(k,), daemon=True) for k in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"reproducing a fault failed: {type(errors[0]).__name__}: {errors[0]}") from errors[0]
    runs = [out[k] if job_of[k] == k else FaultRun(FAULTS[k], fixed, out[job_of[k]].result, job_of[k])
            for k in keys]
    if echo:
        print("\n\n".join(run.report() for run in runs), flush=True)
    return runs

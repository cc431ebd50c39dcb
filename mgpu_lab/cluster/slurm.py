"""SLURM batch scripts for multi-node torchrun jobs: every line generated and explained.

:func:`sbatch` writes the script for a cluster shape: one task per node
(``srun`` starts one ``torchrun`` on each), c10d rendezvous hosted by the first
node of the allocation, the first node marked ``is_host=1`` and every node
giving its own name as ``--local-addr`` (the two c10d traps of lesson 07), and
the NCCL/gloo interface variables. Each line comes with the reason it is
there, for the lesson's line-by-line table.

Example:
    >>> from mgpu_lab.cluster.slurm import sbatch
    >>> job = sbatch("train.py", "--epochs", "3", nodes=2, gpus_per_node=4, interface="ib0")
    >>> print(job.text)                        # doctest: +ELLIPSIS
    #!/bin/bash
    #SBATCH --job-name=mgpu-lab
    #SBATCH --nodes=2
    ...
    >>> import os, tempfile
    >>> path = job.write(os.path.join(tempfile.mkdtemp(), "train.sbatch"))   # executable, ready for sbatch
    >>> os.access(path, os.X_OK), path.read_text() == job.text
    (True, True)
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Sbatch", "sbatch", "example", "NODE_COMMAND", "NODE_LINES"]

#: What ``srun`` runs on every node, one line per torchrun option with its reason. The
#: per-node values (SLURM_NODEID, SLURMD_NODENAME) are expanded on each node by
#: ``bash -c``, not once in the batch script.
NODE_LINES = (
    ("exec torchrun", "one torchrun per node (exec: SLURM signals reach torchrun directly)"),
    ('--nnodes="$SLURM_JOB_NUM_NODES"', "as many nodes as SLURM gave the job: never a number that can disagree"),
    ('--nproc-per-node="$NPROC_PER_NODE"', "processes on this node, one per GPU"),
    ("--rdzv-backend=c10d", "c10d rendezvous: ranks of nodes are assigned as they join, no --node-rank needed"),
    ('--rdzv-endpoint="$HEAD_NODE:$HEAD_PORT"', "the store of the rendezvous runs on the head node"),
    ('--rdzv-id="$SLURM_JOB_ID"', "a name for this job's rendezvous, the same on every node"),
    ('--rdzv-conf="is_host=$(( SLURM_NODEID == 0 ))"', "is_host=1 on the head node only: torchrun's own guess "
     "fails where the host name resolves to 127.0.0.1, and then no node hosts the store"),
    ('--local-addr="$SLURMD_NODENAME"', "the name other nodes reach this node by; without it torchrun "
     "publishes socket.getfqdn(), 'localhost' on such nodes"),
    ('"$@"', "the training script and its arguments, passed after the quotes"),
)
NODE_COMMAND = "\n" + " \\\n".join(("  " if i == 0 else "    ") + text for i, (text, _) in enumerate(NODE_LINES))
_TIME = re.compile(r"^(\d+-)?\d{1,2}(:\d{2}){1,2}$|^\d+$")
_NAME = re.compile(r"^[A-Za-z0-9_.+-]+$")


@dataclass(frozen=True)
class Sbatch:
    """A generated batch script.

    Attributes:
        lines: ``(line, why)`` pairs, in order; ``why`` is "" for blank lines.
        node_argv: what ``srun`` runs on every node (``bash -c NODE_COMMAND ...``).
        exports: the variables the script exports before ``srun``, as a dict
            (values are shell text, e.g. ``$(scontrol ...)``).
    """

    lines: tuple
    node_argv: tuple
    exports: dict

    @property
    def text(self) -> str:
        """The script, ready for ``sbatch``."""
        return "\n".join(line for line, _ in self.lines) + "\n"

    def explained(self) -> list[tuple[str, str]]:
        """The non-blank lines with their reasons (for a table)."""
        return [(line, why) for line, why in self.lines if line.strip()]

    def slurm_env(self, node_id: int, hostnames, job_id: str = "4242") -> dict[str, str]:
        """What one node's task would see under SLURM: SLURM's variables and this script's exports.

        For running :attr:`node_argv` without SLURM (on simulated nodes): HEAD_NODE
        is ``hostnames[0]``, as ``scontrol show hostnames`` would give it.
        """
        hostnames = list(hostnames)
        env = {**self.exports, "HEAD_NODE": hostnames[0], "SLURM_JOB_NUM_NODES": str(len(hostnames)),
               "SLURM_NODEID": str(node_id), "SLURMD_NODENAME": hostnames[node_id], "SLURM_JOB_ID": str(job_id),
               "SLURM_JOB_NODELIST": ",".join(hostnames)}
        return env

    def write(self, path) -> Path:
        """Write :attr:`text` to ``path`` (made executable); return the path."""
        path = Path(path)
        path.write_text(self.text, encoding="utf-8")
        path.chmod(0o755)
        return path


def _positive(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an int >= {minimum}")
    return value


def sbatch(script, *script_args, nodes: int, gpus_per_node: int, nproc_per_node: int | None = None,
           job_name: str = "mgpu-lab", time: str = "00:30:00", partition: str | None = None,
           account: str | None = None, cpus_per_task: int | None = None, port: int = 29500,
           interface: str | None = None, debug: bool = False, setup=()) -> Sbatch:
    """The sbatch script that runs ``script`` with torchrun on ``nodes`` nodes.

    Args:
        script, script_args: the training script (a path on the cluster) and its arguments.
        nodes: how many nodes (``#SBATCH --nodes``).
        gpus_per_node: GPUs per node (``#SBATCH --gpus-per-node``; 0 for CPU nodes).
        nproc_per_node: processes per node (default: one per GPU; needed when 0 GPUs).
        job_name, time, partition, account: the usual ``#SBATCH`` settings
            (time as ``MM``, ``HH:MM:SS`` or ``D-HH:MM:SS``).
        cpus_per_task: CPU cores for each node's torchrun (``OMP_NUM_THREADS`` is
            that divided by ``nproc_per_node``).
        port: the rendezvous port on the first node.
        interface: the IP interface between nodes (``ib0``, ``eth0``, ...), exported as
            NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME: the interface of their sockets
            (NCCL's bootstrap, and its data only where there is no InfiniBand: over
            InfiniBand NCCL's data goes over IB verbs).
        debug: export NCCL_DEBUG=INFO (and NCCL_DEBUG_SUBSYS=INIT,NET).
        setup: shell lines to run first, e.g. ``["module load cuda", "source .venv/bin/activate"]``.

    Returns:
        The :class:`Sbatch` (``.text`` is the script).

    Raises:
        ValueError: a bad shape, name, time, port or interface, with the value.

    Example:
        >>> sbatch("train.py", nodes=2, gpus_per_node=8).text.count("srun")
        1
    """
    nproc_per_node = _validate(nodes, gpus_per_node, nproc_per_node, job_name, time, port, interface, partition,
                               account, cpus_per_task)
    lines = _header(job_name, nodes, gpus_per_node, cpus_per_task, time, partition, account)
    lines += [("", ""), ("set -euo pipefail", "stop at the first failing command or unset variable")]
    lines += [(str(line), "set-up you asked for (modules, environment)") for line in setup]
    exports, explained = _exports(port, nproc_per_node, interface, debug, cpus_per_task)
    lines += [("", ""), *explained]
    args = " ".join(shlex.quote(str(a)) for a in (script, *script_args))
    body = NODE_COMMAND.splitlines()[1:]
    lines += [("", ""), ("srun --kill-on-bad-exit=1 bash -c '", "on every node at once (one task per node); "
                         "when one task fails SLURM stops the others instead of letting them wait")]
    lines += [(text, why) for text, (_, why) in zip(body[:-1], NODE_LINES)]
    lines.append((f"{body[-1]}' torchrun-node {args}", NODE_LINES[-1][1] + " ($0 is only a name)"))
    node_argv = ("bash", "-c", NODE_COMMAND, "torchrun-node", str(script), *map(str, script_args))
    return Sbatch(tuple(lines), node_argv, exports)


def _validate(nodes, gpus_per_node, nproc_per_node, job_name, time, port, interface, partition, account,
              cpus_per_task) -> int:
    """:func:`sbatch`'s arguments checked; the processes per node (default: one per GPU)."""
    _positive("nodes", nodes)
    _positive("gpus_per_node", gpus_per_node, 0)
    if nproc_per_node is None:
        if gpus_per_node == 0:
            raise ValueError("gpus_per_node=0: pass nproc_per_node, the processes to start on each CPU node")
        nproc_per_node = gpus_per_node
    _positive("nproc_per_node", nproc_per_node)
    if gpus_per_node and nproc_per_node > gpus_per_node:
        raise ValueError(f"nproc_per_node={nproc_per_node} > gpus_per_node={gpus_per_node}: NCCL needs one GPU "
                         "per process; ask for more GPUs or start fewer processes")
    if not _NAME.match(job_name or ""):
        raise ValueError(f"job_name={job_name!r}: use letters, digits and _.+- only")
    if not isinstance(time, str) or not _TIME.match(time):
        raise ValueError(f"time={time!r}: give SLURM's format, e.g. '30', '01:30:00' or '2-00:00:00'")
    if isinstance(port, bool) or not isinstance(port, int) or not 1024 <= port <= 65535:
        raise ValueError(f"port={port!r} must be an int from 1024 to 65535, e.g. 29500")
    if interface is not None and not re.fullmatch(r"[A-Za-z0-9_.:-]{1,15}", interface):
        raise ValueError(f"interface={interface!r} is not a network interface name (e.g. 'ib0', 'eth0')")
    for name, value in (("partition", partition), ("account", account)):
        if value is not None and not _NAME.match(value):
            raise ValueError(f"{name}={value!r}: use letters, digits and _.+- only")
    if cpus_per_task is not None:
        _positive("cpus_per_task", cpus_per_task)
    return nproc_per_node


def _header(job_name, nodes, gpus_per_node, cpus_per_task, time, partition, account) -> list[tuple[str, str]]:
    """The ``#SBATCH`` lines, each with why."""
    lines = [("#!/bin/bash", "a bash script; sbatch reads the #SBATCH lines below as its options"),
             (f"#SBATCH --job-name={job_name}", "the name squeue shows, and %x in the log file name"),
             (f"#SBATCH --nodes={nodes}", "how many machines"),
             ("#SBATCH --ntasks-per-node=1", "one task per node: srun starts one torchrun on each node, and "
                                             "torchrun starts the processes of that node")]
    if gpus_per_node:
        lines.append((f"#SBATCH --gpus-per-node={gpus_per_node}", "GPUs reserved on every node"))
    if cpus_per_task:
        lines.append((f"#SBATCH --cpus-per-task={cpus_per_task}", "CPU cores for each node's torchrun and its "
                                                                  "processes (data loading needs them)"))
    lines.append((f"#SBATCH --time={time}", "the time limit: SLURM stops the job then, also one that hangs "
                                            "(a rank waiting for a node that is gone waits for minutes)"))
    lines.append(("#SBATCH --output=%x-%j.out", "one log per job (%x the name, %j the job id) with every "
                                                "node's output"))
    if partition:
        lines.append((f"#SBATCH --partition={partition}", "the queue of the GPU nodes"))
    if account:
        lines.append((f"#SBATCH --account={account}", "whose budget pays for it"))
    return lines


def _exports(port, nproc_per_node, interface, debug, cpus_per_task) -> tuple[dict, list[tuple[str, str]]]:
    """The variables every node's command gets, and their ``export`` lines with why."""
    exports = {"HEAD_NODE": '$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
               "HEAD_PORT": str(port), "NPROC_PER_NODE": str(nproc_per_node)}
    lines = [(f"export HEAD_NODE={exports['HEAD_NODE']}",
              "the first node of the allocation hosts the rendezvous; its name, as every node resolves it"),
             (f"export HEAD_PORT={port}", "the rendezvous port on the head node: it must be open between nodes"),
             (f"export NPROC_PER_NODE={nproc_per_node}", "processes per node, one per GPU")]
    if interface:
        exports.update(NCCL_SOCKET_IFNAME=interface, GLOO_SOCKET_IFNAME=interface)
        lines += [(f"export NCCL_SOCKET_IFNAME={interface}", "NCCL's sockets use this interface, not docker0 or "
                   "lo: its bootstrap between the nodes, and its data where there is no InfiniBand (over InfiniBand "
                   "NCCL moves the data with IB verbs, not through these sockets)"),
                  (f"export GLOO_SOCKET_IFNAME={interface}", "gloo's sockets too (else gloo binds to whatever the "
                                                             "host name resolves to, often 127.0.0.1)")]
    if debug:
        exports.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,NET")
        lines += [("export NCCL_DEBUG=INFO", "NCCL logs its set-up: version, interfaces, transports"),
                  ("export NCCL_DEBUG_SUBSYS=INIT,NET", "only the set-up and network parts of that log")]
    if cpus_per_task:
        threads = max(1, cpus_per_task // nproc_per_node)
        exports["OMP_NUM_THREADS"] = str(threads)
        lines.append((f"export OMP_NUM_THREADS={threads}", "the node's cores shared among its processes"))
    return exports, lines


def example() -> Sbatch:
    """The lesson's example: scripts/ddp_train.py on 2 nodes x 4 GPUs over InfiniBand (ib0).

    Submitted from the repository root (``sbatch scripts/slurm_example.sbatch``);
    ``python -m mgpu_lab.cluster.slurm`` prints it, which is how the committed copy is made.
    """
    return sbatch("scripts/ddp_train.py", "--epochs", "10", "--checkpoint-dir", "checkpoints", "--resume",
                  nodes=2, gpus_per_node=4, cpus_per_task=32, time="01:00:00", interface="ib0",
                  job_name="ddp-train", setup=["source .venv/bin/activate"])


if __name__ == "__main__":
    print(example().text, end="")

"""Every node's ``torchrun`` command for a job on :class:`~mgpu_lab.cluster.multinode.SimCluster`'s nodes.

Static rendezvous: every node's rank, the master's address and port given on the command
line. The troubleshooting table (:mod:`mgpu_lab.cluster.troubleshoot`, which imports it
when it runs), the doctor, the course's checks and the tests use it.

Example:
    >>> from types import SimpleNamespace
    >>> nodes = [SimpleNamespace(rank=r, addr=f"10.0.0.{r + 1}") for r in range(2)]
    >>> cluster = SimpleNamespace(nodes=nodes, master_addr="10.0.0.1", port=lambda: 29511)
    >>> torchrun_commands(cluster, "train.py", nproc_per_node=2)[1]  # doctest: +NORMALIZE_WHITESPACE
    ['torchrun', '--nnodes=2', '--nproc-per-node=2', '--node-rank=1', '--master-addr=10.0.0.1',
     '--master-port=29511', 'train.py']
"""
from __future__ import annotations

from pathlib import Path

__all__ = ["torchrun_commands"]


def torchrun_commands(cluster, script, *script_args, nproc_per_node: int = 1, rdzv: str = "static",
                      port: int | None = None, is_host: bool = True, local_addr: bool = True,
                      rdzv_conf: str = "", nnodes: int | str | None = None, fork: bool = False) -> list[list[str]]:
    """Every node's torchrun command for one job on ``cluster``, with static or c10d rendezvous.

    Args:
        cluster: a :class:`~mgpu_lab.cluster.multinode.SimCluster` (its ``nodes``,
            ``master_addr`` and ``port()``).
        script, script_args: the training script and its arguments.
        nproc_per_node: processes per node.
        rdzv: ``"static"`` (``--node-rank`` and ``--master-addr/--master-port``)
            or ``"c10d"`` (``--rdzv-backend=c10d --rdzv-endpoint --rdzv-id``;
            node ranks are assigned at the rendezvous).
        port: the rendezvous port (default: ``cluster.port()``).
        is_host: c10d only: give node 0 ``--rdzv-conf=is_host=1``.
        local_addr: c10d only: give every node ``--local-addr=<its address>``.
        rdzv_conf: more ``--rdzv-conf`` settings, e.g. ``"timeout=5"`` (static)
            or ``"join_timeout=5"`` (c10d).
        nnodes: ``--nnodes`` (default: the number of nodes; ``"1:2"`` is a range).
        fork: add ``--run-path --start-method=fork``: workers are forked from
            torchrun instead of starting Python and importing torch again
            (about 3 s of CPU each). Saves time on this 2-core machine; a
            cluster does not need it.

    Returns:
        One argv per node, starting with ``torchrun``.

    Raises:
        ValueError: ``rdzv`` is neither ``"static"`` nor ``"c10d"``.
    """
    if rdzv not in ("static", "c10d"):
        raise ValueError(f"rdzv={rdzv!r}: use 'static' or 'c10d'")
    port = cluster.port() if port is None else port
    nnodes = len(cluster.nodes) if nnodes is None else nnodes
    script = str(Path(script).resolve()) if fork else str(script)
    out = []
    for node in cluster.nodes:
        argv = ["torchrun", f"--nnodes={nnodes}", f"--nproc-per-node={nproc_per_node}"]
        argv += ["--run-path", "--start-method=fork"] if fork else []
        if rdzv == "static":
            argv += [f"--node-rank={node.rank}", f"--master-addr={cluster.master_addr}", f"--master-port={port}"]
            argv += [f"--rdzv-conf={rdzv_conf}"] if rdzv_conf else []
        else:
            conf = [c for c in ("is_host=1" if is_host and node.rank == 0 else "", rdzv_conf) if c]
            argv += ["--rdzv-backend=c10d", f"--rdzv-endpoint={cluster.master_addr}:{port}", "--rdzv-id=lesson07"]
            argv += [f"--rdzv-conf={','.join(conf)}"] if conf else []
            argv += [f"--local-addr={node.addr}"] if local_addr else []
        out.append(argv + [script, *map(str, script_args)])
    return out

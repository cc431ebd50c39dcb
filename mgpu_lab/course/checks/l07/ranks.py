"""What lesson 07's checks run outside the judging: the learner's commands on simulated nodes.

:func:`run_commands` runs one command per node (each with :data:`FAST`'s forked
workers, :func:`fast`) and returns what the ranks reported; :func:`failure_text`
and :func:`where` put a run in words. The learner's functions themselves run in
a fresh process through :func:`..sim.outcome.outcomes`.

Example:
    >>> fast(["torchrun", "--nproc-per-node=2", "/abs/train.py"])
    ['torchrun', '--start-method=fork', '--run-path', '--nproc-per-node=2', '/abs/train.py']
"""
from __future__ import annotations

import re


RUN_TIMEOUT = 120.0  # seconds for one real run on simulated nodes, torchrun start-up included


PG_TIMEOUT = 5  # seconds a rank of the check's script waits for the others


FAST = ["--start-method=fork", "--run-path"]  # workers forked from torchrun: seconds less per run, same job


def run_commands(cluster, argvs, env: dict):
    """Run one command per node on the simulated nodes; return (result, the ranks' reports)."""
    from mgpu_lab.cluster.multinode import probe_reports

    env = {**env, "ALLREDUCE_CHECK_JSON": "1"}
    result = cluster.run(argvs, env=env, timeout=RUN_TIMEOUT, after_failure=3, echo=False)
    return result, probe_reports(result)


def where(cluster) -> str:
    """What the simulated nodes are, in words."""
    return cluster.banner().split(" · ", 1)[1]


def failure_text(result) -> str:
    """The lines of a failed run that say why (else each node's last lines, else the summary)."""
    lines = result.key_lines(limit=2, width=200) or [
        line[:200] for n in result.nodes for line in result.lines(node=n.node.rank)[-2:]]
    return " | ".join(lines) or result.summary()


def fast(argv: list) -> list:
    """The same command with torchrun's workers forked from it (the script path is absolute)."""
    cut = 1 if re.fullmatch(r"(.*/)?torchrun", argv[0]) else 3
    return argv[:cut] + FAST + argv[cut:]

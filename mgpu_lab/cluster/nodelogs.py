"""What simulated nodes did: their logs, read the way a person reads them.

The results of :meth:`mgpu_lab.cluster.multinode.SimCluster.run`: one :class:`NodeRun`
per node (command, exit code, complete log), gathered in a :class:`RunResult`
that can summarise the run, pick the lines that say what went wrong, and read
the reports of ``scripts/allreduce_check.py``. :class:`Condense` is the live
view's filter: a failing torchrun prints the same traceback several times and
C++ exceptions add dozens of stack frames; the log keeps them, the view folds them.

Example:
    >>> import sys
    >>> from mgpu_lab.cluster.multinode import SimCluster
    >>> with SimCluster(2) as cluster:   # node0 fails at once; node1 is stopped 1 s later
    ...     result = cluster.run([[sys.executable, "-c", "raise RuntimeError('no GPU here')"], ["sleep", "30"]],
    ...                          after_failure=1, echo=False)
    >>> print(result.summary())
    FAILED: 2 nodes in ... s (stopped 1 s after node0 failed)
      node0 (...): exit code 1 after ... s
      node1 (...): still running after ... s, 1 s after node0 failed: stopped
    >>> result.key_lines()
    ['[node0] RuntimeError: no GPU here']
"""
from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass, field

__all__ = ["Node", "NodeRun", "RunResult", "Condense", "probe_reports", "NOISE", "LOG_PREFIX", "KEY_LINE"]

# Left out of the live view (kept in the logs): a warning every TCPStore client prints
# where reverse DNS finds nothing, and torchrun's OMP_NUM_THREADS banner.
NOISE = re.compile(r"hostname of the client socket cannot be retrieved|OMP_NUM_THREADS|run\.py:\d+\] \**\s*$")
# The prefix of torchrun's own log lines ("E1121 19:01:25.764000 12401 torch/.../api.py:836] ").
LOG_PREFIX = re.compile(r"^[EWI]\d{4} [\d:.]+ \d+ \S+:\d+\] ")


class Condense:
    """The live view of one node's output: tracebacks and C++ stack frames folded into one line each.

    A failing torchrun prints the same traceback two or three times (the worker's,
    torchrun's log of it, its error summary) and C++ exceptions add dozens of
    ``frame #N`` lines; the log keeps them all, the live view keeps the lines
    that say what happened.
    """

    def __init__(self):
        self.in_traceback, self.folded = False, 0

    def __call__(self, line: str) -> list[str]:
        text = LOG_PREFIX.sub("", line)
        stripped = text.strip()
        if re.match(r"(frame #\d+:|Exception raised from|<omitting python frames>)", stripped):
            return []
        if "Traceback (most recent call last):" in text:
            self.in_traceback, self.folded = True, 0
            return []
        if self.in_traceback:
            if text[:1] in (" ", "\t", "") or stripped.startswith(("^", "~", "File ", "During handling")):
                self.folded += 1
                return []
            self.in_traceback = False
            return [f"(traceback of {self.folded} lines, in the log) {line}"] if self.folded else [line]
        return [line]


# Lines that say what went wrong, and lines around them that never do.
KEY_LINE = re.compile(r"Error|error:|[Tt]imed out|timeout|refused|[Ff]ailed|Waiting \d+ seconds|"
                      r"[Ss]ignal|abort|Unable|exitcode|No such file|can't open|not found")
# torchrun's wrapper around a failure: shown only when nothing more specific was found.
GENERIC = re.compile(r"ChildFailedError|^exitcode\s*:|failed \(exitcode|error_file|traceback\s*:")
NOT_KEY = re.compile(r"^\s*(frame #\d+|Exception raised from|raise |File \"|\^+$)")
@dataclass(frozen=True)
class Node:
    """One simulated node.

    Attributes:
        rank: the node's index (torchrun's ``--node-rank``).
        hostname: ``node<rank>`` in a namespace; this machine's name otherwise.
        addr: the address the other nodes reach it at.
        interface: the interface with that address (``eth0``, or ``lo``).
        netns: the namespace's name, or None on 127.0.0.1.
    """

    rank: int
    hostname: str
    addr: str
    interface: str
    netns: str | None


@dataclass
class NodeRun:
    """What one node did in a run: its command, exit code and complete log."""

    node: Node
    argv: list[str]
    env: dict[str, str]
    returncode: int | None = None  # None: still running when the run was stopped
    lines: list[str] = field(default_factory=list)
    seconds: float = 0.0
    stopped: str = ""  # why it was stopped, when it was
    started: bool = False

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def status(self) -> str:
        if not self.started:
            return f"never started: the run ended before its start time ({self.stopped})"
        if self.returncode is None:
            return f"still running after {self.seconds:.1f} s, {self.stopped}: stopped"
        if self.returncode < 0:
            return f"killed by signal {-self.returncode} after {self.seconds:.1f} s"
        return f"exit code {self.returncode} after {self.seconds:.1f} s"


@dataclass
class RunResult:
    """The outcome of :meth:`SimCluster.run`: one :class:`NodeRun` per node."""

    nodes: list[NodeRun]
    timeout: float
    seconds: float
    isolated: bool
    stopped: str = ""  # "" when every node exited by itself, else why the rest were stopped

    @property
    def ok(self) -> bool:
        """Every node's command exited with 0."""
        return all(n.returncode == 0 for n in self.nodes)

    @property
    def timed_out(self) -> bool:
        """The run was ended by its timeout, not by the nodes."""
        return self.stopped.startswith("at the")

    def lines(self, pattern: str | None = None, node: int | None = None) -> list[str]:
        """Log lines ``[nodeI] ...`` of every node (or one), optionally only those matching a regex."""
        rx = re.compile(pattern) if pattern else None
        return [f"[node{n.node.rank}] {line}" for n in self.nodes if node in (None, n.node.rank)
                for line in n.lines if rx is None or rx.search(line)]

    def key_lines(self, limit: int = 3, width: int = 220) -> list[str]:
        """The last ``limit`` distinct lines per node that say what went wrong."""
        out = []
        for n in self.nodes:
            seen, picked, previous = set(), [], ""
            for line in n.lines:
                # a traceback's source line: indented, after a 'File "..."' line (none under python -c)
                text, code = line.strip(), previous.startswith('File "') and line[:1].isspace()
                previous = text
                if KEY_LINE.search(text) and not NOISE.search(text) and not NOT_KEY.search(text) \
                        and not code and text not in seen:
                    seen.add(text)
                    picked.append(text)
            specific = [i for i, text in enumerate(picked) if not GENERIC.search(text)]
            generic = [i for i, text in enumerate(picked) if GENERIC.search(text)]
            chosen = sorted(specific[-limit:] + generic[-max(0, limit - len(specific)):] if limit > len(specific)
                            else specific[-limit:])
            out += [f"[node{n.node.rank}] " + (picked[i] if len(picked[i]) <= width else picked[i][: width - 3] + "...")
                    for i in chosen]
        return out

    def summary(self) -> str:
        head = (f"{'OK' if self.ok else 'FAILED'}: {len(self.nodes)} nodes in {self.seconds:.1f} s"
                + (f" (stopped {self.stopped})" if self.stopped else ""))
        return "\n".join([head] + [f"  node{n.node.rank} ({n.node.addr}): {n.status()}" for n in self.nodes])

    def __str__(self) -> str:
        return self.summary()


def probe_reports(result: RunResult) -> list[dict]:
    """The ``ALLREDUCE_CHECK {json}`` reports of ``scripts/allreduce_check.py`` ranks, sorted by RANK.

    Each report holds the rank's RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
    GROUP_RANK, MASTER_ADDR, MASTER_PORT (as torchrun set them, strings), its
    hostname, backend, the all_reduce ``sum`` and ``expected``, and ``node``: the
    simulated node whose log it came from. The script prints them with ``--json``
    or ``ALLREDUCE_CHECK_JSON=1``.
    """
    found, decoder, tag = [], json.JSONDecoder(), "ALLREDUCE_CHECK "
    for n in result.nodes:
        for line in n.lines:
            # Reports anywhere in the line: ranks that share a node's pipe may interleave.
            at = line.find(tag)
            while at >= 0:
                with contextlib.suppress(ValueError):
                    report, _ = decoder.raw_decode(line, at + len(tag))
                    found.append({**report, "node": n.node.rank})
                at = line.find(tag, at + len(tag))
    return sorted(found, key=lambda r: int(r.get("RANK") or -1))

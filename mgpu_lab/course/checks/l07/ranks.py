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

import os
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


# -- hierarchical_allreduce ------------------------------------------------------------
PER_NODE = 2  # LOCAL_WORLD_SIZE of the check's 4 ranks: 2 simulated nodes x 2 ranks


HIER_CALLS = (("float32", (5,)), ("float64", (2, 3)), ("int64", (4,)))  # (dtype, shape) of each call


def hier_input(rank: int, dtype: str, shape: tuple):
    """What rank ``rank`` passes in for one call: distinct per rank, exact in every dtype."""
    import torch

    n = 1
    for s in shape:
        n *= s
    return (torch.arange(n, dtype=torch.float64).reshape(shape) * (rank + 1) + 10 ** rank).to(getattr(torch, dtype))


GROUP_TIMEOUT = 5.0  # seconds a rank of the check waits in one collective: a right answer's take milliseconds


def _short_waits(tdist) -> None:
    """Every collective of this rank gives up after :data:`GROUP_TIMEOUT`: the world's and any group made later."""
    from datetime import timedelta

    c10d = tdist.distributed_c10d
    c10d.default_pg_timeout = timedelta(seconds=GROUP_TIMEOUT)  # what new_group gives a group made without one
    setter = getattr(tdist, "set_timeout", None) or getattr(c10d, "_set_pg_timeout", None)
    if setter is not None:  # torch 2.11 and 2.14 have one of them
        setter(timedelta(seconds=GROUP_TIMEOUT))


def _gave_up(err: BaseException) -> bool:
    """Whether an error is a collective that waited in vain (or whose peer gave up waiting), not the answer's own."""
    text = str(err)
    return any(s in text for s in ("Timed out", "timed out", "Connection closed by peer", "Connection reset by peer"))


def hier_probe(hierarchical_allreduce) -> dict:
    """Probe (4 ranks): the learner's function on the calls of :data:`HIER_CALLS`, as 2 nodes x 2 ranks.

    LOCAL_WORLD_SIZE, LOCAL_RANK and GROUP_RANK are set as torchrun sets them for 2 nodes of 2 ranks
    (node = rank // 2). What this rank took part in comes from torch's flight recorder (on by default; it
    sees every collective of every process group, whatever API issued it; with gloo, no sends or
    receives): each entry's operation and the global ranks of its group; ``p2p`` lists the sends and
    receives (:func:`mgpu_lab.comm.record.record`), each with this rank and its peer. A collective that waits more than
    :data:`GROUP_TIMEOUT` seconds (ranks that call different collectives wait for each other forever)
    ends the calls: ``stuck`` is then ``[the call, the error]`` and the last entry of ``comm`` is where
    this rank waited, so a hang is reported in seconds, with every rank's position.
    """
    import json

    import torch
    import torch.distributed as tdist
    from torch._C import _distributed_c10d as c10d

    from mgpu_lab.comm.record import record

    rank = tdist.get_rank()
    os.environ.update(LOCAL_WORLD_SIZE=str(PER_NODE), LOCAL_RANK=str(rank % PER_NODE), GROUP_RANK=str(rank // PER_NODE))
    _short_waits(tdist)

    def entries():
        return json.loads(c10d._dump_fr_trace_json(includeCollectives=True)).get("entries", [])

    seen = {e["record_id"] for e in entries()}
    results, stuck = [], None
    with record() as log:  # sends and receives, which gloo's flight recorder does not see
        for call, (dtype, shape) in enumerate(HIER_CALLS):
            try:
                got = hierarchical_allreduce(hier_input(rank, dtype, shape))
            except RuntimeError as err:
                if not _gave_up(err):
                    raise
                stuck = [call, str(err).strip().splitlines()[0][:200]]
                break
            results.append([str(got.dtype), list(got.shape), got.tolist()] if isinstance(got, torch.Tensor)
                           else ["not a tensor", type(got).__name__, None])
    p2p = [[e["op"], sorted({rank, e["peer"]})] for e in log if e["op"] in ("send", "recv") and e["peer"] is not None]
    world = tdist.distributed_c10d._world
    groups = {name: tdist.get_process_group_ranks(pg) for pg, name in world.pg_names.items()}
    comm = [[e["profiling_name"].split(":", 1)[-1], groups.get(e["process_group"][0])]
            for e in sorted(entries(), key=lambda e: e["record_id"]) if e["record_id"] not in seen]
    return {"results": results, "comm": comm, "p2p": p2p, "stuck": stuck}


# -- two_level_allreduce ------------------------------------------------------------------
# (dtype, shape, meta) of each call: element counts that neither 2 nor 3 divides; (5,) has fewer elements than the
# 6 ranks of 2 nodes x 3; the last call runs with torch's default device set to meta, so a tensor made without
# device= is not on the input's device (on a GPU rank it would be a CPU tensor)
TWO_CALLS = (("float32", (1001,), False), ("float64", (5, 5), False), ("int64", (7,), False),
             ("int64", (5,), False), ("float32", (1001,), True))


def _event(e: dict) -> list:
    """What the judges need of a recorded event: [op, bytes, the group's global ranks, the peer, the device]."""
    return [e["op"], e["bytes"], e["ranks"], e["peer"], e["device"]]


def _one_two_level(two_level_allreduce, rank: int, dtype: str, shape: tuple, meta: bool) -> dict:
    """One call of the learner's function, recorded; its result or error and what this rank communicated."""
    import torch

    from mgpu_lab.comm.record import record

    x, entry, log = hier_input(rank, dtype, shape), {"result": None, "error": None, "events": []}, None
    try:
        with record(two_level_allreduce, expect_device=x.device if meta else None) as log:
            if meta:
                torch.set_default_device("meta")
            try:
                got = two_level_allreduce(x.clone())
            finally:
                if meta:
                    torch.set_default_device(None)
        entry["result"] = ([str(got.dtype), list(got.shape), str(got.device),
                            got.tolist() if got.device.type != "meta" else None]
                           if isinstance(got, torch.Tensor) else ["not a tensor", type(got).__name__, "", None])
    except NotImplementedError:
        raise
    except Exception as err:  # noqa: BLE001 - judged: a hang, a deadlock, a device mix-up, the answer's own error
        entry["error"] = f"{type(err).__name__}: " + (str(err).strip().splitlines() or [""])[0][:300]
        entry["stuck"] = _gave_up(err) or type(err).__name__ == "Deadlock"
    entry["events"] = [_event(e) for e in (log.events if log is not None else []) if e["op"] != "wait"]
    return entry


def two_level_probe(two_level_allreduce, per_node: int) -> list:
    """Probe: the learner's function on the calls of :data:`TWO_CALLS`, as nodes of ``per_node`` ranks.

    LOCAL_WORLD_SIZE, LOCAL_RANK and GROUP_RANK are set as torchrun sets them (node = rank // per_node).
    Every call is recorded with :mod:`mgpu_lab.comm.record` (every collective with its group and bytes,
    every send and receive with its peer); a collective that waits more than :data:`GROUP_TIMEOUT`
    seconds, or a deadlock of sends and receives, ends the calls, as does any error.
    """
    import torch.distributed as tdist

    rank = tdist.get_rank()
    os.environ.update(LOCAL_WORLD_SIZE=str(per_node), LOCAL_RANK=str(rank % per_node),
                      GROUP_RANK=str(rank // per_node))
    _short_waits(tdist)
    out = []
    for dtype, shape, meta in TWO_CALLS:
        out.append(_one_two_level(two_level_allreduce, rank, dtype, shape, meta))
        if out[-1]["error"]:
            break
    return out

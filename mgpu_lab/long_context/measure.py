"""What a context-parallel attention costs each rank: bytes received, attention FLOPs, peak memory.

:func:`measure` launches ``world`` ranks and runs an attention function with the
contract ``fn(q, k, v, causal, layout)`` (this rank's shards in, this rank's rows out)
on sequences of several lengths; each rank reports, per length, the bytes that reached
it (every receive, and its share of every collective, from :mod:`mgpu_lab.comm.record`),
its attention FLOPs (:mod:`.flops`), the most positions one tensor of K, V (or Q, or the
output) held (:class:`HeldRows`), and the most bytes it had allocated at once
(:func:`mgpu_lab.sharding.fsdp.peak_bytes`). Without ``fn`` it measures all-gather CP
(:mod:`.gather`). :func:`table` prints the rows side by side.

Example:
    >>> runs = measure(None, 2, seqs=(16,), causal=False)
    launch: 2 ranks · ...
    >>> [(row["seq"], row["bytes_in"], row["flops"]) for row in runs[0]]
    [(16, 2048, 16384)]
"""
from __future__ import annotations

import torch

from torch.utils._python_dispatch import TorchDispatchMode

from .flops import counting_flops
from .layout import shard

__all__ = ["inputs", "measure", "measure_rank", "table", "HeldRows"]


class HeldRows(TorchDispatchMode):
    """While active, the most rows (positions) that one floating tensor with rows ``head_dim`` wide held.

    Every tensor an operation makes is seen; a tensor of K or V (or Q, or an output) of ``p``
    positions has ``p`` rows of ``head_dim`` (transposed too). Pick ``head_dim`` unlike any row
    count, so that score matrices do not count.

    Example:
        >>> with HeldRows(4) as held:
        ...     _ = torch.cat([torch.ones(2, 6, 4), torch.ones(2, 6, 4)], dim=1)
        >>> held.rows
        12
    """

    def __init__(self, head_dim: int):
        super().__init__()
        self.head_dim, self.rows = head_dim, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (list, tuple)) else [out]:
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() >= 2:
                if t.shape[-1] == self.head_dim:
                    self.rows = max(self.rows, t.shape[-2])
                elif t.shape[-2] == self.head_dim:
                    self.rows = max(self.rows, t.shape[-1])
        return out


def inputs(batch: int, heads: int, seq: int, head_dim: int, dtype=torch.float32, seed: int = 0,
           scale: float = 1.0) -> tuple:
    """Deterministic full ``q, k, v`` of shape ``(batch, heads, seq, head_dim)``; ``q`` times ``scale``."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, heads, seq, head_dim, generator=gen, dtype=torch.float64) for _ in range(3))
    return (q * scale).to(dtype), k.to(dtype), v.to(dtype)


def _bytes_in(events: list, world: int) -> int:
    """Bytes that reached this rank: every receive, and a collective's share from the other ranks."""
    total = 0
    for e in events:
        if e["op"] == "recv":
            total += e["bytes"]
        elif e["op"] in ("all_gather", "all_to_all", "reduce_scatter"):
            total += e["bytes"] * (world - 1) // world
        elif e["op"] == "all_reduce":
            total += 2 * e["bytes"] * (world - 1) // world  # a ring all-reduce's reduce-scatter and all-gather
        elif e["op"] == "broadcast":
            total += e["bytes"]
    return total


def measure_rank(fn, seqs, layout: str, causal: bool, batch: int, heads: int, head_dim: int) -> list[dict]:
    """In each rank: ``fn`` on this rank's shards of each length, measured (see the module)."""
    import torch.distributed as tdist

    from mgpu_lab.comm.record import record
    from mgpu_lab.sharding.fsdp import peak_bytes

    if fn is None:
        from .gather import allgather_attention as fn
    rank, world = tdist.get_rank(), tdist.get_world_size()
    rows = []
    for seq in seqs:
        q, k, v = (shard(t, rank, world, layout) for t in inputs(batch, heads, seq, head_dim))
        with record() as log, counting_flops() as counter, HeldRows(head_dim) as held:
            fn(q, k, v, causal, layout)
        peak = peak_bytes(lambda: fn(q, k, v, causal, layout), torch.device("cpu"))
        rows.append({"seq": seq, "bytes_in": _bytes_in(log.events, world), "flops": counter.get_total_flops(),
                     "peak_bytes": peak, "kv_rows": held.rows})
    return rows


def measure(fn=None, world: int = 2, seqs=(256, 512, 1024), layout: str = "contiguous", causal: bool = True,
            batch: int = 1, heads: int = 2, head_dim: int = 16) -> list[list[dict]]:
    """Launch ``world`` ranks and measure ``fn`` (default: all-gather CP); rows per rank, one per length."""
    from mgpu_lab import launch

    return launch(measure_rank, world, fn, tuple(seqs), layout, causal, batch, heads, head_dim)


def table(runs: dict) -> str:
    """``runs``: name -> what :func:`measure` returned; one line per (name, length), one column per rank."""
    lines = []
    for name, per_rank in runs.items():
        for i, row in enumerate(per_rank[0]):
            cells = [f"{name:<24}S={row['seq']:<6}", f"rows held: {max(r[i]['kv_rows'] for r in per_rank):<5}"]
            for key, unit, div in (("bytes_in", "KiB in", 1024), ("peak_bytes", "KiB peak", 1024),
                                   ("flops", "MFLOP", 1e6)):
                values = " ".join(f"{r[i][key] / div:7.1f}" for r in per_rank)
                cells.append(f"{unit}: {values}")
            lines.append("  ".join(cells))
    return "\n".join(lines)

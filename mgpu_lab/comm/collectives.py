"""The collectives, seen on real ranks, and what a ring all-reduce built from send and recv sends.

- :func:`show_all` runs broadcast, reduce, all_reduce, all_gather, reduce_scatter,
  all_to_all and a send/recv ring in every rank and returns each rank's tensor
  before and after; :func:`plot_collectives` draws them as grids.
- :func:`ring_trace` runs a ring all-reduce built from send/recv, the one passed in,
  on values ``(chunk + 1) * 10**rank`` and decodes every message it sends: which chunk,
  summed over which ranks; :func:`plot_ring` draws the messages.

Example:
    >>> from mgpu_lab import launch
    >>> from mgpu_lab.comm import collectives
    >>> results = launch(collectives.show_all, 4)        # one dict per rank
    launch: 4 ranks · ...
    >>> results[2]["all_reduce"]                          # rank 2 before ([20, 21, 22, 23]) and after: the sum
    ([20.0, 21.0, 22.0, 23.0], [60.0, 64.0, 68.0, 72.0])
    >>> fig = collectives.plot_collectives(results)
"""
from __future__ import annotations

import torch
import torch.distributed as tdist

from mgpu_lab.core import compat

__all__ = ["show_all", "plot_collectives", "ring_trace", "plot_ring", "OPS"]

compat.install()  # reduce_scatter_single on torch < 2.13

OPS = ("broadcast", "reduce", "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send/recv")


def _device() -> torch.device:
    from mgpu_lab import dist as mdist

    return mdist.device() if tdist.get_backend() == "nccl" else torch.device("cpu")


def show_all(width: int = 4) -> dict:
    """Run every collective once in this rank; return ``{op: (before, after)}`` as lists.

    Rank ``r`` starts with ``[10r, 10r+1, ...]`` (``width`` values; one value ``10r``
    for all_gather), so every number in the result says where it came from.
    """
    rank, world = tdist.get_rank(), tdist.get_world_size()
    device = _device()

    def start(n=width):
        return torch.arange(n, dtype=torch.float32, device=device) + 10 * rank

    out = {}
    t = start()
    before = t.tolist()
    tdist.broadcast(t, src=0)
    out["broadcast"] = (before, t.tolist())
    t = start()
    tdist.reduce(t, dst=0)  # only rank 0's result is defined
    out["reduce"] = (before, t.tolist())
    t = start()
    tdist.all_reduce(t)
    out["all_reduce"] = (before, t.tolist())
    one = start(1)
    gathered = [torch.empty_like(one) for _ in range(world)]
    tdist.all_gather(gathered, one)
    out["all_gather"] = (one.tolist(), torch.cat(gathered).tolist())
    t, part = start(world), torch.empty(1, device=device)
    tdist.reduce_scatter_single(part, t)  # rank r gets the sum of everyone's element r
    out["reduce_scatter"] = (t.tolist(), part.tolist())
    t, got = start(world), torch.empty(world, device=device)
    tdist.all_to_all_single(got, t)  # element j of rank i goes to rank j, as element i
    out["all_to_all"] = (t.tolist(), got.tolist())
    t, got = start(), torch.empty(width, device=device)
    reqs = [tdist.isend(t, (rank + 1) % world), tdist.irecv(got, (rank - 1) % world)]
    for req in reqs:
        req.wait()
    out["send/recv"] = (t.tolist(), got.tolist())
    return out


def plot_collectives(results: list[dict], ops=OPS):
    """Draw every rank's tensor before and after each collective (rows: ranks)."""
    import matplotlib.pyplot as plt
    import numpy as np

    world = len(results)
    cols = 4
    rows = -(-len(ops) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.4 * cols, 1.9 * rows * max(1, world / 4)))
    for ax, op in zip(np.ravel(axes), ops):
        before = [results[r][op][0] for r in range(world)]
        after = [results[r][op][1] for r in range(world)]
        wb, wa = max(map(len, before)), max(map(len, after))
        grid = np.full((world, wb + 1 + wa), np.nan)
        for r in range(world):
            grid[r, :len(before[r])] = before[r]
            grid[r, wb + 1:wb + 1 + len(after[r])] = after[r]
        ax.imshow(grid, cmap="Blues", aspect="auto", vmin=0, vmax=1.8 * np.nanmax(grid) + 1)
        for (r, c), value in np.ndenumerate(grid):
            if not np.isnan(value):
                ax.text(c, r, f"{value:g}", ha="center", va="center", fontsize=8)
        ax.set_yticks(range(world), [f"rank {r}" for r in range(world)], fontsize=8)
        ax.set_xticks([(wb - 1) / 2, wb + 1 + (wa - 1) / 2], ["before", "after"], fontsize=8)
        ax.tick_params(length=0)
        ax.set_title(op, fontsize=10)
    for ax in np.ravel(axes)[len(ops):]:
        ax.axis("off")
    fig.tight_layout()
    return fig


def ring_trace(ring, elements_per_chunk: int = 1) -> dict:
    """In a rank: every message the ring all-reduce ``ring`` sends, decoded into the chunk and the ranks it carries.

    Rank ``r`` starts with ``(c + 1) * 10**r`` in every element of chunk ``c`` (``world_size``
    chunks of ``elements_per_chunk``), so a message holding chunk ``c`` summed over ranks
    ``S`` holds ``(c + 1) * sum(10**s for s in S)``: its nonzero digits name the ranks and
    their value the chunk (for up to 9 ranks). :func:`plot_ring` draws the messages.

    Args:
        ring: a ring all-reduce ``fn(tensor) -> tensor`` (in the notebook: the learner's own).
        elements_per_chunk: elements of each chunk.

    Returns:
        ``{"messages": [(chunk or None, ranks as "023", "all" or "?") per send, in order],
        "sent": bytes this rank sent, "bytes": the tensor's bytes, "same": equal to
        dist.all_reduce}``.
    """
    from mgpu_lab.comm.record import record

    rank, world = tdist.get_rank(), tdist.get_world_size()
    if world > 9:
        raise ValueError(f"ring_trace decodes one digit per rank: at most 9 ranks, got world_size={world}")
    chunk = torch.arange(world, device=_device()).repeat_interleave(elements_per_chunk)
    x = (chunk + 1).to(torch.float64) * 10 ** rank
    expected = x.clone()
    tdist.all_reduce(expected)
    with record(ring, keep_inputs=True) as log:
        got = ring(x.clone())
    sends = [e for e in log.events if e["op"] == "send"]
    return {"messages": [_decode(e.get("input"), world) for e in sends], "sent": sum(e["bytes"] for e in sends),
            "bytes": x.numel() * x.element_size(),
            "same": isinstance(got, torch.Tensor) and bool(torch.equal(got.cpu(), expected.cpu()))}


def _decode(message, world: int) -> tuple:
    """A sent tensor -> ``(chunk, ranks)``; ``(None, "?")`` when it is not one chunk's partial sum."""
    values = set(message.reshape(-1).tolist()) if message is not None else set()
    if len(values) != 1 or not float(next(iter(values))).is_integer():
        return None, "?"
    digits = f"{int(next(iter(values))):0{world}d}"[::-1]
    nonzero = {d for d in digits if d != "0"}
    if len(digits) != world or len(nonzero) != 1:
        return None, "?"
    return int(nonzero.pop()) - 1, _ranks_in(int("".join("1" if d != "0" else "0" for d in digits[::-1])), world)


def _ranks_in(value: int, world: int) -> str:
    """``1011`` (= 10**0 + 10**1 + 10**3) -> ``"013"``: the ranks whose values a chunk holds."""
    digits = f"{value:0{world}d}"[::-1]
    held = "".join(str(r) for r, d in enumerate(digits) if d != "0")
    return "all" if len(held) == world else held


def plot_ring(traces: list[dict]):
    """Draw what every rank sent in each message of the ring (one column per message; green: a full sum).

    Each cell reads ``c2`` (the chunk) over ``013`` (the ranks whose values it holds).
    With ``2(W - 1)`` messages per rank the columns are titled RS 1... (reduce-scatter) and AG 1...
    (all-gather).
    """
    import matplotlib.pyplot as plt
    import numpy as np

    world = len(traces)
    steps = max(len(t["messages"]) for t in traces)
    fig, ax = plt.subplots(figsize=(1.0 * steps + 1.2, 0.5 * world + 1.0))
    done = np.zeros((world, steps))
    for r, trace in enumerate(traces):
        for s, (chunk, ranks) in enumerate(trace["messages"]):
            done[r, s] = 1.0 if ranks == "all" else 0.35
            ax.text(s, r, f"c{chunk}\n{ranks}" if chunk is not None else "?", ha="center", va="center",
                    fontsize=8)
    ax.imshow(done, cmap="Greens", vmin=0, vmax=1.6, aspect="auto")
    ring = steps == 2 * (world - 1) and all(len(t["messages"]) == steps for t in traces)
    names = [f"RS {s + 1}" if s < world - 1 else f"AG {s - world + 2}" for s in range(steps)] if ring else \
        [f"send {s + 1}" for s in range(steps)]
    ax.set_xticks(range(steps), names, fontsize=8)
    ax.set_yticks(range(world), [f"rank {r}" for r in range(world)], fontsize=8)
    ax.tick_params(length=0)
    fig.tight_layout()
    return fig

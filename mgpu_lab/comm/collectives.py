"""The collectives, seen on real ranks, and a ring all-reduce built from send and recv.

- :func:`show_all` runs broadcast, reduce, all_reduce, all_gather, reduce_scatter,
  all_to_all and a send/recv ring in every rank and returns each rank's tensor
  before and after; :func:`plot_collectives` draws them as grids.
- :func:`ring_allreduce` is the sum over ranks by a reduce-scatter phase and an
  all-gather phase around a ring, with ``isend``/``irecv`` only;
  :func:`ring_trace` runs it on values ``10**rank`` and keeps every step, so the
  digits of each chunk say which ranks it already holds; :func:`plot_ring` draws it.

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

__all__ = ["show_all", "plot_collectives", "ring_allreduce", "ring_trace", "plot_ring", "OPS"]

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


def ring_allreduce(tensor: torch.Tensor, trace: list | None = None) -> torch.Tensor:
    """The sum of ``tensor`` over all ranks, by isend/irecv around a ring.

    The flat tensor is cut into ``world_size`` chunks (``tensor_split``: any size
    works). Reduce-scatter: in ``W - 1`` steps every rank passes one chunk to its
    right neighbour and adds the chunk coming from its left, so that rank ``r``
    ends with the full sum of chunk ``r + 1``. All-gather: ``W - 1`` more steps
    pass the finished chunks around. Each rank sends ``2 (W - 1) / W`` of the tensor.

    Args:
        tensor: this rank's tensor (any shape, on this rank's device).
        trace: when a list, this rank's chunks are appended to it after every step.

    Returns:
        A new tensor of the same shape: the element-wise sum over ranks.
    """
    rank, world = tdist.get_rank(), tdist.get_world_size()
    flat = tensor.detach().reshape(-1).clone()
    chunks = list(flat.tensor_split(world))  # views into flat
    right, left = (rank + 1) % world, (rank - 1) % world
    if trace is not None:
        trace.append([c.tolist() for c in chunks])
    for step in range(world - 1):  # reduce-scatter
        send_i, recv_i = (rank - step) % world, (rank - step - 1) % world
        incoming = torch.empty_like(chunks[recv_i])
        reqs = [tdist.isend(chunks[send_i], right), tdist.irecv(incoming, left)]
        for req in reqs:
            req.wait()
        chunks[recv_i] += incoming
        if trace is not None:
            trace.append([c.tolist() for c in chunks])
    for step in range(world - 1):  # all-gather: pass the finished chunks on
        send_i, recv_i = (rank + 1 - step) % world, (rank - step) % world
        reqs = [tdist.isend(chunks[send_i], right), tdist.irecv(chunks[recv_i], left)]
        for req in reqs:
            req.wait()
        if trace is not None:
            trace.append([c.tolist() for c in chunks])
    return flat.view_as(tensor)


def ring_trace(elements_per_chunk: int = 1) -> dict:
    """Rank r's chunks after every step of :func:`ring_allreduce` on values ``10**r``.

    A chunk holding ``1101`` (10**0 + 10**2 + 10**3) has the values of ranks 0, 2
    and 3 added up; :func:`plot_ring` labels it ``023``.
    Returns ``{"steps": [[chunk values, ...] per step], "sent": bytes this rank sent,
    "bytes": the tensor's bytes, "same": equal to dist.all_reduce}``.
    """
    from mgpu_lab.comm.record import record

    rank, world = tdist.get_rank(), tdist.get_world_size()
    x = torch.full((world * elements_per_chunk,), float(10 ** rank), device=_device())
    steps = []
    with record() as log:
        got = ring_allreduce(x, steps)
    expected = x.clone()
    tdist.all_reduce(expected)
    sent = sum(e["bytes"] for e in log.events if e["op"] == "send")
    return {"steps": steps, "sent": sent, "bytes": x.numel() * x.element_size(),
            "same": bool(torch.equal(got, expected))}


def _ranks_in(value: int, world: int) -> str:
    """``1011`` (= 10**0 + 10**1 + 10**3) -> ``"013"``: the ranks whose values a chunk holds."""
    digits = f"{value:0{world}d}"[::-1]
    held = "".join(str(r) for r, d in enumerate(digits) if d != "0")
    return "all" if len(held) == world else held


def plot_ring(traces: list[dict]):
    """Draw every rank's chunks after each step of the ring (one panel per step)."""
    import matplotlib.pyplot as plt
    import numpy as np

    world, steps = len(traces), len(traces[0]["steps"])
    fig, axes = plt.subplots(1, steps, figsize=(1.45 * steps, 0.42 * world + 0.9), sharey=True)
    for s, ax in enumerate(np.ravel(axes)):
        grid = np.array([[chunk[0] for chunk in traces[r]["steps"][s]] for r in range(world)])
        done = grid == int("1" * world)
        ax.imshow(done, cmap="Greens", vmin=0, vmax=1.6, aspect="auto")
        for (r, c), value in np.ndenumerate(grid):
            ax.text(c, r, _ranks_in(int(value), world), ha="center", va="center", fontsize=8)
        ax.set_xticks(range(world), [f"c{c}" for c in range(world)], fontsize=7)
        ax.set_yticks(range(world), [f"rank {r}" for r in range(world)], fontsize=7)
        ax.tick_params(length=0)
        phase = "start" if s == 0 else (f"RS {s}" if s < world else f"AG {s - world + 1}")
        ax.set_title(phase, fontsize=9)
    fig.tight_layout()
    return fig

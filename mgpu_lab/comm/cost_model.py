"""What a collective costs: all_reduce timed over message sizes, and the alpha-beta model.

The time of one message of ``n`` bytes is modelled as ``alpha + n * beta``:
``alpha`` is the latency (start-up cost of any message, however small) and
``1 / beta`` the bandwidth. nccl-tests reports two bandwidths for a collective:
the *algorithm bandwidth* ``algbw = n / time`` and the *bus bandwidth*
``busbw = algbw * factor``, where the factor turns the data a collective moves
per rank into link traffic (``2 (W - 1) / W`` for all_reduce, ``(W - 1) / W``
for all_gather and reduce_scatter, ``1`` for broadcast and reduce), so that
busbw is comparable across world sizes and with the hardware's link speed.

Example:
    >>> from mgpu_lab import launch
    >>> from mgpu_lab.comm import cost_model
    >>> sizes = cost_model.SIZES
    >>> times = launch(cost_model.time_ops, 2, sizes)[0]["all_reduce"]
    launch: 2 ranks · ...
    >>> alpha, bandwidth = cost_model.fit_alpha_beta(sizes, times)
    >>> len(times) == len(sizes), bandwidth > 0   # a median time per size; bytes per second
    (True, True)
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as tdist

__all__ = ["SIZES", "time_ops", "fit_alpha_beta", "bus_factor", "human_size", "table", "plot", "overlapped_step"]

SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]  # bytes
_FACTORS = {"all_reduce": lambda w: 2 * (w - 1) / w, "all_gather": lambda w: (w - 1) / w,
            "reduce_scatter": lambda w: (w - 1) / w, "broadcast": lambda w: 1.0, "reduce": lambda w: 1.0}


def bus_factor(op: str, world_size: int) -> float:
    """nccl-tests' factor from algorithm to bus bandwidth (``2 (W - 1) / W`` for all_reduce).

    Raises:
        ValueError: an op nccl-tests defines no factor for here.

    Example:
        >>> bus_factor("all_reduce", 4)
        1.5
    """
    if op not in _FACTORS:
        raise ValueError(f"bus_factor: no factor for op={op!r}; known: {', '.join(_FACTORS)}")
    return _FACTORS[op](world_size)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ops(sizes=SIZES, reps: int = 5, ops=("all_reduce",), ring=None) -> dict:
    """In every rank: the median seconds of one call of each op for each size (bytes).

    Each measurement starts after a barrier, so the ranks start together; on a GPU
    the clock stops after ``cuda.synchronize``. ``ops`` may hold ``"all_reduce"``
    and ``"ring"``: the function ``ring(tensor)`` given (lesson 09's ring all-reduce, the
    learner's in the notebook). One untimed call per size comes first (connection
    set-up, allocation).

    Returns:
        ``{op: [seconds per size], "device": str, "backend": str, "world_size": int}``.
    """
    from mgpu_lab import dist as mdist

    calls = {"all_reduce": tdist.all_reduce, "ring": ring}
    unknown = [op for op in ops if op not in calls]
    if unknown:
        raise ValueError(f"time_ops: unknown ops {unknown}; use 'all_reduce' and/or 'ring'")
    if "ring" in ops and not callable(ring):
        raise ValueError(f"time_ops: op 'ring' needs the ring function, ring=..., got ring={ring!r}")
    backend = tdist.get_backend()
    device = mdist.device() if backend == "nccl" else torch.device("cpu")
    out = {"device": str(device), "backend": backend, "world_size": tdist.get_world_size()}
    for op in ops:
        out[op] = []
        for size in sizes:
            x = torch.ones(max(1, size // 4), device=device)
            calls[op](x)
            runs = []
            for _ in range(reps):
                tdist.barrier()
                _sync(device)
                t0 = time.perf_counter()
                calls[op](x)
                _sync(device)
                runs.append(time.perf_counter() - t0)
            out[op].append(statistics.median(runs))
    return out


def fit_alpha_beta(sizes, seconds) -> tuple[float, float]:
    """Fit ``t = alpha + n * beta``; return ``(alpha in seconds, bandwidth 1/beta in bytes/s)``.

    The fit weighs every point by ``1 / t`` (relative error), so the small messages
    that pin down ``alpha`` count as much as the large ones that pin down ``beta``.

    Raises:
        ValueError: fewer than two sizes, or lists of different lengths.

    Example:
        >>> alpha, bw = fit_alpha_beta([1e3, 1e6], [1.01e-4, 1.1e-3])
        >>> round(alpha * 1e6), round(bw / 1e9, 2)
        (100, 1.0)
    """
    import numpy as np

    if len(sizes) != len(seconds) or len(sizes) < 2:
        raise ValueError(f"fit_alpha_beta needs two or more (size, time) pairs; got {len(sizes)} sizes "
                         f"and {len(seconds)} times")
    n, t = np.asarray(sizes, dtype=float), np.asarray(seconds, dtype=float)
    beta, alpha = np.polyfit(n, t, 1, w=1 / t)
    return float(alpha), float(1 / beta) if beta > 0 else float("inf")


def human_size(size: float) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1, e.g. ``human_size(4096) == "4 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}"
        size /= 1024
    return f"{size:.0f} GiB"


def table(sizes, result: dict, op: str = "all_reduce") -> str:
    """The measurement as nccl-tests prints it: size, time, algbw, busbw (GB/s = 1e9 bytes/s)."""
    world = result["world_size"]
    factor = bus_factor("all_reduce", world)
    lines = [f"{'size':>9} {'time (us)':>10} {'algbw (GB/s)':>13} {'busbw (GB/s)':>13}"]
    for size, seconds in zip(sizes, result[op]):
        algbw = size / seconds / 1e9
        lines.append(f"{human_size(size):>9} {seconds * 1e6:>10.1f} {algbw:>13.3f} {algbw * factor:>13.3f}")
    return "\n".join(lines)


def plot(sizes, result: dict, ops=("all_reduce",), ax=None):
    """Time against message size (log-log), with the alpha-beta fit of the first op."""
    import matplotlib.pyplot as plt
    import numpy as np

    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.2))
    for op in ops:
        ax.plot(sizes, np.array(result[op]) * 1e6, "o-", label=op)
    alpha, bw = fit_alpha_beta(sizes, result[ops[0]])
    grid = np.geomspace(min(sizes), max(sizes), 50)
    ax.plot(grid, (alpha + grid / bw) * 1e6, "k--", lw=1,
            label=f"fit: {alpha * 1e6:.0f} us + n / {bw / 1e9:.2f} GB/s")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("time per call (us)")
    ax.set_title(f"{result['world_size']} ranks, {result['backend']} on {result['device']}")
    ax.legend(fontsize=8)
    return ax


def overlapped_step(param_bytes: list[int], backward_s: list[float], cap_bytes: float, alpha: float,
                    bandwidth: float) -> float:
    """Modelled seconds of DDP's backward when the all-reduces run beside it, as NCCL does on a GPU.

    Backward computes the parameters' gradients from the last to the first, ``backward_s[i]``
    seconds for parameter ``i``; the buckets are DDP's (filled from the last parameter, closed
    once they reach ``cap_bytes``); a bucket's all-reduce starts when its last gradient is ready
    and the bucket before it is through, and takes ``alpha + bytes / bandwidth``. Communication
    and computation share nothing here (separate engines): on a CPU, where gloo's threads and
    backward share the cores, a measured step can look quite different.

    Args:
        param_bytes, backward_s: per parameter, in registration order.
        cap_bytes: the bucket cap. alpha: seconds per message. bandwidth: bytes per second.

    Returns:
        Seconds from the start of backward until the last all-reduce is done.

    Example:
        >>> grads, secs = [4, 4, 4, 4], [1.0, 1.0, 1.0, 1.0]     # 4 parameters, 1 s of backward each
        >>> overlapped_step(grads, secs, 4, alpha=0.5, bandwidth=8)    # 4 buckets: all but the last hidden
        5.0
        >>> overlapped_step(grads, secs, 16, alpha=0.5, bandwidth=8)   # 1 bucket, sent after backward
        6.5
        >>> overlapped_step(grads, secs, 1, alpha=2.0, bandwidth=8)    # latency-bound: queued messages
        11.0
    """
    t, size, buckets = 0.0, 0, []
    for nbytes, secs in zip(reversed(param_bytes), reversed(backward_s)):
        t += secs
        size += nbytes
        if size >= cap_bytes:
            buckets.append((size, t))
            size = 0
    if size:
        buckets.append((size, t))
    done = 0.0
    for nbytes, ready in buckets:
        done = max(done, ready) + alpha + nbytes / bandwidth
    return max(t, done)

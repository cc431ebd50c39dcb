"""Inside DDP: gradient buckets, when their all-reduces run, and what the bucket size costs.

DDP does not all-reduce gradient by gradient: it groups the parameters into
buckets of about ``bucket_cap_mb`` and all-reduces a bucket as soon as every
gradient in it is ready, while backward goes on with the earlier layers.

- :func:`bucket_probe` and :func:`named_buckets`: the buckets a real DDP forms, seen
  from a communication hook, iteration by iteration;
- :func:`overlap_probe` and :func:`plot_overlap`: when each layer's backward and each
  bucket's all-reduce ran, from hooks, on every rank;
- :func:`step_time_probe`: the time of a training step for several bucket caps;
- :func:`side_by_side_probe`: a DDP of your own (lesson 09's MiniDDP) trained next to DDP.

Which bucket a parameter lands in, for given sizes and cap, is worked out in the lesson itself.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as tdist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

__all__ = ["SizedModel", "bucket_probe", "named_buckets", "mlp",
           "overlap_probe", "plot_overlap", "step_time_probe", "side_by_side_probe"]


class SizedModel(nn.Module):
    """Parameters of given sizes (float32), used in registration order by ``forward``.

    Their gradients become ready in reverse order, as in a network run layer by layer.
    """

    def __init__(self, param_bytes: list[int]):
        super().__init__()
        bad = [b for b in param_bytes if b < 4 or b % 4]
        if bad:
            raise ValueError(f"SizedModel holds float32 parameters: sizes must be multiples of 4 bytes, got {bad}")
        torch.manual_seed(0)
        self.params = nn.ParameterList(nn.Parameter(torch.randn(b // 4)) for b in param_bytes)

    def forward(self, x):
        for p in self.params:
            x = x + p.sum()
        return x


def _recorder(names: dict, seen: list):
    def hook(state, bucket):
        seen.append([names[id(p)] for p in bucket.parameters()])
        return default_hooks.allreduce_hook(state, bucket)

    return hook


def bucket_probe(param_bytes: list[int], cap_bytes: int, steps: int = 2) -> list[list[list[int]]]:
    """In a rank: the buckets a real DDP all-reduces in each of ``steps`` iterations.

    Returns:
        Per iteration, the buckets in the order their hooks ran, as parameter indices.
    """
    model = SizedModel(param_bytes)
    ddp = DDP(model, bucket_cap_mb=cap_bytes / 2**20)
    seen: list = []
    ddp.register_comm_hook(None, _recorder({id(p): i for i, p in enumerate(model.parameters())}, seen))
    out = []
    for _ in range(steps):
        seen.clear()
        ddp(torch.ones(1)).sum().backward()
        out.append([list(b) for b in seen])
    return out


def mlp(width: int = 256, depth: int = 4, classes: int = 10, seed: int = 0) -> nn.Sequential:
    """``depth`` Linear+ReLU layers of ``width`` and a classifier: the lesson's model."""
    torch.manual_seed(seed)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, classes))


def named_buckets(model_fn, cap_mb: float, steps: int = 2, batch: int = 8) -> dict:
    """In a rank: DDP's buckets for ``model_fn()`` per iteration, by parameter name, and their bytes."""
    model = model_fn()
    ddp = DDP(model, bucket_cap_mb=cap_mb)
    names = {id(p): n for n, p in model.named_parameters()}
    sizes = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
    seen: list = []
    ddp.register_comm_hook(None, _recorder(names, seen))
    width = next(model.parameters()).shape[1]
    out = []
    for _ in range(steps):
        seen.clear()
        ddp(torch.randn(batch, width)).sum().backward()
        out.append([list(b) for b in seen])
    return {"steps": out, "bytes": sizes}


def overlap_probe(model_fn, cap_mb: float, batch: int = 64, steps: int = 3) -> dict:
    """In a CPU rank (gloo): when each Linear's backward and each bucket's all-reduce ran.

    Times are ``time.perf_counter()`` seconds (one clock for the processes of a
    machine) relative to the start of backward, from the last of ``steps``
    iterations. A bucket's all-reduce starts when DDP calls the communication hook
    (its last gradient is ready) and ends when the all-reduce's future completes.
    The model runs on the CPU: on a GPU, host timestamps in hooks mark when work is
    queued, not when it runs (measure there with ``torch.profiler``).
    """
    model = model_fn()
    ddp = DDP(model, bucket_cap_mb=cap_mb)
    spans: dict = {"compute": [], "comm": []}
    starts: dict = {}
    for name, module in model.named_children():
        if isinstance(module, nn.Linear):
            module.register_full_backward_pre_hook(
                lambda m, g, name=name: starts.__setitem__(name, time.perf_counter()))
            module.register_full_backward_hook(
                lambda m, gi, go, name=name: spans["compute"].append([f"layer {name}", starts[name],
                                                                      time.perf_counter()]))

    def hook(state, bucket):
        index, buffer, t0 = bucket.index(), bucket.buffer(), time.perf_counter()

        def done(fut):
            spans["comm"].append([f"bucket {index}", t0, time.perf_counter(),
                                  buffer.numel() * buffer.element_size()])
            return fut.value()[0]

        buffer.div_(tdist.get_world_size())
        return tdist.all_reduce(buffer, async_op=True).get_future().then(done)

    ddp.register_comm_hook(None, hook)
    x = torch.randn(batch, model[0].in_features, requires_grad=True)  # so the first layer's hook fires
    for _ in range(steps):
        spans["compute"].clear()
        spans["comm"].clear()
        ddp.zero_grad()
        loss = ddp(x).square().mean()
        t0 = time.perf_counter()
        loss.backward()
        t1 = time.perf_counter()
    shift = lambda rows: [[r[0], r[1] - t0, r[2] - t0, *r[3:]] for r in rows]  # noqa: E731
    return {"compute": shift(spans["compute"]), "comm": shift(spans["comm"]), "backward": t1 - t0,
            "rank": tdist.get_rank()}


def plot_overlap(results: list[dict], ax=None):
    """Backward compute (per layer) and all-reduce (per bucket) of every rank, on one time axis.

    Each bucket's all-reduce gets a strip of its own (they may overlap in time), tall enough
    for its label; a bar is labelled (``L<k>`` for layer k, ``b<i>`` for bucket i) only where
    the label fits inside it, so that labels never run into each other.
    """
    import matplotlib.pyplot as plt

    strips = max(len(res["comm"]) for res in results)
    lane_rows = [("compute", 1)] + [("comm", strips)]
    height = sum(rows for _, rows in lane_rows) * len(results)
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.8 + 0.22 * height))
    end = max(max(b for _, _, b, *_ in res[k]) for res in results for k in ("compute", "comm") if res[k]) * 1e3
    ticks, names, y = [], [], 0.0
    for res in results:
        for kind, rows in lane_rows:
            color = "tab:orange" if kind == "compute" else "tab:green"
            ticks.append(y + rows / 2)
            names.append(f"rank {res['rank']} {'backward' if kind == 'compute' else 'all-reduce'}")
            for i, (label, a, b, *_) in enumerate(sorted(res[kind], key=lambda s: s[1])):
                low = y + (i if kind == "comm" else 0) + 0.1
                ax.broken_barh([(a * 1e3, (b - a) * 1e3)], (low, 0.8), color=color, edgecolor="white")
                text = ("L" if kind == "compute" else "b") + label.split()[-1]
                if (b - a) * 1e3 > 0.025 * end * len(text):  # the label fits inside its bar
                    ax.text((a + b) / 2 * 1e3, low + 0.4, text, ha="center", va="center", fontsize=7)
            y += rows + 0.5
    ax.set_yticks(ticks, names, fontsize=8)
    ax.set_ylim(y, 0)
    ax.set_xlim(0, end * 1.02)
    ax.set_xlabel("time since backward started (ms)")
    return ax


def step_time_probe(model_fn, caps_mb: list[float], batch: int = 64, steps: int = 5) -> dict:
    """In a rank: the median seconds of a DDP training step (forward, backward, SGD) per bucket cap."""
    from mgpu_lab import dist as mdist

    device = mdist.device()
    out = {}
    for cap in caps_mb:
        model = model_fn().to(device)
        ddp = DDP(model, bucket_cap_mb=cap, device_ids=[device.index] if device.type == "cuda" else None)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        x = torch.randn(batch, model[0].in_features, device=device)
        times = []
        for i in range(steps + 2):  # two untimed: the first one buckets everything together
            tdist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad()
            ddp(x).square().mean().backward()
            opt.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= 2:
                times.append(time.perf_counter() - t0)
        out[cap] = {"seconds": statistics.median(times), "buckets": ddp._get_ddp_logging_data().get(
            "rebuilt_bucket_sizes", "")}
    return out


def side_by_side_probe(wrapper, model_fn, cap_mb: float, batch: int = 32, steps: int = 4, lr: float = 0.05) -> dict:
    """In a rank: SGD with ``wrapper(model, cap_bytes)`` (lesson 09's MiniDDP) next to DDP, same start, same data.

    ``wrapper`` must offer ``finish_gradient_sync()``, called after each backward. Each
    rank trains on its own batches; the all-reduces of the wrapper's steps are recorded.

    Returns:
        ``{"losses": {"DDP": [...], "yours": [...]}`` (this rank's), ``"largest weight difference"``
        after the last step, ``"all-reduces per step"`` and ``"bytes per all-reduce"`` (last step)}.
    """
    from mgpu_lab.comm.record import record

    rank = tdist.get_rank()
    theirs, mine = model_fn(), model_fn()
    ddp, wrapped = DDP(theirs, bucket_cap_mb=cap_mb), wrapper(mine, int(cap_mb * 2**20))
    inputs = next(theirs.parameters()).shape[1]
    g = torch.Generator().manual_seed(1000 + rank)
    data = [(torch.randn(batch, inputs, generator=g), torch.randint(0, 10, (batch,), generator=g))
            for _ in range(steps)]
    out = {"losses": {"DDP": [], "yours": []}, "all-reduces per step": [], "bytes per all-reduce": []}
    for name, model, run in (("DDP", theirs, ddp), ("yours", mine, wrapped)):
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        for x, y in data:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(run(x), y)
            with record() as log:
                loss.backward()
                if name == "yours":
                    run.finish_gradient_sync()
            if name == "yours":
                sizes = [e["bytes"] for e in log.events if e["op"] == "all_reduce"]
                out["all-reduces per step"].append(len(sizes))
                out["bytes per all-reduce"] = sizes
            opt.step()
            out["losses"][name].append(round(loss.item(), 6))
    with torch.no_grad():
        out["largest weight difference"] = max(float((a - b).abs().max())
                                               for a, b in zip(theirs.parameters(), mine.parameters()))
    return out

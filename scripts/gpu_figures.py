#!/usr/bin/env python3
"""The figures the lessons promise on a GPU, measured side by side in one run (part of `make gpu-check`).

- ``copy`` (lesson 02): host-to-GPU copies from pageable and pinned memory, and how long
  ``non_blocking=True`` holds the Python thread for each;
- ``ddp_overhead`` (lesson 04): DDP on one rank (NCCL) against the same training without DDP;
- ``precision`` (lesson 04): a step in fp32, bf16 autocast and fp16 autocast with GradScaler;
- ``fsdp_memory`` (lesson 08): ``max_memory_allocated`` of a step under DDP, ZeRO-1 and FSDP2 against
  lesson 08's formula, on one NCCL rank (the only sharding one GPU allows; more ranks need more GPUs);
- ``snapshot`` (lesson 13): the CUDA allocator's memory snapshot of a training step;
- ``trace_streams`` (lesson 13): a profiled CUDA step's trace, its kernels per GPU stream lane.

``--out FILE`` writes them as JSON; ``--list`` (on a machine without a GPU) only proves every figure's code
imports and names them. Timings are medians of repeated runs with the GPU synchronised.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project, where it is not installed


def _mlp(width: int = 2048, depth: int = 4):
    import torch.nn as nn

    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def _median_step(step, repeats: int = 20, warmup: int = 3) -> float:
    import torch

    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _train_step(model, opt, x, y, autocast_dtype=None, scaler=None):
    import torch
    import torch.nn.functional as F

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=autocast_dtype, enabled=autocast_dtype is not None):
            loss = F.cross_entropy(model(x), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
    return step


def ddp_rank(width: int = 2048, batch: int = 256) -> dict:
    """In one NCCL rank: seconds per step of the same model and data without and with DDP."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    x, y = torch.randn(batch, width, device="cuda"), torch.randint(0, 10, (batch,), device="cuda")
    plain = _mlp(width).cuda()
    wrapped = DDP(_mlp(width).cuda(), device_ids=[torch.cuda.current_device()])
    out = {}
    for name, model in (("plain_s", plain), ("ddp_s", wrapped)):
        out[name] = _median_step(_train_step(model, torch.optim.SGD(model.parameters(), lr=1e-3), x, y))
    out["ddp_over_plain"] = out["ddp_s"] / out["plain_s"]
    return out


def precision(width: int = 4096, batch: int = 512) -> dict:
    """Seconds per step in fp32, bf16 autocast and fp16 autocast + GradScaler, and their ratios to fp32."""
    import torch

    torch.manual_seed(0)
    x, y = torch.randn(batch, width, device="cuda"), torch.randint(0, 10, (batch,), device="cuda")
    out = {}
    for name, dtype in (("fp32_s", None), ("bf16_s", torch.bfloat16), ("fp16_scaler_s", torch.float16)):
        model = _mlp(width).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler("cuda") if dtype is torch.float16 else None
        out[name] = _median_step(_train_step(model, opt, x, y, dtype, scaler))
    out.update({f"{k[:-2]}_speedup": out["fp32_s"] / out[k] for k in ("bf16_s", "fp16_scaler_s")})
    out["tf32_matmul"] = torch.backends.cuda.matmul.allow_tf32
    return out


def copy() -> dict:
    from mgpu_lab.data.throughput import copy_timing

    return copy_timing(shape=(64, 3, 224, 224), device="cuda", repeats=10)


def fsdp_memory() -> list[dict]:
    from mgpu_lab.sharding.side_by_side import compare

    rows = compare(nprocs=1, width=1024, depth=4, features=256, batch=64)[0]
    return [{k: r[k] for k in ("scheme", "n_params", "formula", "peak", "step_s", "device")}
            | {"peak_over_formula": r["peak"] / r["formula"]} for r in rows]


def snapshot() -> dict:
    import torch

    from mgpu_lab.profiling.traces import memory_snapshot

    model = _mlp(1024).cuda()
    step = _train_step(model, torch.optim.Adam(model.parameters()), torch.randn(128, 1024, device="cuda"),
                       torch.randint(0, 10, (128,), device="cuda"))
    path = Path(tempfile.mkdtemp()) / "snapshot.pickle"
    out = memory_snapshot(lambda: [step() for _ in range(2)], str(path))
    return {"peak_bytes": out["peak_bytes"], "snapshot_bytes": path.stat().st_size}


def trace_streams() -> dict:
    import torch

    from mgpu_lab.profiling import lanes, traces

    model = _mlp(1024).cuda()
    step = _train_step(model, torch.optim.SGD(model.parameters(), lr=1e-3), torch.randn(128, 1024, device="cuda"),
                       torch.randint(0, 10, (128,), device="cuda"))
    trace = traces.load_trace(traces.profile_steps(step, tempfile.mkdtemp()))
    return {name: len(spans) for name, spans in lanes.lanes(trace)}


def _ddp_overhead() -> dict:
    from mgpu_lab.launcher.launch import launch

    return launch(ddp_rank, 1, backend="nccl")[0]


FIGURES = {"copy": copy, "ddp_overhead": _ddp_overhead, "precision": precision, "fsdp_memory": fsdp_memory,
           "snapshot": snapshot, "trace_streams": trace_streams}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--list", action="store_true", help="name the figures and import their code; measure nothing")
    args = parser.parse_args(argv)
    if args.list:
        import mgpu_lab.data.throughput, mgpu_lab.profiling.lanes, mgpu_lab.sharding.side_by_side  # noqa: F401
        print("figures (need a GPU):", ", ".join(FIGURES))
        return 0
    results, failed = {}, 0
    for name, measure in FIGURES.items():
        start = time.perf_counter()
        try:
            results[name] = measure()
        except Exception as err:  # one figure's failure is reported; the others are still measured
            results[name], failed = {"error": f"{type(err).__name__}: {err}"}, failed + 1
        print(f"{name} ({time.perf_counter() - start:.1f} s): {json.dumps(results[name], default=str)}", flush=True)
    args.out.write_text(json.dumps(results, indent=1, default=str) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

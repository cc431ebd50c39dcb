"""Lesson 13's measured runs: profiled DDP and FSDP2 steps in ranks, checkpointing's cost, compile's cost.

Rank functions (for ``launch``): :func:`ddp_trace` and :func:`fsdp_trace` profile training steps,
labelled ``forward``, ``backward`` and ``optimizer`` with ``record_function``, and return the trace
file each rank wrote (:func:`mgpu_lab.profiling.traces.profile_steps`).
In one process: :func:`checkpoint_modes` applies no, full or selective checkpointing to every
block of a model, :func:`step_seconds` times forward and backward, :func:`step_flops` counts their
floating-point operations, and :func:`compile_seconds`
times ``torch.compile``'s first call against the steps after it.

Example:
    >>> from mgpu_lab.profiling.blocks import BlockStack, tokens
    >>> model, x = BlockStack(ratios=(2, 2)), tokens(2, 8, 32)
    >>> checkpoint_modes(model, "full") and step_seconds(model, x, repeats=1) > 0
    True
"""
from __future__ import annotations

import functools
import inspect
import time
import warnings

import torch
import torch.distributed as tdist
from torch import nn
from torch.profiler import record_function

from .traces import BusyThread, profile_steps

__all__ = ["ddp_trace", "fsdp_trace", "fsdp_compiled", "checkpoint_modes", "step_seconds", "step_flops",
           "compile_seconds", "MODES"]

MODES = ("none", "full", "selective")


def _mlp(width: int, depth: int) -> nn.Module:
    from mgpu_lab.comm.ddp_buckets import mlp

    return mlp(width, depth)


def ddp_trace(folder: str, cap_mb: float = 0.25, width: int = 256, depth: int = 6, batch: int = 64,
              no_sync: bool = False, helper: int = 0, name: str = "ddp-rank", compile_backend=None) -> str:
    """In a rank: profile DDP steps of ``depth`` Linear+ReLU layers of ``width``; the trace's path.

    Args:
        cap_mb: DDP's ``bucket_cap_mb``: small caps make several buckets whose all-reduces overlap
            backward; a cap above the model's size makes one, all-reduced after backward.
        no_sync: each step is two micro-batches, the first under ``no_sync()`` (no communication).
        helper: when above 0, a :class:`~mgpu_lab.profiling.traces.BusyThread` multiplies matrices of
            ``helper x helper`` beside the training loop, and the trace records every thread.
        compile_backend: compile the model (``model.compile(backend=...)``) before wrapping it in DDP.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    from mgpu_lab.sharding.fsdp import rank_device

    device = rank_device()  # this rank's GPU under NCCL, else the CPU
    model = _mlp(width, depth).to(device)
    if compile_backend is not None:
        model.compile(backend=compile_backend)  # before wrapping: lesson 09
    ddp = DDP(model, bucket_cap_mb=cap_mb)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(tdist.get_rank())).to(device)

    def step():
        opt.zero_grad()
        if no_sync:
            with ddp.no_sync(), record_function("micro-batch without sync"):
                ddp(x).square().mean().backward()
        with record_function("forward"):
            loss = ddp(x).square().mean()
        with record_function("backward"):
            loss.backward()
        with record_function("optimizer"):
            opt.step()

    if not helper:
        return profile_steps(step, folder, wait=1, warmup=1, active=1, name=name)
    with BusyThread(size=helper):
        return profile_steps(step, folder, wait=1, warmup=1, active=1, name=name, all_threads=True)


def fsdp_trace(folder: str, width: int = 256, depth: int = 4, batch: int = 32, mixed: bool = False,
               name: str = "fsdp-rank") -> str:
    """In a rank: profile FSDP2 steps of lesson 08's ``BlockNet`` (``fully_shard`` per block, then the root).

    ``mixed`` adds FSDP2's ``MixedPrecisionPolicy``: bfloat16 parameters for compute, gradients
    reduced in float32. The casts are no ``aten::_to_copy`` events of their own: the trace shows them as
    the ``aten::_foreach_copy_`` that fills each all-gather's bfloat16 buffer from the float32 shards, and
    the ``aten::_chunk_cat`` that copies the bfloat16 gradients into each float32 reduce-scatter buffer.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from mgpu_lab.sharding.fsdp import BlockNet, make_mesh

    from mgpu_lab.sharding.fsdp import rank_device

    mesh = make_mesh()
    model = BlockNet(features=width, width=width, depth=depth, classes=10).to(rank_device())
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else None
    options = {"mesh": mesh} | ({"mp_policy": policy} if policy else {})
    for block in model.blocks:
        fully_shard(block, **options)
    fully_shard(model, **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(tdist.get_rank())).to(rank_device())

    def step():
        opt.zero_grad()
        with record_function("forward"):
            loss = model(x).float().square().mean()
        with record_function("backward"):
            loss.backward()
        with record_function("optimizer"):
            opt.step()

    return profile_steps(step, folder, wait=1, warmup=1, active=1, name=name)


def _checkpointed(forward, context_fn=None):
    from torch.utils.checkpoint import checkpoint

    options = {} if context_fn is None else {"context_fn": context_fn}
    if context_fn is not None and "respect_saved_tensors_hooks" in inspect.signature(checkpoint).parameters:
        options["respect_saved_tensors_hooks"] = True  # what selective checkpointing keeps shows in saved-tensor hooks

    @functools.wraps(forward)
    def run(*args):
        return checkpoint(forward, *args, use_reentrant=False, **options)

    return run


def checkpoint_modes(model: nn.Module, mode: str) -> nn.Module:
    """Checkpoint every block of ``model.blocks`` (in place): ``"none"``, ``"full"`` or ``"selective"``.

    ``"full"`` keeps only each block's input and recomputes the block in backward; ``"selective"``
    keeps the outputs of the matrix products and attention and recomputes the rest
    (:func:`mgpu_lab.profiling.blocks.matmul_policy`). Calling it again replaces the mode.

    Raises:
        ValueError: an unknown mode.
    """
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    from .blocks import matmul_policy

    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: use one of {MODES}")
    context = functools.partial(create_selective_checkpoint_contexts, matmul_policy)
    for block in model.blocks:
        block.__dict__.pop("forward", None)  # back to the class's forward
        if mode != "none":
            block.forward = _checkpointed(block.forward, context if mode == "selective" else None)
    return model


def step_seconds(model: nn.Module, x: torch.Tensor, repeats: int = 5) -> float:
    """The median wall time of ``repeats`` forward+backward passes (after one untimed pass)."""
    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        model(x).square().mean().backward()
        if i:
            times.append(time.perf_counter() - start)
    model.zero_grad()
    return sorted(times)[len(times) // 2]


def step_flops(model: nn.Module, x: torch.Tensor, early_stop: bool = True) -> dict:
    """The floating-point operations of one forward+backward, counted by ``torch.utils.flop_counter``.

    Exact and the same on every machine, unlike a stopwatch: the counter adds up the formula of every
    matrix product it sees (``aten.mm``, ``aten.addmm``, ...), recomputations in backward included.
    It has no formula for element-wise operators, and none for the CPU's attention kernel
    (``_scaled_dot_product_flash_attention_for_cpu``): on a CPU those count 0.

    Args:
        early_stop: non-reentrant checkpointing's default, which stops a recomputation as soon as it
            has every tensor backward needs (``torch.utils.checkpoint.set_checkpoint_early_stop``);
            False recomputes each checkpointed block's whole forward.

    Returns:
        ``{operator name: FLOPs}``, with ``"total"``.

    Example:
        >>> lin = nn.Linear(8, 4, bias=False)
        >>> step_flops(lin, torch.randn(2, 8, requires_grad=True))  # forward 2*2*8*4, backward twice that
        {'aten.mm': 384, 'total': 384}
    """
    from torch.utils.checkpoint import set_checkpoint_early_stop
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter, set_checkpoint_early_stop(early_stop):
        model(x).square().mean().backward()
    model.zero_grad()
    counts = {str(op): int(n) for op, n in counter.get_flop_counts().get("Global", {}).items()}
    return counts | {"total": int(counter.get_total_flops())}


def compile_seconds(model: nn.Module, x: torch.Tensor, backend: str = "aot_eager", repeats: int = 5) -> dict:
    """``torch.compile`` each block of ``model.blocks`` with ``backend``: the first step's time, and later ones.

    Returns:
        ``{"eager", "first", "compiled"}`` in seconds: a step before compiling (median), the first
        compiled step (tracing and compiling included) and a compiled step after it (median).
    """
    torch._dynamo.reset()
    eager = step_seconds(model, x, repeats)
    for block in model.blocks:
        block.compile(backend=backend)
    start = time.perf_counter()
    model(x).square().mean().backward()
    first = time.perf_counter() - start
    return {"eager": eager, "first": first, "compiled": step_seconds(model, x, repeats)}


def fsdp_compiled(backend: str = "aot_eager", steps: int = 3) -> dict:
    """In a rank: FSDP2 over a :class:`~mgpu_lab.profiling.blocks.BlockStack`, eager and with every block compiled.

    Each block is sharded (``fully_shard``) and then compiled (``block.compile(backend=...)``), so that each
    compiled graph runs between FSDP2's all-gather before the block and its reduce-scatter after it.

    Returns:
        ``{"eager": {...}, "compiled": {...}}``, each with the losses of ``steps`` SGD steps from the
        same weights and data and the seconds they took (the compiled run's first step compiles).
    """
    from mgpu_lab.sharding.fsdp import make_mesh, rank_device

    from .blocks import tokens

    mesh, device = make_mesh(), rank_device()
    x = tokens(2, 32, 64, seed=tdist.get_rank()).to(device)
    out = {}
    with warnings.catch_warnings():
        # the stack's output is a view (its head's): FSDP2 warns that an in-place op on it would skip the
        # all-gather; the loss only reads it
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module", category=UserWarning)
        for how in ("eager", "compiled"):
            out[how] = _fsdp_steps(how, backend, mesh, device, x, steps)
    return out


def _fsdp_steps(how: str, backend: str, mesh, device, x, steps: int) -> dict:
    """``steps`` SGD steps of a fresh FSDP2 stack, its blocks compiled when ``how`` is ``"compiled"``."""
    from torch.distributed.fsdp import fully_shard

    from .blocks import BlockStack

    model = BlockStack(dim=64, heads=4, ratios=(2, 2)).to(device)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
        if how == "compiled":
            block.compile(backend=backend)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, start = [], time.perf_counter()
    for _ in range(steps):
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "seconds": time.perf_counter() - start}

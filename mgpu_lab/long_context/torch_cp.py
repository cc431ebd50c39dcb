"""torch's own context parallelism, ``torch.distributed.tensor.experimental.context_parallel``, on a (W,) mesh.

Inside ``with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):`` torch cuts each
buffer along the sequence (in place; restored on exit) and replaces
``torch.nn.functional.scaled_dot_product_attention`` by a ring attention over the mesh's group: each
rank attends its queries to one K/V shard at a time and merges the partial results with their
log-sum-exp. How the K/V shards travel is the *rotate method*
(``torch.distributed.tensor.experimental._attention.set_rotate_method``): ``"allgather"``, the default,
all-gathers every shard once and then walks through them; ``"alltoall"`` passes each rank's shard to
the next rank, ``W-1`` times. With a sequence divisible by ``2W`` the default *load balancer*
(``_HeadTailLoadBalancer``) first reorders the sequence so that rank ``r`` holds chunks ``r`` and
``2W-1-r`` of ``2W`` (the zig-zag layout of :mod:`.layout`); it then requires ``is_causal=True``.
``context_parallel_unshard`` gathers an output and undoes the reordering.

It covers the CUDA attention kernels only (flash, memory-efficient, cuDNN): on the CPU the call fails
with :data:`CPU_ERROR` (torch 2.14.1), so :func:`why_not` says whether this machine can run it, and
:func:`compare` runs it against full attention where it can.

Example:
    >>> head_tail_positions(8, 2)
    [[0, 1, 6, 7], [2, 3, 4, 5]]
    >>> print(why_not(0))
    this machine has no CUDA GPU, and context_parallel covers the CUDA attention kernels only (on the CPU, ...)
"""
from __future__ import annotations

import torch
import torch.distributed as tdist
import torch.nn.functional as F

__all__ = ["CPU_ERROR", "ROTATE_METHODS", "why_not", "head_tail_positions", "compare_rank", "compare",
           "attempt_on_cpu"]

#: What torch 2.14.1 raises when ``context_parallel``'s attention runs on CPU tensors.
CPU_ERROR = ("Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding "
             "strategy registered.")
#: The rotate methods ``set_rotate_method`` accepts.
ROTATE_METHODS = ("allgather", "alltoall")


def why_not(gpus: int | None = None) -> str | None:
    """Why torch's ``context_parallel`` cannot run on this machine, or None when it can.

    Args:
        gpus: the CUDA GPUs to assume; ``None`` asks torch.

    Returns:
        None with 2 or more CUDA GPUs (one rank per GPU, NCCL); else the reason, in one sentence.
    """
    if gpus is None:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus >= 2:
        return None
    if gpus == 1:
        return ("this machine has 1 CUDA GPU and context_parallel needs one rank per GPU on at least 2 "
                "(NCCL does not run two ranks on one GPU)")
    return (f"this machine has no CUDA GPU, and context_parallel covers the CUDA attention kernels only "
            f"(on the CPU, torch says: {CPU_ERROR!r})")


def head_tail_positions(seq: int, world: int) -> list[list[int]]:
    """The sequence positions each rank holds under torch's default load balancer (``_HeadTailLoadBalancer``).

    Raises:
        ValueError: ``seq`` not divisible by ``2 * world`` (torch then balances nothing).
    """
    if seq % (2 * world):
        raise ValueError(f"seq={seq} is not divisible by 2 * world = {2 * world}: torch's load balancer only "
                         "reorders such sequences; pick seq a multiple of 2 * world")
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer
    order = _HeadTailLoadBalancer(seq, world, "cpu")._generate_indices()[0].tolist()
    per = seq // world
    return [order[r * per:(r + 1) * per] for r in range(world)]


def _inputs(batch: int, heads: int, seq: int, head_dim: int, dtype, device) -> tuple:
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(batch, heads, seq, head_dim, generator=gen).to(device=device, dtype=dtype)
                 for _ in range(3))


def compare_rank(seq: int = 256, heads: int = 4, head_dim: int = 64, rotate: str = "allgather",
                 dtype=torch.float32) -> dict:
    """In every rank of the default group: causal attention under ``context_parallel`` against full attention.

    Uses ``cuda:LOCAL_RANK`` when CUDA is available, else the CPU (where torch raises :data:`CPU_ERROR`). In
    float32 CUDA runs the memory-efficient kernel, in bfloat16 the flash kernel; torch covers both.

    Returns:
        ``{"ran": True, "rotate", "max_error", "positions"}`` (``positions``: the first of this rank's sequence
        positions, from the load balancer), or ``{"ran": False, "error"}`` with what torch raised.
    """
    import os

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard, set_rotate_method

    if rotate not in ROTATE_METHODS:
        raise ValueError(f"rotate={rotate!r}: set_rotate_method accepts {ROTATE_METHODS}")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    world = tdist.get_world_size()
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("cp",))
    q, k, v = _inputs(1, heads, seq, head_dim, dtype, device)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    set_rotate_method(rotate)
    try:
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            mine = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        got = context_parallel_unshard(mesh, [mine], [2])[0]
    except NotImplementedError as exc:
        return {"ran": False, "error": str(exc)}
    finally:
        set_rotate_method("allgather")  # torch's default, for the next call in this process
    err = (got.float() - want.float()).abs().max().item()
    return {"ran": True, "rotate": rotate, "max_error": err,
            "positions": head_tail_positions(seq, world)[tdist.get_rank()][:4]}


def compare(nprocs: int = 2, rotate: str = "allgather", **kwargs) -> list[dict]:
    """Run :func:`compare_rank` on ``nprocs`` GPUs with NCCL.

    Raises:
        RuntimeError: this machine cannot run it (the message is :func:`why_not`'s reason).
    """
    from mgpu_lab import launch

    reason = why_not()
    if reason is None and torch.cuda.device_count() < nprocs:
        reason = f"nprocs={nprocs} but {torch.cuda.device_count()} CUDA GPUs are visible; use nprocs<=GPUs"
    if reason:
        raise RuntimeError(f"torch's context_parallel did not run: {reason}")
    return launch(compare_rank, nprocs, rotate=rotate, backend="nccl", **kwargs)


def attempt_on_cpu(nprocs: int = 2) -> list[dict]:
    """Try :func:`compare_rank` on ``nprocs`` gloo ranks on the CPU: what torch says there, per rank."""
    from mgpu_lab import launch

    def on_cpu():
        import torch as _torch
        _torch.cuda.is_available = lambda: False  # this rank's CPU path, whatever the machine
        return compare_rank(seq=16, heads=2, head_dim=8, dtype=_torch.float32)
    return launch(on_cpu, nprocs, backend="gloo")

"""FSDP2 in a rank: the mesh, ``fully_shard`` block by block, full tensors back, peak memory.

Lesson 08 shards a :class:`BlockNet` (an input layer, ``blocks``, a head) with
``torch.distributed.fsdp.fully_shard``: each block is one communication group,
then the root takes what is left (:func:`mgpu_lab.sharding.wrap.shard_model`, which
the lesson's notebook does not import). The parameters become
DTensors sharded on dim 0 over a :class:`~torch.distributed.device_mesh.DeviceMesh`
(:func:`make_mesh`: the GPUs with NCCL, the CPU with gloo). :func:`full_params`
gathers them back for a comparison, :func:`train_steps` trains on this rank's
slice of a global batch, and :func:`peak_bytes` measures the most memory a
function allocated at once (``torch.cuda.max_memory_allocated`` on a GPU, the
profiler's allocation events on the CPU).

Example:
    >>> from mgpu_lab import launch
    >>> from torch.distributed.fsdp import fully_shard
    >>> def sharded():                              # in every rank
    ...     model, mesh = BlockNet(), make_mesh()
    ...     for block in model.blocks:
    ...         fully_shard(block, mesh=mesh)
    ...     fully_shard(model, mesh=mesh)
    ...     return type(model.blocks[0][0].weight).__name__
    >>> launch(sharded, 2)
    launch: 2 ranks · ...
    ['DTensor', 'DTensor']
"""
from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as tdist
from torch import nn

from mgpu_lab import dist as mdist

__all__ = ["BlockNet", "rank_device", "make_mesh", "full_params", "train_steps",
           "reference_steps", "peak_bytes", "batch"]


class BlockNet(nn.Module):
    """``head(blocks(inp(x)))``: the blocks are the units ``fully_shard`` groups.

    Args:
        features, width, classes: input, hidden and output sizes.
        depth: number of blocks (each ``Linear(width, width)`` and ``Tanh``).
        seed: the initial weights (the same in every process); ``None`` draws them from torch's global
            generator in the order the layers are made, as a plain ``nn.Module`` does.

    Example:
        >>> BlockNet(features=8, width=16, depth=4)(torch.randn(2, 8)).shape
        torch.Size([2, 3])
    """

    def __init__(self, features: int = 8, width: int = 16, depth: int = 4, classes: int = 3,
                 seed: int | None = 0):
        super().__init__()
        with torch.random.fork_rng(devices=[], enabled=seed is not None):  # the caller's random state is kept
            if seed is not None:
                torch.manual_seed(seed)
            self.inp = nn.Linear(features, width)
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth))
            self.head = nn.Linear(width, classes)

    @staticmethod
    def count(features: int = 8, width: int = 16, depth: int = 4, classes: int = 3) -> int:
        """The number of parameters of ``BlockNet(features, width, depth, classes)``, without building it.

        Example:
            >>> BlockNet.count(8, 16, 4, 3) == sum(p.numel() for p in BlockNet(8, 16, 4, 3).parameters())
            True
        """
        return (features + 1) * width + depth * (width + 1) * width + (width + 1) * classes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def rank_device() -> torch.device:
    """``cuda:LOCAL_RANK`` when the process group runs NCCL, else the CPU.

    Under gloo the ranks compute on the CPU even on a machine with a GPU: FSDP2's
    reduce-scatters and all-gathers then run on CPU tensors, which gloo supports.
    """
    if tdist.is_initialized() and tdist.get_backend() == "nccl":
        return mdist.device()
    return torch.device("cpu")


def make_mesh(device: torch.device | None = None, name: str = "dp"):
    """A one-dimensional DeviceMesh over every rank, on this rank's device type.

    Pass it to ``fully_shard(..., mesh=mesh)``: without a mesh ``fully_shard``
    builds one on ``torch._C._get_accelerator()``, which is CUDA on any machine
    with a GPU, whatever backend the process group uses.
    """
    from torch.distributed.device_mesh import init_device_mesh

    device = device or rank_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)  # FSDP2 uses the current CUDA device of a cuda mesh
    return init_device_mesh(device.type, (tdist.get_world_size(),), mesh_dim_names=(name,))


def full_params(model: nn.Module) -> dict:
    """Every parameter as a full CPU tensor (``DTensor.full_tensor()``, a collective: call it in every rank)."""
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu().clone()
            for name, p in model.named_parameters()}


def batch(n: int = 8, features: int = 8, classes: int = 3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed global batch of ``n`` samples: ``(inputs, labels)``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, features, generator=g), torch.randint(0, classes, (n,), generator=g)


def train_steps(model: nn.Module, optimizer, x: torch.Tensor, y: torch.Tensor, steps: int,
                loss_fn=None) -> list[float]:
    """``steps`` optimizer steps on this rank's slice of the global batch ``x, y``; the losses of the slice.

    Rank ``r`` of ``w`` takes the block ``x.chunk(w)[r]``, so the ranks together see
    the whole batch; FSDP (like DDP) averages their gradients.
    """
    loss_fn = loss_fn or nn.CrossEntropyLoss()
    world, rank = (tdist.get_world_size(), tdist.get_rank()) if tdist.is_initialized() else (1, 0)
    device = next(p for p in model.parameters()).device
    xs, ys = x.chunk(world)[rank].to(device), y.chunk(world)[rank].to(device)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = loss_fn(model(xs), ys)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def reference_steps(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, lr: float,
                    optimizer: str = "sgd") -> dict:
    """One process, the whole batch: the weights sharded training must end with."""
    opt = (torch.optim.SGD if optimizer == "sgd" else torch.optim.Adam)(model.parameters(), lr=lr)
    train_steps(model, opt, x, y, steps)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@contextlib.contextmanager
def _quiet_stderr():
    """Silence C++ writes to stderr (the profiler's start/stop lines), not Python's exceptions."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def peak_bytes(fn, device: torch.device | None = None) -> int:
    """The most bytes ``fn()`` had allocated at once, beyond what was allocated before.

    On a GPU: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``.
    On the CPU, where torch keeps no such counter: the allocation and free
    events the profiler records (``profile_memory=True``), added up in order
    (with gloo, its staging copies count too). What ``fn`` writes to stderr
    from C++ meanwhile is dropped: the profiler's own notes would land there.

    Example:
        >>> peak_bytes(lambda: torch.empty(1000))   # 1000 float32
        4000
    """
    from torch.profiler import ProfilerActivity, profile

    device = device or rank_device()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    # The profiler writes its own notes to stderr from C++ (start, stop, "memory block of unknown
    # size"): silenced while it runs. Python exceptions of fn still propagate.
    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    running = peak = 0
    for _, nbytes in events:
        running += nbytes
        peak = max(peak, running)
    return peak

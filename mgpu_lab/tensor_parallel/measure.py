"""What tensor parallelism costs: bytes handed to collectives per step and per mesh dimension, saved activations.

- :func:`activation_bytes`: the bytes of the activations autograd saves for backward during a
  forward, per submodule (this rank's share: a DTensor counts its local tensor).
- :func:`bytes_by_dim`: a recording's collective bytes split by the mesh dimension each ran over
  (the recorder's ``ranks`` field against the mesh's groups).
- :func:`scheme_step`: in a rank, one training step of a :class:`~.block.Stack` under DP, FSDP,
  TP, TP+SP or 2D, recorded; the TP plan and the 2D wrap are passed in (the lesson's own).
- :func:`formula_bytes` and :func:`bytes_table`: what each scheme should hand to collectives
  per step, and the measured numbers set against it.

Example:
    >>> from mgpu_lab.tensor_parallel.block import Block
    >>> per_module = activation_bytes(Block(16, 4, 64), torch.randn(2, 8, 16))
    >>> per_module["norm1"]       # LayerNorm keeps its input, 2 x 8 x 16 floats, and its 16 means and rstds
    1152
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as tdist
from torch import nn

from mgpu_lab.comm.record import record

__all__ = ["activation_bytes", "bytes_by_dim", "scheme_step", "SCHEMES", "formula_bytes", "bytes_table"]

SCHEMES = ("DP", "FSDP", "TP", "TP+SP", "2D")
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def activation_bytes(model: nn.Module, *inputs) -> dict:
    """Bytes of the tensors autograd saves for backward while ``model(*inputs)`` runs, per innermost submodule.

    Parameters are not activations: a saved parameter (a linear layer keeps its weight) is
    left out. A tensor saved twice within one module counts once.

    Returns:
        ``{submodule name: bytes}`` for the modules that saved something (``""``: the model itself).
    """
    params = {_local(p).data_ptr() for p in model.parameters()}
    stack, totals, seen = [""], {}, set()
    names = {m: n for n, m in model.named_modules()}

    def pack(t):
        local = _local(t)
        key = (stack[-1], local.data_ptr(), local.numel())
        if local.data_ptr() not in params and key not in seen and local.device.type != "meta":
            seen.add(key)
            totals[stack[-1]] = totals.get(stack[-1], 0) + local.numel() * local.element_size()
        return t

    def enter(module, args):
        stack.append(names[module])

    def leave(module, args, output):
        stack.pop()  # a forward hook that returned a value would replace the module's output

    handles = [m.register_forward_pre_hook(enter) for m in names if m is not model]
    handles += [m.register_forward_hook(leave) for m in names if m is not model]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(*inputs)
    finally:
        for h in handles:
            h.remove()
    return totals


def bytes_by_dim(events, mesh) -> dict:
    """Bytes of all-reduces, all-gathers and reduce-scatters per mesh dimension (``"other"``: any other group).

    Args:
        events: a :class:`~mgpu_lab.comm.record.Recording` or its events.
        mesh: a DeviceMesh with dimension names; None: every collective counts as ``"world"``.

    Example:
        >>> bytes_by_dim([{"op": "all_reduce", "bytes": 64, "ranks": [0, 1]}, {"op": "wait", "bytes": 64}], None)
        {'world': 64}
    """
    groups = {}
    if mesh is not None:
        for name in mesh.mesh_dim_names:
            groups[name] = sorted(int(r) for r in mesh[name].mesh.flatten().tolist())
    out: dict = {}
    for e in events:
        if e["op"] not in COLLECTIVES:
            continue
        dim = next((n for n, ranks in groups.items() if e.get("ranks") == ranks), "world" if mesh is None else "other")
        out[dim] = out.get(dim, 0) + e["bytes"]
    return out


def _after_tp(p: torch.Tensor, tp: int) -> int:
    """The elements of ``p`` a rank holds after TP split it (before FSDP shards that over "dp")."""
    names = getattr(getattr(p, "device_mesh", None), "mesh_dim_names", None) or ()
    if "tp" in names and p.placements[names.index("tp")].is_shard():
        return p.numel() // tp
    return p.numel()


def _setup(scheme: str, model: nn.Module, tp_plan, parallelize_2d, device_type: str):
    """Wrap ``model`` for ``scheme``; return ``(the model to call, the mesh or None, (dp, tp))``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    from .block import make_mesh_2d

    world = tdist.get_world_size()
    if scheme == "DP":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model)
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)  # DDP's own all-reduce is C++: unseen otherwise
        return ddp, None, (world, 1)
    if scheme == "FSDP":
        mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("dp",))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, mesh, (world, 1)
    if scheme in ("TP", "TP+SP"):
        mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("tp",))
        for block in model.blocks:
            parallelize_module(block, mesh, tp_plan(block, scheme == "TP+SP"))
        return model, mesh, (1, world)
    if scheme == "2D":
        mesh = make_mesh_2d(2, world // 2, device_type)
        return parallelize_2d(model, mesh), mesh, (2, world // 2)
    raise ValueError(f"scheme={scheme!r}: use one of {SCHEMES}")


def scheme_step(scheme: str, tp_plan=None, parallelize_2d=None, batch: int = 4, seq: int = 8, dim: int = 16,
                heads: int = 4, hidden: int = 64, depth: int = 2) -> dict:
    """In every rank: one SGD step of ``Stack(depth, dim, heads, hidden)`` under ``scheme``, recorded.

    DP and FSDP split the batch over all ranks, TP and TP+SP split every block over all
    ranks (``tp_plan(block, sequence_parallel)``), 2D is ``parallelize_2d(model, mesh)`` on a
    ``(2, world // 2)`` mesh; with sequence parallelism a rank takes its slice of the sequence.

    Returns:
        ``{"scheme", "bytes": {mesh dimension: bytes}, "ops": {op: calls}, "params": the parameter
        elements this rank held before FSDP sharded them (after TP), "world"}``.

    Example:
        >>> from mgpu_lab import launch
        >>> launch(scheme_step, 2, "DP")[0]["bytes"]      # one all-reduce of every gradient: 4 bytes each
        launch: 2 ranks · ...
        {'world': 26240}
    """
    from .block import Stack
    from .block import batch as make_batch

    device_type = "cuda" if tdist.get_backend() == "nccl" else "cpu"
    model = Stack(depth, dim, heads, hidden)
    if device_type == "cuda":
        model.to(torch.device("cuda", torch.cuda.current_device()))
    wrapped, mesh, (dp, tp) = _setup(scheme, model, tp_plan, parallelize_2d, device_type)
    x, y = make_batch(batch, seq, dim)
    coords = mesh.get_coordinate() if mesh is not None and mesh.ndim == 2 else None
    d = coords[0] if coords else (tdist.get_rank() if dp > 1 else 0)
    t = coords[1] if coords else (tdist.get_rank() if tp > 1 else 0)
    sp = scheme in ("TP+SP", "2D")
    x, y = (v.chunk(dp)[d] for v in (x, y))
    if sp:
        x, y = (v.chunk(tp, dim=1)[t] for v in (x, y))
    device = next(model.parameters()).device
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.01)
    with record() as log:
        (wrapped(x.to(device)) - y.to(device)).square().mean().backward()
        opt.step()
    ops: dict = {}
    for e in log:
        if e["op"] in COLLECTIVES:
            ops[e["op"]] = ops.get(e["op"], 0) + 1
    return {"scheme": scheme, "bytes": bytes_by_dim(log, mesh), "ops": ops,
            "params": sum(_after_tp(p, tp) for p in model.parameters()),
            "world": tdist.get_world_size()}


def formula_bytes(scheme: str, params: int, batch: int, seq: int, dim: int, depth: int, world: int,
                  tp_bytes) -> dict:
    """What one step of ``scheme`` should hand to collectives, per mesh dimension, in fp32 bytes.

    - DP: one all-reduce of every gradient, ``4 P``;
    - FSDP: every block's parameters all-gathered in forward and again in backward, its
      gradients reduce-scattered: ``3 x 4 P``;
    - TP, TP+SP: ``depth x tp_bytes(batch, seq, dim, tp, sp)``; with SP the norms'
      replicated weights get gradients from a slice of the sequence each, summed over
      "tp" by an all-reduce of their ``4 dim`` elements per block (at the optimizer step,
      or by FSDP in backward);
    - 2D on ``(2, world // 2)``: TP+SP over "tp" on half the batch, FSDP over "dp" of what
      TP left each rank (``params`` = those elements).

    Args:
        params: the parameter elements a rank holds before FSDP shards them (after TP).
        tp_bytes: a function ``(batch, seq, hidden, tp, sequence_parallel) -> bytes``.

    Example:
        >>> formula_bytes("FSDP", 6560, 4, 8, 16, 2, 4, None)
        {'dp': 78720}
    """
    norms = depth * 4 * dim * 4
    if scheme == "DP":
        return {"world": 4 * params}
    if scheme == "FSDP":
        return {"dp": 3 * 4 * params}
    if scheme in ("TP", "TP+SP"):
        sp = scheme == "TP+SP"
        return {"tp": depth * tp_bytes(batch, seq, dim, world, sp) + (norms if sp else 0)}
    if scheme == "2D":
        return {"dp": 3 * 4 * params, "tp": depth * tp_bytes(batch // 2, seq, dim, world // 2, True) + norms}
    raise ValueError(f"scheme={scheme!r}: use one of {SCHEMES}")


def bytes_table(measured: list, formulas: list) -> str:
    """A text table: per scheme the bytes one rank handed to collectives in one step, over each mesh
    dimension ("dp" or all ranks, and "tp"), measured and from the formula.

    Args:
        measured: rank 0's :func:`scheme_step` results, one per scheme.
        formulas: the :func:`formula_bytes` of each, in the same order.

    Example:
        >>> print(bytes_table([{"scheme": "DP", "bytes": {"world": 400}, "ops": {"all_reduce": 1}}],
        ...                   [{"world": 400}]))
        scheme   measured dp/all         tp   formula dp/all         tp  collectives
        DP                 400 B        0 B            400 B        0 B  all_reduce 1
    """
    lines = [f"{'scheme':<6}  {'measured dp/all':>15}  {'tp':>9}  {'formula dp/all':>15}  {'tp':>9}  collectives"]
    for run, want in zip(measured, formulas):
        cells = []
        for got in (run["bytes"], want):
            cells += [_b(got.get("dp", 0) + got.get("world", 0)), _b(got.get("tp", 0))]
        ops = ", ".join(f"{op} {n}" for op, n in run["ops"].items())
        lines.append(f"{run['scheme']:<6}  {cells[0]:>15}  {cells[1]:>9}  {cells[2]:>15}  {cells[3]:>9}  {ops}")
    return "\n".join(lines)


def _b(n: int) -> str:
    return f"{n} B" if n < 10 * 1024 else f"{n / 1024:.1f} KiB"

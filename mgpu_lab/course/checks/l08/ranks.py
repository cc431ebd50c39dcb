"""What lesson 08's checks run in a fresh process or in real ranks: plain evidence, no judging.

- :func:`evaluate_calls`: the learner's ``zero_memory`` on many arguments;
- :func:`measure_zero`: the bytes 4 ranks really hold under DDP, ZeRO-1/2 by
  hand (:class:`mgpu_lab.sharding.zero.FlatZero`) and FSDP2, after two Adam steps;
- :func:`run_sgd_cases`: the learner's ``sharded_sgd_step`` on several sizes and
  dtypes, with every collective it issued (and the shard it contributed to the
  all-gather), then once more with torch's default device set to ``meta``;
- :func:`run_shard_model`: the learner's ``shard_model`` on a :class:`~mgpu_lab.sharding.fsdp.BlockNet`:
  which parameters became DTensors on which mesh, the all-gathers of a forward,
  the weights after three SGD steps on half the batch;
- :func:`run_dcp_save` and :func:`run_dcp_load`: the learner's checkpoint
  functions on 4 ranks (save, load) and on 2 (load), with what was written.

They are module-level functions of an importable module, so ranks receive them
by name; :mod:`.checkers` judges what they return, in the kernel.
"""
from __future__ import annotations

import os
import torch
import torch.distributed as tdist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from mgpu_lab.comm.record import record
from mgpu_lab.sharding import distcp, fsdp, zero
from ..sim.outcome import outcome


# -- zero_memory ---------------------------------------------------------------------------
def evaluate_calls(fn, calls):
    """``fn(*args, **kwargs)`` for each call: ``("ok", value, type name)`` or ``("raised", type, message)``."""
    out = []
    for args, kwargs in calls:
        got = outcome(fn, *args, **kwargs)
        if got[0] == "ok":
            value = got[1]
            got = ("ok", value if isinstance(value, (int, float)) else repr(value), type(value).__name__)
        out.append(got)
    return out


def measure_zero(width: int = 9, depth: int = 2) -> dict:
    """Probe: bytes this rank holds after two Adam steps under each scheme, and the padding of each."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    def model():
        return fsdp.BlockNet(features=6, width=width, depth=depth, classes=3, seed=0)

    x, y = fsdp.batch(8, 6)
    adam = lambda ps: torch.optim.Adam(ps, lr=1e-2)  # noqa: E731
    world = tdist.get_world_size()
    out = {"n": sum(p.numel() for p in model().parameters()), "world": world}
    ddp = DDP(model(), gradient_as_bucket_view=True)  # .grad are views into the buckets: no second copy
    opt = adam(ddp.parameters())
    fsdp.train_steps(ddp, opt, x, y, 2)
    out["stage0"] = zero.held_bytes(ddp.module, opt)["total"]
    for stage in (1, 2):
        m = model()
        flat = zero.FlatZero(m, stage, adam)
        fsdp.train_steps(m, flat, x, y, 2)  # FlatZero has zero_grad() and step()
        out[f"stage{stage}"] = zero.held_bytes(m, flat.optimizer)["total"]
    m = fsdp.shard_model(model(), fsdp.make_mesh(torch.device("cpu")))
    opt = adam(m.parameters())
    fsdp.train_steps(m, opt, x, y, 2)
    out["stage3"] = zero.held_bytes(m, opt)["total"]
    out["flat_padding"] = zero.shard_size(out["n"], world) * world - out["n"]
    # FSDP2 pads every parameter on dim 0 to a multiple of the world size
    out["fsdp_padding"] = sum((zero.shard_size(p.shape[0], world) * world - p.shape[0]) * (p.numel() // p.shape[0])
                              for p in model().parameters())
    return out


# -- sharded_sgd_step ----------------------------------------------------------------------
def _sgd_inputs(n: int, dtype: torch.dtype, rank: int, seed: int):
    param = torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype)
    grad = torch.randn(n, generator=torch.Generator().manual_seed(seed + 100 + rank)).to(dtype)
    return param, grad


def run_sgd_cases(sharded_sgd_step, cases, lr: float):
    """Probe: for each case ``(n, dtype name, on meta)``, the learner's result and collectives in this rank."""
    rank = tdist.get_rank()
    out = []
    for k, (n, dtype_name, meta) in enumerate(cases):
        param, grad = _sgd_inputs(n, getattr(torch, dtype_name), rank, seed=k)
        entry = {"param": param.clone(), "grad": grad.clone()}
        try:
            with record(keep_inputs=True) as log:
                if meta:  # factory calls without device= land on 'meta', as a CPU default beside a GPU tensor
                    with torch.device("meta"):
                        got = sharded_sgd_step(param.clone(), grad.clone(), lr)
                else:
                    got = sharded_sgd_step(param.clone(), grad.clone(), lr)
            entry["status"] = "ok"
            if isinstance(got, torch.Tensor):
                entry["result"] = got.detach().to("cpu", copy=True) if got.device.type != "meta" else "a meta tensor"
            else:
                entry["result"] = type(got).__name__
        except NotImplementedError as exc:
            if not meta:
                raise
            entry.update(status="raised", error=f"NotImplementedError: {exc}")
        except Exception as exc:  # noqa: BLE001 - the checker judges it
            entry.update(status="raised", error=f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}")
        entry["collectives"] = [dict(c) for c in log]
        out.append(entry)
    return out


# -- shard_model ---------------------------------------------------------------------------
def check_net(seed: int = 1) -> fsdp.BlockNet:
    """The model the shard_model check shards: dims that do not divide by 2 (5 features, width 7, 3 classes)."""
    return fsdp.BlockNet(features=5, width=7, depth=3, classes=3, seed=seed)


def _describe(p, mesh) -> dict:
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(p, DTensor):
        return {"dtensor": False, "type": type(p).__name__, "shape": list(p.shape)}
    return {"dtensor": True, "placements": [str(pl) for pl in p.placements], "shard0": p.placements == (Shard(0),),
            "given_mesh": p.device_mesh == mesh, "mesh": str(p.device_mesh), "shape": list(p.shape),
            "local": list(p.to_local().shape)}


def padded_numel(params, world: int) -> int:
    """Elements FSDP2 all-gathers for these parameters: each padded on dim 0 to a multiple of ``world``."""
    return sum(zero.shard_size(p.shape[0], world) * world * (p.numel() // p.shape[0]) for p in params)


def run_shard_model(shard_model, steps: int, lr: float):
    """Probe: shard the check's net with the learner's function, record a step, train ``steps`` SGD steps."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    mesh = init_device_mesh("cpu", (tdist.get_world_size(),), mesh_dim_names=("check",))
    model = check_net()
    got = shard_model(model, mesh)
    out = {"returned": type(got).__name__, "is_model": got is model}
    model = got if isinstance(got, nn.Module) else model
    out["fsdp"] = sorted(name or "(root)" for name, m in model.named_modules() if isinstance(m, FSDPModule))
    out["params"] = {name: _describe(p, mesh) for name, p in model.named_parameters()}
    net, world = check_net(), tdist.get_world_size()
    out["sizes"] = {"block": padded_numel(net.blocks[0].parameters(), world),
                    "root": padded_numel([*net.inp.parameters(), *net.head.parameters()], world),
                    "total": padded_numel(net.parameters(), world), "blocks": len(net.blocks)}
    x, y = fsdp.batch(8, 5)
    rank, world = tdist.get_rank(), tdist.get_world_size()
    xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    with record() as forward:
        loss = nn.functional.cross_entropy(model(xs), ys)
    with record() as backward:
        loss.backward()
    out["forward"] = [(c["op"], c["numel"]) for c in forward]
    out["backward"] = [(c["op"], c["numel"]) for c in backward]
    opt.step()
    fsdp.train_steps(model, opt, x, y, steps - 1)
    out["trained"] = fsdp.full_params(model)
    return out


def reference_shard_model(steps: int, lr: float) -> dict:
    """What the shard_model check's training must give: one process, the whole batch."""
    x, y = fsdp.batch(8, 5)
    return fsdp.reference_steps(check_net(), x, y, steps, lr)


# -- dcp_checkpoint ------------------------------------------------------------------------
def dcp_net(seed: int) -> nn.Module:
    """The sharded model of the checkpoint check: width 10 splits 3, 3, 3, 1 over 4 ranks (5, 5 over 2)."""
    return fsdp.shard_model(fsdp.BlockNet(features=6, width=10, depth=2, classes=3, seed=seed),
                            fsdp.make_mesh(torch.device("cpu")))


def _said(exc: BaseException) -> str:
    """An error in one line; for DCP's CheckpointException, the first rank's own error inside it."""
    failures = getattr(exc, "failures", None)
    if failures:
        inner = next(iter(failures.values()))[0]
        return f"{type(exc).__name__} ({type(inner).__name__}: {(str(inner).splitlines() or [''])[0][:250]})"
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}"


def _fresh(seed: int):
    model = dcp_net(seed)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def run_dcp_save(save_checkpoint, load_checkpoint, path: str) -> dict:
    """Probe (4 ranks): an Adam step, save with the learner's function, load into a fresh model and optimizer."""
    model, opt = _fresh(seed=2)
    x, y = fsdp.batch(8, 6)
    fsdp.train_steps(model, opt, x, y, 1)  # Adam's state exists after its first step
    rank0 = tdist.get_rank() == 0
    try:
        save_checkpoint(model, opt, path)
    except NotImplementedError:
        raise
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - judged as evidence
        return {"save_error": _said(exc), "files": [], "layout": None, "saved": None}
    tdist.barrier()
    saved = distcp.full_state(model, opt)  # after the save: a save must not change the state
    out = {"saved": saved if rank0 else None}
    out["files"] = sorted(os.listdir(path)) if os.path.isdir(path) else []
    out["layout"] = distcp.layout(path) if rank0 and os.path.isfile(os.path.join(path, ".metadata")) else None
    if not os.path.isfile(os.path.join(path, ".metadata")):
        return {**out, "load_error": "not run: there is no DCP checkpoint (.metadata) to load"}
    fresh, fresh_opt = _fresh(seed=7)
    try:
        load_checkpoint(fresh, fresh_opt, path)
    except NotImplementedError:
        raise
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - the save is judged all the same
        out["load_error"] = _said(exc)
        return out
    loaded = distcp.full_state(fresh, fresh_opt)
    out["loaded"] = loaded if rank0 else None
    return out


def run_dcp_load(load_checkpoint, path: str) -> dict:
    """Probe (any world size): load the checkpoint into a fresh model and optimizer; their full state."""
    model, opt = _fresh(seed=11)
    load_checkpoint(model, opt, path)
    state = distcp.full_state(model, opt)
    return {"loaded": state if tdist.get_rank() == 0 else None}

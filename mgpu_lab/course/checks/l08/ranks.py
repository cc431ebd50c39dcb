"""What lesson 08's checks run in real ranks: plain evidence, no judging.

- :func:`run_sgd_cases`: the learner's ``sharded_sgd_step`` on several sizes and
  dtypes, with every collective it issued (and the shard it contributed to the
  all-gather), then once more with torch's default device set to ``meta``;
- :func:`run_sharded_adam`: the learner's ``ShardedAdam`` after DDP, five steps beside
  DDP + ``torch.optim.Adam`` (and AdamW, to recognise decoupled decay), the Adam state
  each rank keeps and the collectives of a step;
- :func:`run_build_sharded`: the learner's ``build_sharded`` with the parameter storage
  live on the rank tracked (:class:`LiveStorage`), the sharding it made, the weights
  against ``model_fn()`` on one process, the all-gathers of a step, two SGD steps;
- :func:`run_load_full`: the learner's ``load_full_into_sharded`` on a file rank 0
  wrote with ``torch.save``, with the files each rank opened and the storage it allocated.

They are module-level functions of an importable module, so ranks receive them
by name; :mod:`.checkers` judges what they return, in the kernel.
"""
from __future__ import annotations

import copy
import gc
import os
import sys

import torch
import torch.distributed as tdist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from mgpu_lab.comm.record import record
from mgpu_lab.sharding import fsdp, zero


class LiveStorage(TorchDispatchMode):
    """The bytes of tensor storage alive on this process (not on ``meta``), and their peak, while active.

    Every tensor an operation returns is noted by its storage (a DTensor by its local
    one), with a weak reference: a storage counts until it is freed. Storages that
    existed before the block count when an operation returns them again, unless
    they are among ``before`` (tensors whose storages are not new).
    """

    def __init__(self, before=()):
        super().__init__()
        from torch.multiprocessing.reductions import StorageWeakRef

        self._ref, self._live, self.now, self.peak, self._collected = StorageWeakRef, {}, 0, 0, 0
        self._old = {getattr(t, "_local_tensor", t).untyped_storage().data_ptr() for t in before}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_leaves

        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                local = getattr(t, "_local_tensor", t)
                storage = local.untyped_storage()
                if local.device.type != "meta" and storage.nbytes() and storage.data_ptr() not in self._old:
                    self._live.setdefault(self._ref(storage), storage.nbytes())
        self._settle()
        if self.now > self.peak and self.now > 1.02 * self._collected:
            # garbage in reference cycles (autograd and DTensor objects make them) is freed only when the
            # collector runs: count what is still reachable, not what merely waits for it
            gc.collect()
            self._settle()
            self._collected = self.now
        self.peak = max(self.peak, self.now)
        return out

    def __enter__(self):
        gc.freeze()  # what exists now is not garbage of the block: the collections below skip it (fast)
        return super().__enter__()

    def __exit__(self, *exc):
        gc.unfreeze()
        return super().__exit__(*exc)

    def _settle(self) -> None:
        self._live = {k: v for k, v in self._live.items() if not k.expired()}
        self.now = sum(self._live.values())


def _said(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}"


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



# -- ShardedAdam ---------------------------------------------------------------------------
ADAM_CONFIGS = [{"lr": 1e-2}, {"lr": 3e-3, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.1}]
ADAM_GROUPS = ({"lr": 1e-2, "weight_decay": 0.1}, {"lr": 3e-3, "betas": (0.8, 0.95)})  # weights, then biases
ADAM_STEPS = 5
ADAM_WORLD = 3  # ranks: an answer that assumes 2 (parameters split in halves) fails


def adam_net() -> nn.Module:
    """ShardedAdam's model: 14 parameters, weights of 128-256 elements and biases of 4-16 (1572 in all)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        layers = [nn.Linear(8, 16)] + [nn.Linear(16, 16) for _ in range(5)] + [nn.Linear(16, 4)]
        return nn.Sequential(*[m for layer in layers for m in (layer, nn.Tanh())][:-1])


def adam_groups(model: nn.Module) -> list:
    """Two parameter groups of ``model`` with their own settings (:data:`ADAM_GROUPS`): weights, biases."""
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if n.endswith(kind)], **settings}
            for kind, settings in zip(("weight", "bias"), ADAM_GROUPS)]


class _Trainer:
    """DDP over adam_net with an optimizer, stepped on this rank's part of a fixed batch; notes the parameters
    whose gradient ``zero_grad`` left in place (a stale gradient DDP's next all-reduce spreads)."""

    def __init__(self, make_opt, config: dict, groups: bool = False):
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.model = DDP(adam_net())
        self.opt = make_opt(adam_groups(self.model.module) if groups else self.model.parameters(), **config)
        x, y = fsdp.batch(8, 8, classes=4, seed=2)
        rank, world = tdist.get_rank(), tdist.get_world_size()
        self.xs, self.ys, self.stale = x.chunk(world)[rank], y.chunk(world)[rank], set()

    def step(self, log_it: bool = False):
        self.opt.zero_grad()
        params = list(self.model.parameters())
        self.stale |= {i for i, p in enumerate(params) if p.grad is not None and bool(p.grad.any())}
        nn.functional.cross_entropy(self.model(self.xs), self.ys).backward()
        if not log_it:
            self.opt.step()
            return None
        with record() as log:
            self.opt.step()
        return log

    def weights(self) -> list:
        return [p.detach().clone() for p in self.model.module.parameters()]


def _train_adam(make_opt, config: dict, log_step: bool = False):
    """DDP over adam_net, the optimizer ``make_opt(params, **config)``, ADAM_STEPS steps on this rank's part."""
    run = _Trainer(make_opt, config)
    log = None
    for step in range(ADAM_STEPS):
        said = run.step(log_it=log_step and step == 1)
        log = said if said is not None else log
    return run.model.module, run.opt, log, sorted(run.stale)


def _state_of(opt, params) -> dict:
    """The Adam state a rank keeps: bytes (each storage once, step counters left out), which parameters have it."""
    seen, nbytes, owned = set(), 0, []
    index = {id(p): i for i, p in enumerate(params)}
    for p, state in getattr(opt, "state", {}).items():
        tensors = [v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
        if tensors and id(p) in index:
            owned.append(index[id(p)])
        for v in tensors:
            key = v.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                nbytes += v.untyped_storage().nbytes()
    return {"bytes": nbytes, "owned": sorted(owned)}


def _train_pair(make_opt) -> tuple:
    """Two optimizers alive at once, stepped in turn: one as config 0, one over :func:`adam_groups`."""
    one, two = _Trainer(make_opt, ADAM_CONFIGS[0]), _Trainer(make_opt, {"lr": 1e-3}, groups=True)
    for _ in range(ADAM_STEPS):
        one.step()
        two.step()
    return one.weights(), two.weights()


def _pair_evidence(ShardedAdam) -> dict:
    try:
        first, second = _train_pair(ShardedAdam)
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001 - judged as evidence
        return {"error": _said(exc)}
    adam_first, adam_second = _train_pair(torch.optim.Adam)
    alone = _Trainer(ShardedAdam, {"lr": 1e-3}, groups=True)  # the grouped one with no other alive
    for _ in range(ADAM_STEPS):
        alone.step()
    return {"first": first, "second": second, "adam_first": adam_first, "adam_second": adam_second,
            "second_alone": alone.weights()}


def run_adam_state(ShardedAdam) -> dict:
    """Probe (2 ranks): the Adam state each rank keeps after ADAM_STEPS steps of config 0 (a split by count can
    look balanced on 3 ranks and not on 2)."""
    out = {"configs": [], "sizes": [p.numel() for p in adam_net().parameters()]}
    try:
        model, opt, _, _ = _train_adam(ShardedAdam, ADAM_CONFIGS[0])
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001 - judged as evidence
        out["configs"].append({"error": _said(exc)})
        return out
    out["configs"].append({"state": _state_of(opt, list(model.parameters()))})
    return out


def run_sharded_adam(ShardedAdam) -> dict:
    """Probe (3 ranks): per config, the learner's weights beside DDP + Adam's and AdamW's; state; a step's traffic;
    then two ShardedAdams alive at once, the second with two parameter groups."""
    out = {"configs": [], "sizes": [p.numel() for p in adam_net().parameters()]}
    for k, config in enumerate(ADAM_CONFIGS):
        entry = {}
        try:
            model, opt, log, stale = _train_adam(ShardedAdam, config, log_step=k == 0)
        except NotImplementedError:
            raise
        except Exception as exc:  # noqa: BLE001 - judged as evidence
            out["configs"].append({"error": _said(exc)})
            continue
        entry["optimizer"] = isinstance(opt, torch.optim.Optimizer)
        entry["weights"] = [p.detach().clone() for p in model.parameters()]
        entry["moved"] = any(not torch.equal(a, b) for a, b in zip(entry["weights"], adam_net().parameters()))
        entry["adam"] = [p.detach().clone() for p in _train_adam(torch.optim.Adam, config)[0].parameters()]
        entry["adamw"] = [p.detach().clone() for p in _train_adam(torch.optim.AdamW, config)[0].parameters()]
        entry["state"] = _state_of(opt, list(model.parameters()))
        entry["stale"] = stale
        if log is not None:
            entry["step_ops"] = [(c["op"], c["numel"]) for c in log if c["op"] != "wait"]
        out["configs"].append(entry)
    out["pair"] = _pair_evidence(ShardedAdam)
    return out


# -- build_sharded -------------------------------------------------------------------------
BUILD_DIMS = {"features": 5, "width": 48, "depth": 10, "classes": 3}
BUILD_STEPS, BUILD_LR = 2, 0.5
_CALLS: list = []


def model_fn():
    """The model build_sharded is given: it seeds torch's generator, then makes a BlockNet (each Linear draws its
    weights in reset_parameters, in the order the layers are made). Notes where it was called."""
    _CALLS.append(torch.empty(0).device.type)
    torch.manual_seed(11)
    return fsdp.BlockNet(**BUILD_DIMS, seed=None)


class HeadFirstNet(nn.Module):
    """BlockNet's layers, its head made (and drawn) first but registered last: the order the layers are made
    and the order the model lists them differ."""

    forward = fsdp.BlockNet.forward

    def __init__(self, features: int, width: int, depth: int, classes: int):
        super().__init__()
        head = nn.Linear(width, classes)
        self.inp = nn.Linear(features, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth))
        self.head = head


def head_first_fn():
    """A second model for build_sharded: seeds torch's generator, then makes a :class:`HeadFirstNet`."""
    _CALLS.append(torch.empty(0).device.type)
    torch.manual_seed(12)
    return HeadFirstNet(**BUILD_DIMS)


def _reference_model(fn=model_fn) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        return fn()


def _init_diff(model: nn.Module, fn) -> dict:
    """Per parameter: the largest difference of the gathered weights from ``fn()``'s on one process (None:
    missing or of another shape)."""
    ref = dict(_reference_model(fn).named_parameters())
    full = fsdp.full_params(model)
    return {k: (full[k] - ref[k]).abs().max().item() if k in full and full[k].shape == ref[k].shape else None
            for k in ref}


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


def _sizes(world: int) -> dict:
    net = _reference_model()
    return {"block": padded_numel(net.blocks[0].parameters(), world),
            "root": padded_numel([*net.inp.parameters(), *net.head.parameters()], world),
            "total": padded_numel(net.parameters(), world), "blocks": len(net.blocks),
            "whole_bytes": 4 * sum(p.numel() for p in net.parameters()),
            "block_bytes": 4 * max(sum(p.numel() for p in b.parameters()) for b in net.blocks)}


def _one_process(model: nn.Module, x, y) -> dict:
    """BUILD_STEPS SGD steps on the whole batch, as one process (fsdp.train_steps would take this rank's part)."""
    opt = torch.optim.SGD(model.parameters(), lr=BUILD_LR)
    for _ in range(BUILD_STEPS):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return {name: p.detach() for name, p in model.named_parameters()}


def run_build_sharded(build_sharded) -> dict:
    """Probe (2 ranks): build with the learner's function, storage tracked; sharding, weights, traffic, training;
    then the weights of a second model (:func:`head_first_fn`) it builds."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    world, rank = tdist.get_world_size(), tdist.get_rank()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("check",))
    _CALLS.clear()
    with LiveStorage() as live:
        got = build_sharded(model_fn, mesh)
    out = {"returned": type(got).__name__, "peak": live.peak, "end": live.now, "calls": list(_CALLS),
           "sizes": _sizes(world)}
    if not isinstance(got, nn.Module):
        return out
    model = got
    out["fsdp"] = sorted(name or "(root)" for name, m in model.named_modules() if isinstance(m, FSDPModule))
    out["params"] = {name: _describe(p, mesh) for name, p in model.named_parameters()}
    out["diff"] = _init_diff(model, model_fn)
    x, y = fsdp.batch(8, BUILD_DIMS["features"])
    xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
    opt = torch.optim.SGD(model.parameters(), lr=BUILD_LR)
    with record() as forward:
        loss = nn.functional.cross_entropy(model(xs), ys)
    loss.backward()
    opt.step()
    out["forward"] = [(c["op"], c["numel"]) for c in forward]
    fsdp.train_steps(model, opt, x, y, BUILD_STEPS - 1)
    trained = fsdp.full_params(model)
    single = _one_process(_reference_model(), x, y)
    out["trained"] = max((trained[k] - v).abs().max().item() for k, v in single.items())
    try:
        other = build_sharded(head_first_fn, mesh)
        out["head_first"] = _init_diff(other, head_first_fn) if isinstance(other, nn.Module) else type(other).__name__
    except Exception as exc:  # noqa: BLE001 - judged by the weights' case
        out["head_first"] = f"raised {_said(exc)}"
    return out


# -- load_full_into_sharded ----------------------------------------------------------------
LOAD_DIMS = {"features": 5, "width": 48, "depth": 6, "classes": 3}


_AUDIT: dict = {"target": None, "seen": None, "installed": False}


def _audit(event, args):
    """An audit hook: while a probe watches, note every open of its file (open, os.open, io.open, mmap's open)."""
    if event != "open" or _AUDIT["seen"] is None or not args or not isinstance(args[0], (str, bytes, os.PathLike)):
        return
    try:
        if os.path.abspath(os.fsdecode(args[0])) == _AUDIT["target"]:
            _AUDIT["seen"].append(event)
    except (TypeError, ValueError):
        pass


def run_load_full(load_full_into_sharded, path: str) -> dict:
    """Probe (2 ranks): rank 0 writes a full state dict with torch.save; the learner's function loads it into an
    FSDP2 model sharded here; the files each rank opened, the storage it allocated, the shards it ends with."""
    from mgpu_lab.sharding import wrap

    world, rank = tdist.get_world_size(), tdist.get_rank()
    full = fsdp.BlockNet(**LOAD_DIMS, seed=21).state_dict()
    if rank == 0:
        torch.save(full, path)
    tdist.barrier()
    model = wrap.shard_model(fsdp.BlockNet(**LOAD_DIMS, seed=4), fsdp.make_mesh(torch.device("cpu")))
    mesh = model.inp.weight.device_mesh
    if not _AUDIT["installed"]:  # one hook per process, for good: audit hooks cannot be removed
        sys.addaudithook(_audit)
        _AUDIT["installed"] = True
    seen: list = []
    _AUDIT.update(target=os.path.abspath(path), seen=seen)
    out = {"whole_bytes": sum(v.numel() * v.element_size() for v in full.values()),
           "largest_bytes": max(v.numel() * v.element_size() for v in full.values())}
    del full
    try:
        with LiveStorage(before=list(model.parameters())) as live:  # new storage only: the shards exist
            load_full_into_sharded(model, path)
    finally:
        _AUDIT["seen"] = None
    out.update(opened=len(seen), peak=live.peak)
    want = fsdp.BlockNet(**LOAD_DIMS, seed=21).state_dict()
    out["params"] = {name: _describe(p, mesh) for name, p in model.named_parameters()}
    out["local_ok"] = sorted(name for name, p in model.named_parameters() if hasattr(p, "to_local")
                             and torch.equal(p.to_local(), want[name].chunk(world)[rank]))
    full_now = fsdp.full_params(model)
    out["diff"] = {k: (full_now[k] - v).abs().max().item() if full_now[k].shape == v.shape else None
                   for k, v in want.items() if k in full_now}
    return out


# -- MiniFSDP ------------------------------------------------------------------------------
class MiniBlock(nn.Module):
    """A pre-norm transformer MLP block: ``x + down(gelu(up(norm(x))))``."""

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class MiniNet(nn.Module):
    """MiniFSDP's model: tokens of 5 features, 6 pre-norm blocks of width 40 and hidden 94, a norm and a head of
    7 classes; no parameter's size is a multiple of 3 (47,011 elements in all)."""

    def __init__(self, features: int = 5, width: int = 40, hidden: int = 94, depth: int = 6, classes: int = 7):
        super().__init__()
        self.inp = nn.Linear(features, width)
        self.blocks = nn.ModuleList(MiniBlock(width, hidden) for _ in range(depth))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, classes)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


MINI_STEPS = 2
MINI_OPTS = {"SGD": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}), "Adam": (torch.optim.Adam, {"lr": 1e-2}),
             "AdamW": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}), "plain SGD": (torch.optim.SGD, {"lr": 0.1})}
# (name, optimizer, compute dtype, default device): the scenarios of one launch, per world size
MINI_SCENARIOS = {2: [("SGD", "SGD", None, "meta"), ("Adam", "Adam", None, None), ("AdamW", "AdamW", None, None),
                      ("bfloat16", "SGD", "bfloat16", None)],
                  3: [("SGD", "SGD", None, None), ("AdamW", "AdamW", None, None), ("float16", "SGD", "float16", None)]}


def mini_net() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(8)
        return MiniNet()


def mini_batch():
    """6 sequences of 2 tokens and their labels (each rank takes its chunk of the 6)."""
    g = torch.Generator().manual_seed(9)
    return torch.randn(6, 2, 5, generator=g), torch.randint(0, 7, (6, 2), generator=g)


def _loss(model, x, y):
    return nn.functional.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())


def _mixed(model: nn.Module, dtype) -> nn.Module:
    """One process, every layer computing in ``dtype`` on a copy of fp32 master weights (the inputs of each
    layer cast to ``dtype``, as fully_shard's MixedPrecisionPolicy casts them)."""
    for layer in model.modules():
        if list(layer.parameters(recurse=False)):
            layer.register_forward_pre_hook(lambda m, args: tuple(
                a.to(dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args))
    return model


def _one_process_mini(opt_name: str, dtype) -> dict:
    """The weights one process reaches on the whole batch: fp32, or layers in ``dtype`` with fp32 masters."""
    make, kwargs = MINI_OPTS[opt_name]
    master = mini_net()
    opt = make(master.parameters(), **kwargs)
    x, y = mini_batch()
    for _ in range(MINI_STEPS):
        opt.zero_grad()
        low = master if dtype is None else _mixed(copy.deepcopy(master).to(dtype), dtype)
        _loss(low, x, y).backward()
        if low is not master:
            for p, q in zip(master.parameters(), low.parameters()):
                p.grad = q.grad.float()
        opt.step()
    return {k: v.detach() for k, v in master.named_parameters()}


def _fully_sharded_mini(opt_name: str, dtype) -> dict:
    """The same training with torch's fully_shard (every layer its own group): the tolerance it meets."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from mgpu_lab.course.checks import _references

    world, rank = tdist.get_world_size(), tdist.get_rank()
    make, kwargs = MINI_OPTS[opt_name]
    with _references.allowed():
        model, mesh = mini_net(), fsdp.make_mesh(torch.device("cpu"))
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype else None
        for layer in list(model.modules()):
            if list(layer.parameters(recurse=False)):
                fully_shard(layer, mesh=mesh, mp_policy=policy or MixedPrecisionPolicy())
        fully_shard(model, mesh=mesh, mp_policy=policy or MixedPrecisionPolicy())
        opt = make(model.parameters(), **kwargs)
        x, y = mini_batch()
        for _ in range(MINI_STEPS):
            opt.zero_grad()
            _loss(model, x.chunk(world)[rank], y.chunk(world)[rank]).backward()
            opt.step()
        return fsdp.full_params(model)


class LiveResized(LiveStorage):
    """:class:`LiveStorage` that reads each storage's size again at every op: a storage resized to nothing (as
    FSDP frees a gathered weight and keeps its tensor) stops counting."""

    def _settle(self) -> None:
        live = {}
        for ref in self._live:
            storage = None if ref.expired() else torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
            if storage is not None:  # None: freed since expired() was asked
                live[ref] = storage.nbytes()
        self._live = live
        self.now = sum(live.values())


def _collectives(log) -> list:
    return [(c["op"], c["numel"], c.get("dtype", "")) for c in log if c["op"] != "wait"]


def _train_mini(MiniFSDP, opt_name: str, dtype, device) -> dict:
    """The learner's MiniFSDP trained MINI_STEPS steps on this rank's chunk; the second step's collectives."""
    from contextlib import nullcontext

    world, rank = tdist.get_world_size(), tdist.get_rank()
    make, kwargs = MINI_OPTS[opt_name]
    x, y = mini_batch()
    xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
    wrapped = MiniFSDP(mini_net(), compute_dtype=getattr(torch, dtype) if dtype else None)
    opt = make(wrapped.parameters(), **kwargs)
    out = {"shard_numel": sum(p.numel() for p in wrapped.parameters())}
    for step in range(MINI_STEPS):
        opt.zero_grad()
        with record() as log, (torch.device(device) if device else nullcontext()):
            _loss(wrapped, xs, ys).backward()
            wrapped.finish_gradient_synchronization()
        if step == 1:
            out["collectives"] = _collectives(log)
        opt.step()
    full = wrapped.gather_full_params()
    out["dtypes"] = {k: str(v.dtype) for k, v in full.items()} if isinstance(full, dict) else type(full).__name__
    out["full"] = {k: v.detach().to("cpu", torch.float32) for k, v in full.items()} if isinstance(full, dict) else {}
    return out


def _diff(full: dict, want: dict) -> dict:
    return {k: (full[k] - v).abs().max().item() if k in full and full[k].shape == v.shape else None
            for k, v in want.items()}


def _mini_memory(MiniFSDP) -> dict:
    """Storage alive on this rank (:class:`LiveResized`): after wrapping, at each step's start, its peak during
    forward + backward, after the step; and the activations a plain forward saves, for the budget."""
    world, rank = tdist.get_world_size(), tdist.get_rank()
    x, y = mini_batch()
    xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
    plain = mini_net()
    with LiveStorage(before=list(plain.parameters())) as live:
        loss = _loss(plain, xs, ys)
        acts = live.now
    del loss, plain
    with LiveResized() as live:
        wrapped = MiniFSDP(mini_net())
        opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
        out = {"acts": acts, "held": [], "peak": []}
        for _ in range(2):
            gc.collect()
            live._settle()
            out["held"].append(live.now)
            live.peak = live.now
            _loss(wrapped, xs, ys).backward()
            wrapped.finish_gradient_synchronization()
            out["peak"].append(live.peak - out["held"][-1])
            opt.step()
            opt.zero_grad(set_to_none=True)
        gc.collect()
        live._settle()
        out["held"].append(live.now)
        out["shard_bytes"] = sum(p.numel() * p.element_size() for p in wrapped.parameters())
    return out


def _mini_sizes(world: int) -> dict:
    net = mini_net()
    return {"whole_bytes": 4 * sum(p.numel() for p in net.parameters()),
            "layer": max(padded_numel(list(b.parameters()), world) + world * 8 for b in net.blocks),
            "names": sorted(k for k, _ in net.named_parameters()),
            "padded": sum(zero.shard_size(p.numel(), world) * world for p in net.parameters()),
            "total": sum(p.numel() for p in net.parameters()), "count": len(list(net.parameters()))}


_MINI_REFERENCES: dict = {}  # (world, scenario) -> (one process's weights, fully_shard's distance from them or None)


def _mini_references(world: int) -> dict:
    """Every scenario's reference for this world size, made once per rank process, before any answer's code runs
    in it (so every rank makes them in step): one process's weights, and fully_shard's distance from them where a
    tolerance is measured. A launch that judges many answers in turn (the mutant tests') reuses them."""
    for name, opt_name, dtype, _device in MINI_SCENARIOS[world]:
        if (world, name) not in _MINI_REFERENCES:
            low = getattr(torch, dtype) if dtype else None
            want = _one_process_mini(opt_name, low)
            fsdp_diff = (max(_diff(_fully_sharded_mini(opt_name, low), want).values())
                         if dtype or opt_name == "AdamW" else None)
            _MINI_REFERENCES[(world, name)] = (want, fsdp_diff)
    return {name: _MINI_REFERENCES[(world, name)] for name, *_ in MINI_SCENARIOS[world]}


def run_minifsdp(MiniFSDP) -> dict:
    """Probe (2 or 3 ranks): every scenario of :data:`MINI_SCENARIOS` for this world size, beside one process
    (and fully_shard's distance from it where a tolerance is measured), then the storage each rank holds."""
    world = tdist.get_world_size()
    references = _mini_references(world)
    out = {"sizes": _mini_sizes(world), "scenarios": {}}
    for name, opt_name, dtype, device in MINI_SCENARIOS[world]:
        try:
            got = _train_mini(MiniFSDP, opt_name, dtype, device)
        except NotImplementedError:
            raise
        except Exception as exc:  # noqa: BLE001 - judged as evidence
            out["scenarios"][name] = {"error": _said(exc)}
            continue
        want, fsdp_diff = references[name]
        got["diff"] = _diff(got.pop("full"), want)
        got["start"] = _diff({k: v.detach() for k, v in mini_net().named_parameters()}, want)
        if fsdp_diff is not None:
            got["fsdp"] = fsdp_diff
        out["scenarios"][name] = got
    try:
        out["memory"] = _mini_memory(MiniFSDP)
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001 - judged as evidence
        out["memory"] = {"error": _said(exc)}
    return out

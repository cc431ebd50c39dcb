"""What lesson 13's checks run in real ranks or a fresh process; they return plain evidence, judged in :mod:`.judges`.

- :func:`run_exposed`: in 2 real ranks, profiled DDP steps (several buckets, one bucket,
  ``no_sync`` accumulation, a helper thread computing beside the training loop) and one step
  with no collective, each written as a Chrome trace and read back; then the learner's
  ``exposed_comm`` on every trace. The traces come back with the answers, so the kernel
  judges each answer against the reference computed on the very same trace. Tests that judge many
  answers name a folder in ``MGPU_LAB_L13_TRACE_CACHE``: the ranks record there once and reuse it.
- :func:`run_saved`: the learner's ``saved_bytes`` and :func:`reference_saved_bytes`
  on known models: views, a storage two modules save, tied weights, bfloat16, transformer blocks.
- :func:`run_checkpoint`: the learner's ``checkpoint_under`` on a stack of unequal blocks for
  several budgets, with every block's saved bytes before and after, the fewest blocks that
  can meet each budget (every subset tried) and the gradients against the unmodified model's.
- :func:`record_stragglers`: in 2 or 4 real ranks, every recording of :func:`straggler_plan` (DDP
  steps with a slow loader, extra compute or a larger batch on a rank drawn at random, and balanced
  ranks: :func:`mgpu_lab.profiling.uneven.uneven_ddp_trace`), each recorded again until the
  reference reads its design with a margin (:func:`shows_design`); :func:`run_find_straggler`:
  the learner's ``find_straggler`` on every recording, in a fresh process.

:func:`reference_saved_bytes` and :func:`reference_checkpoint_under` are the references of ``13.saved_bytes``
and ``13.checkpoint_under``; the reference of ``13.exposed_comm`` is :func:`.judges.reference_exposed_comm`.
"""
from __future__ import annotations

import copy
import itertools
import os
import shutil
import tempfile
import threading

import torch
from torch import nn

from mgpu_lab.profiling.blocks import Block, BlockStack, tokens
from .. import _references
from ..sim.outcome import one_thread, outcome
from .judges import helper_evidence, KINDS, straggler_reading


# -- references -----------------------------------------------------------------------------
def reference_saved_bytes(model: nn.Module, x: torch.Tensor) -> dict:
    """Bytes autograd saves for backward in ``model(x)``, per top-level module; each storage once, for the
    first module that saves it; saved parameters count."""
    current, seen = [None], set()
    out = {name: 0 for name, _ in model.named_children()}
    handles = [child.register_forward_pre_hook(lambda m, args, name=name: current.__setitem__(0, name))
               for name, child in model.named_children()]

    def pack(t):
        storage = t.untyped_storage()
        if current[0] is not None and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            out[current[0]] += storage.nbytes()
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = model(x)
    finally:
        for h in handles:
            h.remove()
    del y
    return out


def _checkpointed(block: nn.Module) -> None:
    from torch.utils.checkpoint import checkpoint

    forward = type(block).forward.__get__(block)
    block.forward = lambda *args: checkpoint(forward, *args, use_reentrant=False)


def _uncheckpointed(block: nn.Module) -> None:
    block.__dict__.pop("forward", None)


def total_with(model: nn.Module, x: torch.Tensor, chosen) -> int:
    """Saved bytes of ``model(x)`` with the blocks ``chosen`` (indices) checkpointed, the model left as it was."""
    for i in chosen:
        _checkpointed(model.blocks[i])
    try:
        return sum(reference_saved_bytes(model, x).values())
    finally:
        for i in chosen:
            _uncheckpointed(model.blocks[i])


def fewest(model: nn.Module, x: torch.Tensor, budget: int):
    """The smallest set of blocks (indices) whose checkpointing meets ``budget``, every subset tried; None."""
    n = len(model.blocks)
    for k in range(n + 1):
        for chosen in itertools.combinations(range(n), k):
            if total_with(model, x, chosen) <= budget:
                return chosen
    return None


def reference_checkpoint_under(model: nn.Module, x: torch.Tensor, budget_bytes: int) -> nn.Module:
    """Checkpoint the fewest of ``model.blocks`` so that the saved bytes of ``model(x)`` fit ``budget_bytes``."""
    chosen = fewest(model, x, budget_bytes)
    if chosen is None:
        least = total_with(model, x, range(len(model.blocks)))
        raise ValueError(f"budget_bytes={budget_bytes} cannot be met: with every block checkpointed "
                         f"{least} bytes are saved")
    for i in chosen:
        _checkpointed(model.blocks[i])
    return model


REFERENCES = ("mgpu_lab.course.checks.l13.ranks:reference_saved_bytes",
              "mgpu_lab.course.checks.l13.ranks:reference_checkpoint_under",
              "mgpu_lab.course.checks.l13.ranks:fewest", "mgpu_lab.course.checks.l13.ranks:total_with")


# -- exposed_comm ----------------------------------------------------------------------------
#: The recorded runs: DDP of 4 Linear(128) layers in 2 ranks, and one process's step with no collective.
SCENARIOS = {"overlap": {"cap_mb": 0.02}, "one bucket": {"cap_mb": 100.0}, "no_sync": {"cap_mb": 0.02, "no_sync": True},
             "helper": {"cap_mb": 0.02, "helper": 96}}


def _local_step(folder: str) -> str:
    from mgpu_lab.profiling.traces import profile_steps

    model, x = BlockStack(ratios=(2,)), tokens(4, 16, 32)
    return profile_steps(lambda: model(x).square().mean().backward(), folder, wait=0, warmup=1, active=1,
                         name="local-rank")


def record_traces(folder: str) -> dict:
    """In a rank: every scenario's trace (as dicts), and the thread ids of the training loop and the helper."""
    from mgpu_lab.profiling.runs import ddp_trace
    from mgpu_lab.profiling.traces import complete_events, load_trace

    record = lambda name: load_trace(ddp_trace(folder, width=128, depth=4, batch=32,  # noqa: E731
                                               name=name.replace(" ", "_") + "-rank", **SCENARIOS[name]))
    traces = {name: record(name) for name in SCENARIOS}
    traces["no collective"] = load_trace(_local_step(folder))
    training = threading.get_native_id()

    def helper_of(trace):
        others = {e["tid"] for e in complete_events(trace) if e.get("cat") == "cpu_op"} - {training}
        return min(others) if others else None

    # The helper trace is recorded again (up to 3 times) while it cannot judge an answer: the profiler now and then
    # misses every operator of the helper thread, and on a loaded machine no rank's trace may show exposed
    # communication, or none whose reading depends on the thread named (judges.helper_evidence)
    for tries in range(4):
        helper = helper_of(traces["helper"])
        shown = torch.tensor([int(helper is None)] + helper_evidence(traces["helper"], training, helper))
        torch.distributed.all_reduce(shown)  # DDP is collective: every rank records again, or none
        if tries == 3 or (shown[0].item() == 0 and bool((shown[1:] >= 1).all())):
            break
        traces["helper"] = record("helper")
    return {"traces": traces, "training": training, "helper": helper}


#: A folder where the ranks keep their recorded traces and reuse them (tests that judge many answers set it).
CACHE_ENV = "MGPU_LAB_L13_TRACE_CACHE"


def _traces() -> dict:
    """This rank's recorded traces: fresh, or from the folder :data:`CACHE_ENV` names (recorded there once)."""
    cache = os.environ.get(CACHE_ENV)
    path = os.path.join(cache, f"exposed-rank{torch.distributed.get_rank()}.pt") if cache else None
    if path and os.path.exists(path):
        return torch.load(path, weights_only=False)
    folder = tempfile.mkdtemp(prefix="mgpu-lab-l13-")
    try:
        with _references.allowed():
            out = record_traces(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if path:
        os.makedirs(cache, exist_ok=True)
        torch.save(out, path)
    return out


def run_exposed(exposed_comm) -> dict:
    """Probe (2 ranks): the recorded traces, and the learner's answer on each (plus the helper trace with
    ``rank_thread`` naming the training thread, then the helper thread)."""
    one_thread()
    outcome(exposed_comm, {"traceEvents": []})  # an answer not written yet stops here, before any recording
    out = _traces()
    calls = [(name, None) for name in out["traces"]]
    calls += [("helper", out["training"])] + ([("helper", out["helper"])] if out["helper"] is not None else [])
    out["answers"] = []
    for name, thread in calls:
        args = (copy.deepcopy(out["traces"][name]),) + (() if thread is None else (thread,))
        got = outcome(exposed_comm, *args)
        if got[0] == "ok" and not isinstance(got[1], (int, float)):
            got = ("ok", repr(got[1])[:100] if not hasattr(got[1], "item") else float(got[1]))
        out["answers"].append((name, thread, got))
    return out


# -- saved_bytes -------------------------------------------------------------------------------
class Views(nn.Module):
    """``proj`` makes one tensor; ``mix`` saves two slices and a transpose of it (one storage)."""

    class Mix(nn.Module):
        def forward(self, h):
            a, b = h[:, :8], h[:, 8:]
            return a * b + (a.t() @ b).sum()

    def __init__(self):
        super().__init__()
        self.proj, self.mix, self.out = nn.Linear(6, 16), Views.Mix(), nn.Linear(8, 2)

    def forward(self, x):
        return self.out(self.mix(self.proj(x)))


class Tied(nn.Module):
    """An encoder and a decoder that share one weight, with a ReLU between (its output is the decoder's input)."""

    def __init__(self):
        super().__init__()
        self.enc, self.act, self.dec = nn.Linear(12, 12), nn.ReLU(), nn.Linear(12, 12)
        self.dec.weight = self.enc.weight

    def forward(self, x):
        return self.dec(self.act(self.enc(x)))


def known_models() -> dict:
    """name -> (model, input): the models ``13.saved_bytes`` is judged on (fresh, the same weights each time)."""
    torch.manual_seed(0)
    return {
        "mlp": (nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Flatten(), nn.Linear(20, 5)), torch.randn(4, 10)),
        "views": (Views(), torch.randn(5, 6)),
        "tied": (Tied(), torch.randn(3, 12)),
        "bf16": (nn.Sequential(nn.Linear(10, 20), nn.GELU(), nn.Linear(20, 5)).to(torch.bfloat16),
                 torch.randn(4, 10, dtype=torch.bfloat16)),
        "blocks": (nn.Sequential(Block(32, 4, 2), Block(32, 4, 4)), tokens(2, 8, 32)),
    }


def run_saved(saved) -> dict:
    """Probe: per known model, the reference's bytes and the learner's answer (an outcome)."""
    one_thread()
    out = {}
    for name in known_models():
        with _references.allowed():
            model, x = known_models()[name]
            expected = reference_saved_bytes(model, x)
        model, x = known_models()[name]
        got = outcome(saved, model, x)
        if got[0] == "ok":
            got = ("ok", {str(k): (int(v) if isinstance(v, (int, float)) else repr(v)) for k, v in dict(got[1]).items()}
                   if isinstance(got[1], dict) else repr(got[1])[:100])
        out[name] = {"expected": expected, "got": got}
    return out


# -- checkpoint_under ---------------------------------------------------------------------------
RATIOS = (8, 2, 4, 1)  # unequal blocks: the first saves most, the last least


def stack() -> tuple:
    return BlockStack(dim=32, heads=4, ratios=RATIOS), tokens(2, 16, 32)


def per_block(model, x) -> list:
    """Saved bytes of each of ``model.blocks`` in ``model(x)`` (the blocks as they are now, wrapped or not)."""
    got = reference_saved_bytes(model.blocks, x)  # an nn.Sequential: its children are the blocks, named "0", "1", ...
    return [got[str(i)] for i in range(len(model.blocks))]


def _grads(model, x) -> list:
    model.zero_grad()
    model(x).square().mean().backward()
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def budgets() -> dict:
    """name -> budget in bytes, from the model's own numbers on this torch."""
    model, x = stack()
    full = total_with(model, x, ())
    return {"met already": full, "one block": total_with(model, x, (0,)) + 64,
            "two blocks, exactly": total_with(model, x, (0, 2)),
            "unreachable": total_with(model, x, range(len(RATIOS))) - 1}


def _one_budget(checkpoint_under, budget: int) -> dict:
    model, x = stack()
    with _references.allowed():
        before = per_block(model, x)
        want = fewest(model, x, budget)
        least = total_with(model, x, range(len(model.blocks)))
    ref = copy.deepcopy(model)
    out = {"budget": budget, "before": before, "fewest": None if want is None else list(want), "least": least}
    got = outcome(checkpoint_under, model, x, budget)
    out["outcome"] = got if got[0] == "raised" else ("ok", type(got[1]).__name__)
    if got[0] == "raised":
        return out
    returned = got[1]
    out["same object"] = returned is model
    target = returned if isinstance(returned, nn.Module) else model
    with _references.allowed():
        out["after"] = per_block(target, x) if hasattr(target, "blocks") else None
        out["total"] = sum(reference_saved_bytes(target, x).values())
    out["same output"] = bool(torch.allclose(target(x), ref(x), atol=1e-6))
    mine, want_grads = _grads(target, x), _grads(ref, x)
    out["grads"] = [("none" if g is None else float((g - w).abs().max()) if g.shape == w.shape else "shape")
                    for g, w in zip(mine, want_grads)]
    return out


def run_checkpoint(checkpoint_under) -> dict:
    """Probe: ``checkpoint_under`` on a fresh stack for every budget of :func:`budgets`."""
    one_thread()
    with _references.allowed():
        plan = budgets()
    return {name: _one_budget(checkpoint_under, budget) for name, budget in plan.items()}



# -- find_straggler ------------------------------------------------------------------------------
#: A recording counts as evidence when the reference reads its design with a margin: a straggler whose excess
#: is at least this share of the step (the verdict's threshold is ``judges.SLOWS``), ...
CLEAR_SLOW = 0.5
#: ... and balanced ranks whose largest excess stays below this share.
CLEAR_BALANCED = 0.2


def straggler_plan(world: int, seed=None) -> list[dict]:
    """The recordings of one world size, in a random order: a slow loader, extra compute and a larger batch,
    each on a random rank (on different ranks where there are enough), and balanced ranks; slowdowns drawn too."""
    import random

    rng = random.Random(seed)
    picks = [rng.randrange(world) for _ in range(3)]
    while len(set(picks)) < min(world, 3) - (world == 2):  # 2 ranks: both appear; 4 ranks: three different
        picks = [rng.randrange(world) for _ in range(3)]
    changes = ({"delay": round(rng.uniform(0.2, 0.28), 3)}, {"extra": rng.choice((5, 6))},
               {"batch": rng.choice((1024, 1280))})
    plan = [{"kind": kind, "rank": r, "ranks": {r: change}}
            for kind, r, change in zip(("loader", "compute", "batch"), picks, changes)]
    plan.append({"kind": "balanced", "rank": None, "ranks": {}})
    rng.shuffle(plan)
    return plan


def shows_design(reading: dict, scenario: dict, rows: list[dict] | None = None) -> bool:
    """Whether the reference's ``reading`` of a recording shows the ``scenario`` it was made for, with a margin;
    given the recording's ``rows``, the reading with the waiting read as backward's time outside operators (a
    right answer's way too) must show it as well: on a busy machine the two can part, and a recording that one
    right reading finds balanced and another does not is no evidence for either."""
    if rows is not None and not shows_design(straggler_reading(rows, waiting="idle"), scenario):
        return False
    if scenario["rank"] is None:
        return reading["share"] <= CLEAR_BALANCED
    mine, other = ((reading["data_ms"], reading["compute_ms"]) if KINDS[scenario["kind"]] == "data"
                   else (reading["compute_ms"], reading["data_ms"]))
    return reading["candidate"] == scenario["rank"] and reading["share"] >= CLEAR_SLOW and mine > 2 * max(other, 0.0)


def _record_one(scenario: dict, folder: str, index: int, tries: int = 5) -> dict:
    """In a rank: record ``scenario`` until the reference reads its design clearly (at most ``tries`` times)."""
    from mgpu_lab.profiling.traces import load_trace
    from mgpu_lab.profiling.uneven import uneven_ddp_trace

    from .judges import rank_rows

    world, out = torch.distributed.get_world_size(), {}
    for attempt in range(tries):
        name = f"w{world}-s{index}-try{attempt}-rank"
        uneven_ddp_trace(folder, scenario["ranks"], name=name)
        torch.distributed.barrier()  # every rank's trace is written
        paths = [os.path.join(folder, f"{name}{r}.json") for r in range(world)]
        clear = torch.tensor([0])
        if torch.distributed.get_rank() == 0:
            with _references.allowed():
                rows = rank_rows([load_trace(p) for p in paths])
                reading = straggler_reading(rows)
                clear[0] = int(shows_design(reading, scenario, rows))
            out = {"kind": scenario["kind"], "rank": scenario["rank"], "paths": paths, "rows": rows,
                   "reading": reading, "tries": attempt + 1}
        torch.distributed.broadcast(clear, 0)
        if clear.item():
            break
    return out | {"clear": bool(clear.item())}


def _cache_file(world: int):
    cache = os.environ.get(CACHE_ENV)
    return os.path.join(cache, f"stragglers-w{world}.pt") if cache else None


def cached_stragglers(world: int):
    """The recordings of ``world`` ranks that the folder :data:`CACHE_ENV` names holds (tests set it), or None."""
    path = _cache_file(world)
    return torch.load(path, weights_only=False) if path and os.path.exists(path) else None


def record_stragglers(find_straggler, plan: list, folder: str):
    """Probe (2 or 4 ranks): every recording of ``plan`` (its traces in ``folder``, or in the tests' cache), each
    with the reference's reading; rank 0 returns them. An answer not written yet stops before any recording."""
    one_thread()
    outcome(find_straggler, [])
    cache = _cache_file(torch.distributed.get_world_size())
    if cache:
        folder = os.path.dirname(cache)
    out = [_record_one(scenario, folder, i) for i, scenario in enumerate(plan)]
    if cache and torch.distributed.get_rank() == 0:
        torch.save(out, cache)
    return out if torch.distributed.get_rank() == 0 else None


def _plain(answer):
    """What a ``find_straggler`` answer travels back as: a dict of plain values, or its repr."""
    if isinstance(answer, dict):
        return {str(k): (v if v is None or isinstance(v, (str, int, float)) else repr(v)[:60]) for k, v in answer.items()}
    return repr(answer)[:100]


def run_find_straggler(find_straggler, recorded: dict) -> dict:
    """In a fresh process: ``{world: [outcome of find_straggler(paths), ...]}`` in each world's recorded order."""
    one_thread()
    out = {}
    for world, scenarios in recorded.items():
        answers = []
        for scenario in scenarios:
            got = outcome(find_straggler, list(scenario["paths"]))
            answers.append(("ok", _plain(got[1])) if got[0] == "ok" else got)
        out[world] = answers
    return out

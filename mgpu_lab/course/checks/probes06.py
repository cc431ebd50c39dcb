"""What lesson 06's checks run in a fresh process: the learner's net and step on recording stages.

:func:`run_two_stage` builds the learner's ``TwoStageNet`` from stages that
record every ``.to`` and tensors that record where they were moved;
:func:`run_pipelined` runs the learner's ``pipelined_step`` and names the
gradient the learner's answer matches; :func:`evaluate` calls a function on
many arguments. Each returns plain evidence that :mod:`.lesson06` judges in the
kernel. They are module-level functions of an importable module, so the process
receives them by name and imports this module, which holds no judging.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from ._moves import Moved
from ._moves import tag as _tag


# -- TwoStageNet --------------------------------------------------------------------
class Stage(nn.Module):
    """A stage that records ``.to``/``.cuda`` calls, whether its input was moved, and tags its output."""

    log: list = []

    def __init__(self, inner: nn.Module, name: str, out_tag: str):
        super().__init__()
        self.inner, self.name, self.out_tag = inner, name, out_tag

    def to(self, *args, **kwargs):
        Stage.log.append((self.name, "to", str(torch._C._nn._parse_to(*args, **kwargs)[0])))
        return super().to(*args, **kwargs)

    def cuda(self, device=None):
        Stage.log.append((self.name, "to", str(torch.device("cuda", device) if device is not None else "cuda")))
        return super().cuda(device)

    def forward(self, x):
        if isinstance(x, Moved):
            Stage.log.append((self.name, "input", x.tag))
        return _tag(self.inner(x.as_subclass(torch.Tensor) if isinstance(x, Moved) else x), self.out_tag)


def _stages(conv: bool):
    torch.manual_seed(1)
    if conv:
        return (nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU()),
                nn.Sequential(nn.Flatten(), nn.Linear(4 * 5 * 5, 3))), torch.randn(3, 2, 5, 5)
    return (nn.Sequential(nn.Linear(6, 8), nn.Tanh()), nn.Sequential(nn.Linear(8, 8), nn.ReLU(),
                                                                   nn.Linear(8, 4))), torch.randn(5, 6)


def run_two_stage(TwoStageNet, conv: bool = False, as_strings: bool = False) -> dict:
    """Build the learner's net from recording stages on dev1=cpu:0, dev2=cpu:1; compare with the unsplit model."""
    (inner1, inner2), x = _stages(conv)
    ref = nn.Sequential(copy.deepcopy(inner1), copy.deepcopy(inner2))
    s1, s2 = Stage(inner1, "stage1", "activations"), Stage(inner2, "stage2", "output")
    dev1, dev2 = torch.device("cpu", 0), torch.device("cpu", 1)
    Stage.log, Moved.log = [], []
    net = TwoStageNet(s1, s2, str(dev1) if as_strings else dev1, str(dev2) if as_strings else dev2)
    out = {"module": isinstance(net, nn.Module)}
    if not out["module"]:
        return {**out, "type": type(net).__name__}
    params = list(net.parameters())
    out["n_params"], out["n_expected"] = len(params), len(list(ref.parameters()))
    got = net(_tag(x.clone(), "inputs"))
    out["output_type"] = "Tensor" if isinstance(got, torch.Tensor) else type(got).__name__
    if not isinstance(got, torch.Tensor):
        return out
    got = got.as_subclass(torch.Tensor)
    expected = ref(x)
    out["same_output"] = got.shape == expected.shape and torch.allclose(got, expected, atol=1e-6)
    weight = torch.randn(expected.shape, generator=torch.Generator().manual_seed(2))
    (expected * weight).sum().backward()
    if out["same_output"]:
        (got * weight).sum().backward()
        ref_grads = [p.grad for p in ref.parameters()]
        own = [p.grad for p in list(inner1.parameters()) + list(inner2.parameters())]
        if any(g is None for g in own):  # the net copied the stages: judge its own parameters
            own = [p.grad for p in params]
        out["same_grads"] = len(own) == len(ref_grads) and all(
            g is not None and torch.allclose(g, r, atol=1e-6) for g, r in zip(own, ref_grads))
    out["stage_log"], out["moves"] = list(Stage.log), list(Moved.log)
    return out


# -- pipelined_step -----------------------------------------------------------------
def _micro_grads(stage1, stage2, x, y, loss_fn, n_micro):
    """Per micro-batch (torch.chunk): gradient of its own mean loss, and its size."""
    out = []
    for xs, ys in zip(torch.chunk(x, n_micro), torch.chunk(y, n_micro)):
        for p in list(stage1.parameters()) + list(stage2.parameters()):
            p.grad = None
        loss_fn(stage2(stage1(xs)), ys).backward()
        out.append(([p.grad.clone() for p in list(stage1.parameters()) + list(stage2.parameters())], len(xs)))
    return out


def _kept_grads(stage1, stage2, x, y, loss_fn, n_micro):
    """Gradient of the mean loss over the first n_micro * (len(x) // n_micro) samples only."""
    kept = n_micro * (len(x) // n_micro)
    stage1, stage2 = copy.deepcopy(stage1), copy.deepcopy(stage2)
    for p in list(stage1.parameters()) + list(stage2.parameters()):
        p.grad = None
    if kept == 0 or kept == len(x):
        return [torch.full_like(p, float("nan")) for p in list(stage1.parameters()) + list(stage2.parameters())]
    loss_fn(stage2(stage1(x[:kept])), y[:kept]).backward()
    return [p.grad for p in list(stage1.parameters()) + list(stage2.parameters())]


def _same(a, b) -> bool:
    return all(torch.allclose(g, r, atol=1e-6, rtol=1e-4) for g, r in zip(a, b))


def run_pipelined(pipelined_step, batch: int, n_micro: int, regression: bool = False) -> dict:
    """Run the learner's step on fresh stages; compare with one full-batch step; name the likely bug."""
    torch.manual_seed(3)
    if regression:
        s1, s2, loss_fn = nn.Sequential(nn.Linear(5, 7), nn.Tanh()), nn.Linear(7, 1), nn.MSELoss()
        x, y = torch.randn(batch, 5), torch.randn(batch, 1)
    else:
        s1, s2, loss_fn = nn.Sequential(nn.Linear(6, 9), nn.ReLU()), nn.Linear(9, 4), nn.CrossEntropyLoss()
        x, y = torch.randn(batch, 6), torch.randint(0, 4, (batch,))
    r1, r2 = copy.deepcopy(s1), copy.deepcopy(s2)
    ref_loss = loss_fn(r2(r1(x)), y)
    ref_loss.backward()
    ref = [p.grad for p in list(r1.parameters()) + list(r2.parameters())]
    micro = _micro_grads(copy.deepcopy(r1), copy.deepcopy(r2), x, y, loss_fn, n_micro)
    sizes = {"stage1": [], "stage2": []}
    s1.register_forward_pre_hook(lambda m, a: sizes["stage1"].append(len(a[0])))
    s2.register_forward_pre_hook(lambda m, a: sizes["stage2"].append(len(a[0])))
    loss = pipelined_step(s1, s2, x.clone(), y.clone(), loss_fn, n_micro)
    grads = [p.grad for p in list(s1.parameters()) + list(s2.parameters())]
    number = isinstance(loss, (int, float, torch.Tensor)) and torch.as_tensor(loss).numel() == 1
    out = {"type": "float" if isinstance(loss, float) else type(loss).__name__, "loss": float(torch.as_tensor(loss).detach()) if number else repr(loss)[:100], "ref_loss": float(ref_loss.detach()),
           "sizes": sizes, "chunks": [len(c) for c in torch.chunk(x, n_micro)], "no_grads": any(g is None for g in grads)}
    if out["no_grads"]:
        return {**out, "same": False, "bug": "no gradients: call backward on the loss"}
    out["same"] = _same(grads, ref)
    n = len(micro)
    candidates = [
        ("unscaled", [sum(g[i] for g, _ in micro) for i in range(len(ref))]),
        ("one_over_n", [sum(g[i] for g, _ in micro) / n_micro for i in range(len(ref))]),
        ("last_only", micro[-1][0]),
        ("last_only", [g / n for g in micro[-1][0]]),
        ("last_only", [g * micro[-1][1] / batch for g in micro[-1][0]]),
        ("dropped", _kept_grads(r1, r2, x, y, loss_fn, n_micro)),
    ]
    out["bug"] = next((name for name, cand in candidates if not out["same"] and _same(grads, cand)), "")
    return out


# -- bubble_fraction ----------------------------------------------------------------
def evaluate(fn, calls) -> list:
    """``fn(*args)`` for every args tuple: ``("ok", value, is_float)`` or ``("raised", type name, message)``."""
    out = []
    for args in calls:
        try:
            value = fn(*args)
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            out.append(("ok", value if number else repr(value)[:80], isinstance(value, float)))
        except NotImplementedError:
            raise
        except Exception as exc:  # noqa: BLE001 - the check judges the exception
            out.append(("raised", type(exc).__name__, str(exc)[:200]))
    return out

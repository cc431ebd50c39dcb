"""mgpu_lab.profiling.runs in one process: checkpointing modes, their memory and gradients; compile's cost."""
from __future__ import annotations

import inspect

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from mgpu_lab.course.checks.l13.ranks import reference_saved_bytes
from mgpu_lab.profiling import blocks, runs

pytestmark = pytest.mark.timeout(240)


def _grads(model, x):
    model.zero_grad()
    model(x).square().mean().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_full_checkpointing_saves_least_selective_between_and_the_gradients_stay():
    model, x = blocks.BlockStack(ratios=(4, 4)), blocks.tokens(2, 16, 32)
    want = _grads(model, x)
    saved = {}
    for mode in runs.MODES:
        runs.checkpoint_modes(model, mode)
        saved[mode] = sum(reference_saved_bytes(model, x).values())
        assert all(torch.allclose(g, w, atol=1e-6) for g, w in zip(_grads(model, x), want)), mode
    if "respect_saved_tensors_hooks" in inspect.signature(checkpoint).parameters:
        assert saved["full"] < saved["selective"] < saved["none"]
    else:  # an older torch hides what selective checkpointing keeps from saved_tensors_hooks
        assert saved["full"] <= saved["selective"] < saved["none"]
    runs.checkpoint_modes(model, "none")
    assert sum(reference_saved_bytes(model, x).values()) == saved["none"]  # a mode replaces the one before


def test_counted_flops_full_checkpointing_recomputes_the_blocks_products_selective_none():
    d, ratio = 32, 4
    model, x = blocks.BlockStack(dim=d, ratios=(ratio, ratio)), blocks.tokens(2, 16, d)
    flops = {}
    for mode, early in (("none", True), ("selective", True), ("full", True), ("full", False)):
        runs.checkpoint_modes(model, mode)
        flops[mode, early] = runs.step_flops(model, x, early_stop=early)["total"]
    runs.checkpoint_modes(model, "none")
    tokens, block_forward = 2 * 16, 2 * 2 * 16 * (4 + 2 * ratio) * d * d  # each block's Linear products
    assert flops["selective", True] == flops["none", True]  # the products are kept, not recomputed
    assert flops["full", False] - flops["none", True] == 2 * block_forward  # every block's forward again
    fc2 = 2 * tokens * ratio * d * d  # the block's last product: no saved tensor needs its output
    assert flops["full", True] - flops["none", True] == 2 * (block_forward - fc2)


def test_an_unknown_mode_is_refused_naming_the_modes():
    with pytest.raises(ValueError, match="'none', 'full', 'selective'"):
        runs.checkpoint_modes(blocks.BlockStack(ratios=(1,)), "some")


def test_compile_seconds_times_the_first_compiled_step_apart():
    model, x = blocks.BlockStack(ratios=(1,)), blocks.tokens(1, 8, 32)
    cost = runs.compile_seconds(model, x, backend="eager", repeats=1)
    assert set(cost) == {"eager", "first", "compiled"} and cost["first"] > 0 and cost["compiled"] > 0

"""torch 2.13's collective names on older torch releases (mgpu_lab.core.compat)."""
from __future__ import annotations

import warnings

import torch
import torch.distributed as tdist

from mgpu_lab import launch
from mgpu_lab.core import compat


def test_missing_names_are_added_as_the_older_functions(monkeypatch):
    for new in compat.ALIASES:
        monkeypatch.delattr(tdist, new, raising=False)
    assert compat.install() == ["reduce_scatter_single", "all_gather_single"]
    assert tdist.reduce_scatter_single is tdist.reduce_scatter_tensor
    assert tdist.all_gather_single is tdist.all_gather_into_tensor
    assert compat.install() == []  # nothing twice


def test_a_torch_that_has_them_is_left_alone(monkeypatch):
    sentinel = object()
    monkeypatch.setattr(tdist, "reduce_scatter_single", sentinel, raising=False)
    monkeypatch.setattr(tdist, "all_gather_single", sentinel, raising=False)
    assert compat.install() == [] and tdist.reduce_scatter_single is sentinel


def _aliased_collectives():
    for new in compat.ALIASES:  # as on torch 2.11
        if hasattr(tdist, new):
            delattr(tdist, new)
    added = compat.install()
    rank, world = tdist.get_rank(), tdist.get_world_size()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch 2.14 deprecates the older names
        block = torch.empty(2)
        tdist.reduce_scatter_single(block, torch.arange(2.0 * world) * (rank + 1))
        full = torch.empty(2 * world)
        tdist.all_gather_single(full, block)
    return added, block.tolist(), full.tolist()


def test_the_aliases_compute_what_the_new_names_do_on_real_ranks():
    results = launch(_aliased_collectives, 2)
    # sum over ranks of arange(4) * (rank + 1) = arange(4) * 3; rank r keeps elements 2r, 2r+1
    assert results[0] == (["reduce_scatter_single", "all_gather_single"], [0.0, 3.0], [0.0, 3.0, 6.0, 9.0])
    assert results[1] == (["reduce_scatter_single", "all_gather_single"], [6.0, 9.0], [0.0, 3.0, 6.0, 9.0])

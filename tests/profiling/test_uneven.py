"""mgpu_lab.profiling.uneven: DDP steps whose ranks do unequal work, profiled in real ranks."""
from __future__ import annotations

import time

import pytest
import torch

from mgpu_lab import launch
from mgpu_lab.profiling.traces import complete_events, load_trace
from mgpu_lab.profiling.uneven import Extra, Samples, uneven_ddp_trace

LOADER = "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__"


def _graph(fn) -> list[str]:
    """The names of the backward nodes reachable from ``fn``."""
    names, todo = [], [fn]
    while todo:
        node = todo.pop()
        if node is not None:
            names.append(type(node).__name__)
            todo += [next_fn for next_fn, _ in node.next_functions]
    return names


def test_extra_adds_compute_in_forward_and_backward_but_no_parameter_and_no_change_to_the_output():
    h = torch.randn(4, 16, requires_grad=True)
    extra = Extra(16, repeats=2, hidden=32)
    assert list(extra.parameters()) == [] and list(extra.buffers()) == []  # DDP's buckets stay the same
    out = extra(h)
    assert torch.equal(out, h) and sum("TanhBackward" in n for n in _graph(out.grad_fn)) == 2  # backward runs it
    out.sum().backward()
    assert torch.equal(h.grad, torch.ones_like(h))
    assert Extra(16, repeats=0)(h) is h


def test_samples_fetch_a_whole_batch_at_once_after_the_delay():
    data = Samples(8, delay=0.05, n=16)
    start = time.perf_counter()
    x, y = data.__getitems__([0, 1, 17])  # indices wrap around the fixed samples
    assert time.perf_counter() - start >= 0.05
    assert x.shape == (3, 8) and torch.equal(x[2], data.x[1]) and torch.equal(y[:2], data.y[:2])


def _loader_ms(path: str) -> float:
    events = complete_events(load_trace(path))
    return max(e["dur"] for e in events if e["name"] == LOADER) / 1e3


def test_a_slow_loader_on_one_rank_shows_in_its_trace_only(tmp_path):
    paths = launch(uneven_ddp_trace, 2, str(tmp_path), {1: {"delay": 0.2}}, delay=0.0, width=32, steps=1)
    assert [p.rsplit("/", 1)[1] for p in paths] == ["uneven-rank0.json", "uneven-rank1.json"]
    assert _loader_ms(paths[1]) >= 200 > 4 * _loader_ms(paths[0])
    names = {e["name"] for e in complete_events(load_trace(paths[0]))}
    assert {"forward", "backward", "optimizer", "gloo:all_reduce"} <= names


def test_a_setting_that_does_not_exist_is_refused_naming_the_settings(tmp_path):
    with pytest.raises(Exception, match=r"ranks\[0\]=\{'speed': 2\}: the settings are \('delay', 'extra', 'batch'\)"):
        launch(uneven_ddp_trace, 2, str(tmp_path), {0: {"speed": 2}}, width=32, steps=1)

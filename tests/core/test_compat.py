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


def _warmup_ops_of_stage_1_in_a_v(fix: bool):
    """Stage 1 of 4 in ZBV's V on 2 ranks: stages 1 and 2 both sit on rank 1."""
    import torch.nn as nn
    from torch.distributed.pipelining import PipelineStage

    if fix:
        compat.fix_pipeline_warmup()
    rank = tdist.get_rank()
    stage = PipelineStage(nn.Linear(2, 2), 1 + rank, 4, torch.device("cpu"))  # rank 0: stage 1, rank 1: stage 2
    stage.stage_index_to_group_rank = {0: 0, 1: 1, 2: 1, 3: 0}
    if rank == 0:
        return None
    method = type(stage)._get_init_p2p_neighbors_ops
    ops = method(stage) if fix else getattr(method, "__wrapped__", method)(stage)  # torch 2.11's ranks fix it at start
    return sorted((op.op.__name__, op.group_peer) for op in ops)


def test_the_pipeline_warm_up_never_sends_to_the_rank_itself_once_fixed():
    before = launch(_warmup_ops_of_stage_1_in_a_v, 2, False)[1]
    after = launch(_warmup_ops_of_stage_1_in_a_v, 2, True)[1]
    assert ("isend", 1) in before and ("irecv", 1) in before  # stage 2's warm-up with stage 1, on its own rank
    assert after == [op for op in before if op[1] != 1] and after  # its neighbour stage 3 on rank 0 stays


def _zbv_gradients():
    import torch.nn as nn

    from mgpu_lab.pipelining import train

    compat.fix_pipeline_warmup()  # on torch 2.11, install() applied it already; here it also runs on newer torch
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    torch.manual_seed(1)
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    modules, _, sched = train._build(model, "zbv", 4, 4, tdist.group.WORLD, torch.device("cpu"))
    train._step(sched, list(modules), 4, x, y)
    return {k: [p.grad.clone() for p in m.parameters()] for k, m in modules.items()}


def test_zbv_on_gloo_with_the_fix_gives_one_process_s_gradients():
    import torch.nn as nn

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    torch.manual_seed(1)
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    nn.functional.mse_loss(model(x), y).backward()  # the schedule's loss: mean over micro-batches of MSE
    got = {k: v for part in launch(_zbv_gradients, 2) for k, v in part.items()}
    assert sorted(got) == [0, 1, 2, 3]
    for k in range(4):
        want = [p.grad for p in model[k].parameters()]
        assert all(torch.allclose(g, w, atol=1e-6) for g, w in zip(got[k], want)), k

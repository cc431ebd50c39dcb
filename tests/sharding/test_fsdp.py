"""mgpu_lab.sharding.fsdp, .distcp and .side_by_side: FSDP2 and DCP in real ranks on the CPU."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from mgpu_lab import launch
from mgpu_lab.sharding import distcp
from mgpu_lab.comm.record import record
from mgpu_lab.sharding.fsdp import BlockNet, batch, full_params, make_mesh, peak_bytes, reference_steps, train_steps
from mgpu_lab.sharding.wrap import shard_model
from mgpu_lab.sharding.zero import zero_memory
from mgpu_lab.sharding.side_by_side import scheme_rank

pytestmark = pytest.mark.timeout(300)
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def test_block_net_counts_its_parameters_and_leaves_the_callers_random_state_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    model = BlockNet(features=5, width=7, depth=3, classes=2, seed=4)
    assert torch.equal(torch.rand(3), expected)
    assert BlockNet.count(5, 7, 3, 2) == sum(p.numel() for p in model.parameters())
    assert torch.equal(model.head.weight, BlockNet(5, 7, 3, 2, seed=4).head.weight)


def test_peak_bytes_on_the_cpu_counts_what_a_function_allocated_at_once():
    def two_then_one():
        a = torch.empty(1000)
        b = torch.empty(2000)
        del a, b
        return torch.empty(500)

    assert peak_bytes(lambda: torch.empty(1000), torch.device("cpu")) == 4000
    assert peak_bytes(two_then_one, torch.device("cpu")) == 12000


# -- FSDP2 in 2 ranks --------------------------------------------------------------------------
def _fsdp_rank():
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, Shard

    mesh = make_mesh()
    model = shard_model(BlockNet(features=5, width=7, depth=3), mesh)
    out = {"mesh": (mesh.device_type, mesh.mesh_dim_names),
           "fsdp": sorted(n or "(root)" for n, m in model.named_modules() if isinstance(m, FSDPModule)),
           "dtensors": all(isinstance(p, DTensor) and p.placements == (Shard(0),) and p.device_mesh == mesh
                           for p in model.parameters()),
           "local_rows": model.inp.weight.to_local().shape[0]}
    x, y = batch(8, 5)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    with record() as log:
        train_steps(model, optimizer, x, y, 1)
    out["log"] = [(c["op"], c["numel"]) for c in log]
    train_steps(model, optimizer, x, y, 2)
    out["trained"] = full_params(model)
    return out


@pytest.fixture(scope="module")
def fsdp_ranks():
    return launch(_fsdp_rank, 2)


def test_shard_model_makes_every_block_and_the_root_a_group_of_dtensors_on_the_mesh(fsdp_ranks):
    r0, r1 = fsdp_ranks
    assert r0["mesh"] == ("cpu", ("dp",))
    assert r0["fsdp"] == ["(root)", "blocks.0", "blocks.1", "blocks.2"] and r0["dtensors"]
    assert (r0["local_rows"], r1["local_rows"]) == (4, 3)  # 7 rows over 2 ranks


def test_an_fsdp_step_all_gathers_each_block_twice_and_the_root_once(fsdp_ranks):
    block, root = 64, 80  # Linear(7, 7) padded to 8 rows; inp (7 x 5 + 7) and head (3 x 7 + 3) padded
    log = fsdp_ranks[0]["log"]
    assert sorted(n for op, n in log if op == "all_gather") == sorted([root] + [block] * 6)
    assert sorted(n for op, n in log if op == "reduce_scatter") == sorted([root] + [block] * 3)


def test_fsdp_training_equals_one_process_with_the_global_batch(fsdp_ranks):
    x, y = batch(8, 5)
    ref = reference_steps(BlockNet(features=5, width=7, depth=3), x, y, 3, 0.5)
    for r in fsdp_ranks:
        assert max((r["trained"][k] - v).abs().max().item() for k, v in ref.items()) < 1e-5


def test_the_schemes_compared_hold_the_formula_and_move_2p_or_3p_less_the_root():
    # every size even: no padding on 2 ranks, so the formula holds exactly
    rows = launch(scheme_rank, 2, width=16, depth=2, features=8, classes=4, batch=8, steps=1)
    n, root = BlockNet.count(8, 16, 2, 4), (8 + 1) * 16 + (16 + 1) * 4
    moved = {"DDP": 2 * n, "ZeRO-1": 2 * n, "ZeRO-2": 2 * n, "FSDP2": 3 * n - root}
    assert [row["scheme"] for row in rows[0]] == ["DDP", "ZeRO-1", "ZeRO-2", "FSDP2"]
    for row in rows[0]:
        assert row["n_params"] == n
        assert row["held"]["total"] == row["formula"] == zero_memory(n, 2, ["DDP", "ZeRO-1", "ZeRO-2",
                                                                               "FSDP2"].index(row["scheme"]))
        assert sum(2 * v if k == "all_reduce" else v for k, v in row["moved"].items()) == moved[row["scheme"]], row
        assert row["peak"] > 0 and row["step_s"] > 0


class _OwnerAdam(torch.optim.Optimizer):
    """A ZeRO-1 optimizer for the test: rank ``i % world`` owns parameter i, steps it with Adam, broadcasts it."""

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})
        every = [p for g in self.param_groups for p in g["params"]]
        self.owner = {p: i % dist.get_world_size() for i, p in enumerate(every)}
        self.adam = torch.optim.Adam([p for p in every if self.owner[p] == dist.get_rank()], lr=lr)
        self.state = self.adam.state

    def step(self, closure=None):
        self.adam.step()
        with torch.no_grad():
            for p, owner in self.owner.items():
                dist.broadcast(p, src=owner)


def test_the_zero1_row_runs_the_optimizer_given_after_ddp_s_all_reduce():
    rows = launch(scheme_rank, 2, width=16, depth=2, features=8, classes=4, batch=8, steps=1, schemes=("ZeRO-1",),
                  zero1=_OwnerAdam)
    n = BlockNet.count(8, 16, 2, 4)
    for rank_rows in rows:
        (row,) = rank_rows
        assert row["moved"] == {"all_reduce": n, "broadcast": n}, row["moved"]  # DDP's 2P, then P shared: 3P
        assert row["held"]["params"] == row["held"]["grads"] == 4 * n
        assert 0 < row["held"]["optimizer"] < 8 * n  # Adam's state for the owned parameters only


# -- DCP: saved by 4 ranks, loaded by 2 --------------------------------------------------------
def _save(path):
    model = shard_model(BlockNet(features=6, width=10, depth=2), make_mesh())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    train_steps(model, optimizer, *batch(8, 6), 2)
    distcp.save_checkpoint(model, optimizer, path)
    return distcp.full_state(model, optimizer)


def _load(path):
    model = shard_model(BlockNet(features=6, width=10, depth=2, seed=9), make_mesh())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    distcp.load_checkpoint(model, optimizer, path)
    state = distcp.full_state(model, optimizer)
    try:
        distcp.load_checkpoint(model, optimizer, os.path.dirname(path))
    except FileNotFoundError as err:
        state["error"] = str(err)
    return state


def test_a_checkpoint_of_4_ranks_loads_into_2_with_every_tensor_and_exports_one_file(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = launch(_save, 4, path)[0]
    found = distcp.layout(path)
    assert sorted(found["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp"]
    weight = found["tensors"]["model.inp.weight"]
    assert weight["shape"] == [10, 6] and weight["chunks"] == 4 and len(weight["files"]) == 4  # rows 3, 3, 3, 1
    assert found["tensors"]["optim.state.head.weight.exp_avg"]["shape"] == [3, 10]

    loaded = launch(_load, 2, path)[0]
    assert "holds no DCP checkpoint (no .metadata file)" in loaded.pop("error")
    assert sorted(loaded) == sorted(saved) and any(k.endswith(".step") for k in saved)
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)

    consolidated = distcp.export_consolidated(path, str(tmp_path / "model.pt"))
    plain = BlockNet(features=6, width=10, depth=2, seed=3)
    plain.load_state_dict(consolidated["model"])
    assert all(torch.equal(p, saved[f"model.{k}"]) for k, p in plain.state_dict().items())


@pytest.mark.gpu
@pytest.mark.skipif(GPUS < 2, reason=f"needs 2 CUDA GPUs (NCCL, one per rank); {GPUS} visible")
def test_on_gpus_the_mesh_is_cuda_and_training_still_equals_one_process():
    def on_gpus():
        mesh = make_mesh()
        model = shard_model(BlockNet(features=5, width=7, depth=3), mesh)
        x, y = batch(8, 5)
        train_steps(model, torch.optim.SGD(model.parameters(), lr=0.5), x, y, 3)
        return mesh.device_type, dist.get_backend(), full_params(model)

    ranks = launch(on_gpus, 2)
    x, y = batch(8, 5)
    ref = reference_steps(BlockNet(features=5, width=7, depth=3), x, y, 3, 0.5)
    assert ranks[0][:2] == ("cuda", "nccl")
    assert max((ranks[0][2][k] - v).abs().max().item() for k, v in ref.items()) < 1e-4

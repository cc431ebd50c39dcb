"""mgpu_lab.tensor_parallel.measure: saved activations per module, bytes per mesh dimension, the table."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from mgpu_lab import launch
from mgpu_lab.tensor_parallel import measure
from mgpu_lab.tensor_parallel.block import Block
from mgpu_lab.tensor_parallel.plans import block_plan, shard_2d
from mutation import solution_cell

pytestmark = pytest.mark.timeout(240)


def _solution_tp_bytes():
    """The solution notebook's own ``tp_bytes`` (the library holds no answer to 11.tp_bytes)."""
    namespace: dict = {}
    exec(compile(solution_cell("11_tensor_parallel.ipynb", "def tp_bytes"), "<tp_bytes 11>", "exec"), namespace)
    return namespace["tp_bytes"]


def test_activation_bytes_counts_activations_per_module_and_never_the_weights():
    got = measure.activation_bytes(Block(16, 4, 64), torch.randn(2, 8, 16))
    assert got["norm1"] == got["norm2"] == (2 * 8 * 16 + 2 * 8 * 2) * 4   # input, mean and rstd
    assert got["mlp.fc1"] == 2 * 8 * 16 * 4                                 # its input, not its 16 x 64 weight
    with torch.no_grad():
        assert measure.activation_bytes(Block(), torch.randn(1, 4, 16)) == {}


def _norms_saved(sp: bool):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    block = parallelize_module(copy.deepcopy(Block(16, 4, 64)), mesh, block_plan(Block(), sp))
    x = torch.randn(2, 8, 16)
    return measure.activation_bytes(block, x.chunk(world, dim=1)[rank] if sp else x)


def test_sequence_parallelism_divides_the_norms_saved_activations_by_the_tp_degree():
    plain, sp = launch(_norms_saved, 2, False)[0], launch(_norms_saved, 2, True)[0]
    assert sp["norm1"] * 2 == plain["norm1"] and sp["norm2"] * 2 == plain["norm2"]
    assert sp["mlp.fc1"] == plain["mlp.fc1"]  # what the column-parallel layer keeps is gathered again


def test_bytes_by_dim_files_each_collective_under_the_mesh_dimension_of_its_ranks():
    class Mesh:
        mesh_dim_names = ("dp", "tp")

        def __getitem__(self, name):
            return type("Sub", (), {"mesh": torch.tensor([0, 2] if name == "dp" else [0, 1])})()

    events = [{"op": "all_reduce", "bytes": 8, "ranks": [0, 1]}, {"op": "all_gather", "bytes": 4, "ranks": [0, 2]},
              {"op": "wait", "bytes": 8, "ranks": None}, {"op": "all_reduce", "bytes": 1, "ranks": [0, 1, 2, 3]}]
    assert measure.bytes_by_dim(events, Mesh()) == {"tp": 8, "dp": 4, "other": 1}
    assert measure.bytes_by_dim(events, None) == {"world": 13}


def test_every_scheme_s_step_hands_collectives_exactly_the_formula_s_bytes():
    tp_bytes = _solution_tp_bytes()
    measured, formulas = [], []
    for scheme in measure.SCHEMES:
        run = launch(measure.scheme_step, 4, scheme, block_plan, shard_2d)[0]
        want = measure.formula_bytes(scheme, run["params"], 4, 8, 16, 2, 4, tp_bytes)
        assert run["bytes"] == want, (scheme, run)
        measured.append(run)
        formulas.append(want)
    table = measure.bytes_table(measured, formulas).splitlines()
    assert [line.split()[0] for line in table[1:]] == list(measure.SCHEMES)
    with pytest.raises(ValueError, match="scheme='ZeRO'"):
        measure.formula_bytes("ZeRO", 1, 1, 1, 1, 1, 1, tp_bytes)

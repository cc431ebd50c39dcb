"""mgpu_lab.comm.ring: the reference ring all-reduce (lesson 09's exercise), out of the lesson's imports."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mgpu_lab import launch
from mgpu_lab.comm.record import record
from mgpu_lab.comm import ring

pytestmark = pytest.mark.timeout(120)


def _sums():
    world, rank = dist.get_world_size(), dist.get_rank()
    out = []
    for shape, dtype in (((1,), torch.float32), ((7,), torch.float32), ((3, 5), torch.float64),
                         ((2 * world + 1,), torch.int64)):
        x = (torch.arange(torch.Size(shape).numel()) * (rank + 1)).reshape(shape).to(dtype)
        expected = x.clone()
        dist.all_reduce(expected)
        with record() as log:
            got = ring.all_reduce(x)
        peers = {e["peer"] for e in log.events if e["op"] in ("send", "recv")}
        out.append(bool(torch.equal(got, expected)) and got.shape == x.shape and got.dtype == x.dtype
                   and peers <= {(rank + 1) % world, (rank - 1) % world})
    return out


def test_the_ring_sums_any_shape_dtype_and_size_like_all_reduce_talking_to_its_neighbours_only():
    assert all(all(res) for res in launch(_sums, 4)), "a ring sum differs from dist.all_reduce"


def _single():
    return ring.all_reduce(torch.arange(3.0)).tolist()


def test_one_rank_returns_its_own_tensor():
    assert launch(_single, 1) == [[0.0, 1.0, 2.0]]

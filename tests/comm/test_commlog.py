"""mgpu_lab.comm.commlog: recording a rank's sends, receives and collectives, and spotting a deadlock."""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed import isend as isend_by_name

from mgpu_lab import LaunchError, launch
from mgpu_lab.comm import commlog
from mgpu_lab.comm.commlog import find_deadlock

pytestmark = pytest.mark.timeout(120)


def _state(blocked=None, pending=(), done=False):
    return {"seq": 1, "blocked": blocked, "pending": [list(p) for p in pending], "done": done}


def test_a_ring_of_sends_is_a_deadlock_and_the_verdict_names_every_wait():
    states = [_state(["send", (r + 1) % 3]) for r in range(3)]
    assert find_deadlock(states) == ("rank 0 waits in send to 1, rank 1 waits in send to 2, "
                                     "rank 2 waits in send to 0")
    receives = [_state(["recv", (r - 1) % 2]) for r in range(2)]
    assert "rank 0 waits in recv from 1" in find_deadlock(receives)


def test_a_wait_that_another_rank_can_match_is_no_deadlock():
    # rank 1 blocks in the receive rank 0's send needs: they meet
    assert find_deadlock([_state(["send", 1]), _state(["recv", 0])]) is None
    # rank 1 posted an irecv from 0 earlier and waits elsewhere: rank 0's send completes
    assert find_deadlock([_state(["send", 1]), _state(["send", 0], pending=[("recv", 0)])]) is None
    # a receive from any rank matches a send from anyone
    assert find_deadlock([_state(["send", 1]), _state(["recv", None])]) is None


def test_unknown_or_running_ranks_are_never_called_deadlocked():
    assert find_deadlock([_state(["send", 1]), None]) is None
    assert find_deadlock([_state(["send", 1]), _state()]) is None  # rank 1 is still computing
    assert find_deadlock([_state(done=True), _state(done=True)]) is None  # nobody waits
    # a rank that left can match nothing: its peer's send can never complete
    assert find_deadlock([_state(["send", 1]), _state(done=True)]) == "rank 0 waits in send to 1"


def _recorded_ring_and_collectives():
    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    x, got = torch.arange(5, dtype=torch.float64) + rank, torch.empty(5, dtype=torch.float64)
    originals = (dist.isend, dist.distributed_c10d.isend, dist.all_reduce)

    def named_ring():  # isend imported by name: its global is patched as well
        req = isend_by_name(x, right)
        dist.recv(got, left)
        req.wait()

    with commlog.record(named_ring) as log:
        named_ring()
        dist.all_reduce(torch.ones(3))
        dist.barrier()
        objects = [None] * world
        dist.all_gather_object(objects, rank)  # its inner all_gather is not recorded again
    restored = (dist.isend, dist.distributed_c10d.isend, dist.all_reduce) == originals and \
        named_ring.__globals__["isend_by_name"] is originals[0]
    mismatch = None
    try:
        with commlog.record(expect_device="meta"):
            dist.send(x, right)
    except RuntimeError as err:
        mismatch = str(err)
    return {"events": log.events, "got": got.tolist(), "restored": restored, "mismatch": mismatch}


def test_record_logs_peers_bytes_and_collectives_and_restores_torch():
    results = launch(_recorded_ring_and_collectives, 3)
    for rank, res in enumerate(results):
        ops = [(e["op"], e["peer"], e["bytes"]) for e in res["events"]]
        assert ops == [("isend", (rank + 1) % 3, 40), ("recv", (rank - 1) % 3, 40), ("all_reduce", None, 12),
                       ("barrier", None, 0), ("all_gather_object", None, 0)], ops
        assert res["events"][0]["dtype"] == "torch.float64" and res["events"][0]["device"] == "cpu"
        assert res["got"] == [float(i + (rank - 1) % 3) for i in range(5)]
        assert res["restored"]
        assert "on cpu while the input is on meta" in res["mismatch"] and "device=tensor.device" in res["mismatch"]


def _send_first():
    rank, world = dist.get_rank(), dist.get_world_size()
    with commlog.record():
        dist.send(torch.ones(2), (rank + 1) % world)
        dist.recv(torch.empty(2), (rank - 1) % world)


def test_every_rank_sending_first_raises_a_deadlock_error_at_once_instead_of_hanging():
    start = time.perf_counter()
    with pytest.raises(LaunchError) as info:
        launch(_send_first, 3, timeout=60)
    assert time.perf_counter() - start < 50  # far below the launch timeout: the ranks saw it themselves
    text = str(info.value)
    assert info.value.exc_type == "Deadlock"
    assert "rank 0 waits in send to 1, rank 1 waits in send to 2, rank 2 waits in send to 0" in text
    assert "irecv" in text

"""mgpu_lab.comm.record: a rank's sends, receives and collectives (c10d and functional), and deadlocks."""
from __future__ import annotations

import time
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed import isend as isend_by_name
from torch.torch_version import TorchVersion

from mgpu_lab import LaunchError, launch
from mgpu_lab.comm.record import find_deadlock, record, summarize

pytestmark = pytest.mark.timeout(180)


def _state(blocked=None, pending=(), done=False):
    return {"seq": 1, "blocked": blocked, "pending": [list(p) for p in pending], "done": done}


# -- without ranks ------------------------------------------------------------------------------
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


def _counted(blocked=None, posted=None, pending=(), done=False):
    return {**_state(blocked, pending, done), "posted": dict(posted or {})}


def test_posted_counts_decide_whether_a_wait_can_be_matched_whatever_gloo_lists_as_pending():
    # rank 0 posted 3 sends to rank 1 (never waited for: gloo still lists them) and waits for a gradient;
    # rank 1 waits for a 4th activation: the 3 sends were taken by its first 3 receives
    stale = [_counted(["recv", 1, 1, 0], {"send/1/0": 3, "recv/1/0": 1}, pending=[("send", 1)] * 3),
             _counted(["recv", 0, 4, 0], {"recv/0/0": 4})]
    assert find_deadlock(stale) == "rank 0 waits in recv from 1, rank 1 waits in recv from 0"
    # the same with rank 0's 4th send posted: rank 1's receive is matched, however rank 0 waits
    stale[0]["posted"]["send/1/0"] = 4
    assert find_deadlock(stale) is None
    # a send waits for the 2nd receive: rank 1 has posted one receive from 0 (used), then a 2nd one (not yet)
    send = ["send", 1, 2, 0]
    assert find_deadlock([_counted(send, {"send/1/0": 2}), _counted(["recv", 0, 1, 1], {"recv/0/0": 1})]) \
        == "rank 0 waits in send to 1, rank 1 waits in recv from 0"
    assert find_deadlock([_counted(send, {"send/1/0": 2}), _counted(["send", 0, 1, 0], {"recv/0/0": 2})]) is None
    # a receive from any rank may take the send
    assert find_deadlock([_counted(send, {"send/1/0": 2}), _counted(["send", 0, 1, 0], {"recv/0/0": 1,
                                                                                       "recv/any/0": 1})]) is None
    # tags: a receive with tag 7 is not matched by sends with tag 0
    tagged = [_counted(["recv", 1, 1, 0], {"send/1/0": 1}), _counted(["recv", 0, 1, 7], {"recv/0/7": 1})]
    assert find_deadlock(tagged) == "rank 0 waits in recv from 1, rank 1 waits in recv from 0"
    tagged[0]["posted"]["send/1/7"] = 1
    assert find_deadlock(tagged) is None


def test_summarize_counts_calls_or_elements_or_bytes_per_op_and_refuses_other_measures():
    log = [{"op": "all_gather", "numel": 8, "bytes": 32}, {"op": "all_gather", "numel": 8, "bytes": 32},
           {"op": "wait", "numel": 8, "bytes": 32}]
    assert summarize(log) == {"all_gather": 2, "wait": 1}
    assert summarize(log, "bytes") == {"all_gather": 64, "wait": 32} and summarize(log, "numel")["all_gather"] == 16
    with pytest.raises(ValueError, match="what='time'"):
        summarize(log, "time")


def test_record_outside_a_process_group_says_how_to_get_one():
    assert not dist.is_initialized()
    before = dist.all_reduce
    with pytest.raises(RuntimeError, match=r"not initialised.*mgpu_lab\.launch"):
        with record():
            pass
    assert dist.all_reduce is before


# -- c10d and functional collectives, in 3 ranks -------------------------------------------------
def _p2p_and_c10d(rank, world):
    right, left = (rank + 1) % world, (rank - 1) % world
    x, got = torch.arange(5, dtype=torch.float64) + rank, torch.empty(5, dtype=torch.float64)

    def named_ring():  # isend imported by name: its global is patched as well
        req = isend_by_name(x, right)
        dist.recv(got, left)
        req.wait()

    original = dist.isend
    with record(named_ring) as log:
        patched = named_ring.__globals__["isend_by_name"] is dist.isend and dist.isend is not original
        named_ring()
        dist.all_reduce(torch.ones(3))
        dist.barrier()
        objects = [None] * world
        dist.all_gather_object(objects, rank)  # its inner all_gather is not recorded again
        dist.gather(torch.ones(2), [torch.empty(2) for _ in range(world)] if rank == 0 else None, dst=0)
    return {"events": log.events, "got": got.tolist(), "patched_inside": patched}


def _aliases_and_inputs(world):
    out = {}
    with record(keep_inputs=True) as log, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist.all_gather_into_tensor(torch.empty(3 * world), torch.ones(3))  # deprecated: calls all_gather_single
        shard = torch.empty(2)
        dist.reduce_scatter_single(shard, torch.arange(2.0 * world))
    out["alias_log"] = [(e["op"], e["call"], e["numel"], e["input"].tolist()) for e in log]
    out["alias_warned"] = any(issubclass(w.category, FutureWarning) for w in caught)
    with record() as outer:
        dist.all_reduce(torch.ones(1))
        with record() as inner:
            dist.broadcast(torch.ones(2), src=0)
        dist.all_reduce(torch.ones(3))
    out["nested"] = ([(e["op"], e["numel"]) for e in outer], [(e["op"], e["numel"]) for e in inner])
    return out


def _functional():
    import torch.distributed._functional_collectives as funcol

    with record() as log:
        reduced = funcol.all_reduce(torch.ones(4), "sum", dist.group.WORLD)
        total = reduced + 0  # first use: waits for the result
        gathered = funcol.all_gather_tensor(torch.ones(3, dtype=torch.float64), 0, dist.group.WORLD).wait()
    return {"events": [(e["op"], e["call"], e["api"], e["numel"], e["bytes"]) for e in log],
            "values": (total.tolist(), gathered.tolist())}


def _in_3_ranks():
    rank, world = dist.get_rank(), dist.get_world_size()
    originals = (dist.isend, dist.distributed_c10d.isend, dist.all_reduce, dist.all_gather_single)
    out = _p2p_and_c10d(rank, world)
    out.update(_aliases_and_inputs(world))
    out["functional"] = _functional()
    out["restored"] = (dist.isend, dist.distributed_c10d.isend, dist.all_reduce, dist.all_gather_single) == originals
    out["mismatch"] = None
    try:
        with record(expect_device="meta"):
            dist.send(torch.ones(2), (rank + 1) % world)
    except RuntimeError as err:
        out["mismatch"] = str(err)
    return out


@pytest.fixture(scope="module")
def three():
    return launch(_in_3_ranks, 3)


def test_record_logs_sends_receives_and_collectives_with_peers_and_bytes_in_order(three):
    for rank, res in enumerate(three):
        got = [(e["op"], e["call"], e["api"], e["peer"], e["numel"], e["bytes"]) for e in res["events"]]
        assert got == [("send", "isend", "c10d", (rank + 1) % 3, 5, 40),
                       ("recv", "recv", "c10d", (rank - 1) % 3, 5, 40),
                       ("all_reduce", "all_reduce", "c10d", None, 3, 12), ("barrier", "barrier", "c10d", None, 0, 0),
                       ("all_gather_object", "all_gather_object", "c10d", None, 0, 0),
                       ("gather", "gather", "c10d", None, 6, 24)], got  # gather: 2 elements from each of 3 ranks
        assert res["events"][0]["dtype"] == "torch.float64" and res["events"][0]["device"] == "cpu"
        assert res["got"] == [float(i + (rank - 1) % 3) for i in range(5)]


def test_record_restores_torch_and_the_globals_it_patched(three):
    for res in three:
        assert res["patched_inside"] and res["restored"]


def test_a_send_of_a_tensor_on_another_device_than_expected_is_an_error_naming_the_fix(three):
    for res in three:
        assert "on cpu while the input is on meta" in res["mismatch"] and "device=tensor.device" in res["mismatch"]


def test_a_deprecated_alias_is_recorded_once_under_its_own_name_and_keep_inputs_keeps_the_input(three):
    for rank, res in enumerate(three):
        assert res["alias_log"] == [("all_gather", "all_gather_into_tensor", 9, [1.0, 1.0, 1.0]),
                                    ("reduce_scatter", "reduce_scatter_single", 6, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0])]
    # torch 2.14 deprecates all_gather_into_tensor (in favour of all_gather_single, torch 2.13); 2.11 does not warn
    assert three[0]["alias_warned"] == (TorchVersion(torch.__version__) >= "2.14")


def test_nested_recordings_both_see_what_the_inner_one_encloses(three):
    outer, inner = three[0]["nested"]
    assert outer == [("all_reduce", 1), ("broadcast", 2), ("all_reduce", 3)]
    assert inner == [("broadcast", 2)]


def test_a_functional_collective_is_recorded_once_with_its_wait(three):
    for res in three:
        assert res["functional"]["events"] == [
            ("all_reduce", "all_reduce", "functional", 4, 16), ("wait", "wait_tensor", "functional", 4, 16),
            ("all_gather", "all_gather_into_tensor", "functional", 9, 72),  # the whole output: 3 ranks x 3 float64
            ("wait", "wait_tensor", "functional", 9, 72)]
        assert res["functional"]["values"] == ([3.0] * 4, [1.0] * 9)


# -- DTensor and FSDP2, in 2 ranks ------------------------------------------------------------
def _dtensor_and_fsdp2():
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    sharded = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])
    partial = DTensor.from_local(torch.ones(4), mesh, [Partial()])
    with record() as log:
        gathered = sharded.redistribute(mesh, [Replicate()]).to_local()
        reduced = partial.redistribute(mesh, [Shard(0)]).to_local()
        doubled = (sharded * 2).full_tensor()  # DTensor's own operator, then a redistribute
    out = {"dtensor": [(e["op"], e["api"], e["numel"]) for e in log if e["op"] != "wait"],
           "waits": sum(e["op"] == "wait" for e in log),
           "values": (gathered.tolist(), reduced.tolist(), doubled.tolist())}
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    for module in (model[0], model[2], model):
        fully_shard(module, mesh=mesh)
    with record() as log:
        model(torch.ones(3, 4)).sum().backward()
    out["fsdp2"] = [(e["op"], e["api"], e["numel"]) for e in log]
    return out


@pytest.fixture(scope="module")
def two():
    return launch(_dtensor_and_fsdp2, 2)


def test_a_dtensor_redistribute_shows_as_functional_collectives(two):
    for res in two:
        assert res["dtensor"] == [("all_gather", "functional", 8), ("reduce_scatter", "functional", 4),
                                  ("all_gather", "functional", 8)]
        assert res["waits"] == 3
    assert [res["values"][1] for res in two] == [[2.0, 2.0], [2.0, 2.0]]
    assert two[0]["values"][0] == [float(i) for i in range(8)] and two[0]["values"][2] == [2.0 * i for i in range(8)]


def test_an_fsdp2_step_shows_its_all_gathers_and_reduce_scatters(two):
    first, last = 6 * 4 + 6, 2 * 6 + 2  # Linear(4, 6) and Linear(6, 2): weights and biases, rows padded to 2
    for res in two:
        assert res["fsdp2"] == [("all_gather", "c10d", first), ("all_gather", "c10d", last),  # forward
                                ("all_gather", "c10d", last), ("all_gather", "c10d", first),  # again, backward
                                ("reduce_scatter", "c10d", last), ("reduce_scatter", "c10d", first)]


# -- deadlocks ---------------------------------------------------------------------------------
def _send_first():
    rank, world = dist.get_rank(), dist.get_world_size()
    with record():
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


def _one_receive_too_many(extra: int, tag_sends: bool):
    """Rank 0 posts 3 activations with isend (waited for only at the end), then waits for a gradient; rank 1
    receives 3 + ``extra`` activations, then sends the gradient. With tags, rank 1 takes them in reverse."""
    rank = dist.get_rank()
    with record():
        if rank == 0:
            tags = [10 + m if tag_sends else 0 for m in range(3)]
            sends = [dist.isend(torch.full((2,), float(m)), 1, tag=tag) for m, tag in enumerate(tags)]
            grad = torch.empty(2)
            dist.recv(grad, 1)
            for work in sends:
                work.wait()
            return grad.tolist()
        got = []
        for m in reversed(range(3 + extra)) if tag_sends else range(3 + extra):
            h = torch.empty(2)
            dist.recv(h, 0, tag=10 + m if tag_sends else 0)
            got.append(h[0].item())
        dist.send(torch.full((2,), sum(got)), 0)
        return got


def test_a_receive_no_rank_will_send_is_a_deadlock_at_once_though_gloo_lists_the_sends_taken_as_pending():
    # gloo reports an isend as completed only once it is waited for: the 3 sends rank 1 took stay "pending"
    # in rank 0's list, and a finder that trusted that list waited for the launch's timeout
    start = time.perf_counter()
    with pytest.raises(LaunchError) as info:
        launch(_one_receive_too_many, 2, 1, False, timeout=60)
    assert info.value.exc_type == "Deadlock", str(info.value)
    assert time.perf_counter() - start < 30
    assert "rank 0 waits in recv from 1, rank 1 waits in recv from 0" in str(info.value)
    # the same exchange with every activation received: no deadlock, also with tags taken out of order
    assert launch(_one_receive_too_many, 2, 0, False, timeout=60) == [[3.0, 3.0], [0.0, 1.0, 2.0]]
    assert launch(_one_receive_too_many, 2, 0, True, timeout=60) == [[3.0, 3.0], [2.0, 1.0, 0.0]]


# -- which group a collective used ------------------------------------------------------------
def _on_a_2d_mesh():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with record() as log:
        dist.all_reduce(torch.ones(2))                                   # the default group
        dist.all_reduce(torch.ones(2), group=mesh["dp"].get_group())     # c10d, one mesh dimension
        partial = DTensor.from_local(torch.ones(3), mesh["tp"], [Partial()])
        partial.redistribute(mesh["tp"], [Replicate()]).to_local()      # functional, over "tp"
    return [(e["op"], e["api"], e["ranks"]) for e in log]


def test_every_event_names_the_global_ranks_of_its_group_c10d_and_functional():
    got = launch(_on_a_2d_mesh, 4)
    assert got[0] == [("all_reduce", "c10d", [0, 1, 2, 3]), ("all_reduce", "c10d", [0, 2]),
                      ("all_reduce", "functional", [0, 1]), ("wait", "functional", None)]
    assert got[3][1:3] == [("all_reduce", "c10d", [1, 3]), ("all_reduce", "functional", [2, 3])]

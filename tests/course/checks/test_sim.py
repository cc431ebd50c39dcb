"""The checks' simulation layer (``mgpu_lab.course.checks.sim``), in this process.

Placed tensors, modules, parameters and losses (``sim.devices``), the simulated
``torch.cuda`` (``sim.cuda``), DataParallel's pieces and DDP over it
(``sim.parallel``), and a call's outcome (``sim.outcome``). The lessons' checks
that rely on them are tested with real answers in ``test_checks_NN.py`` and
``tests/mutants/``.
"""
from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from mgpu_lab.course.checks.sim.cuda import simulated_gpus
from mgpu_lab.course.checks.sim.devices import (parse_move, place, Placed, PlacedLoss, PlacedModule, plain, reset,
                                                UNTAGGED, where)
from mgpu_lab.course.checks.sim.outcome import CUT, in_words, outcome, outcomes
from mgpu_lab.course.checks.sim.parallel import virtual_ddp

CUDA = torch.device("cuda")


def stub(*args, **kwargs):
    raise NotImplementedError("write this function")


# -- the one parser of .to/.cuda/.cpu --------------------------------------------------------
@pytest.mark.parametrize("method, args, kwargs, expected", [
    ("to", ("cuda:1",), {}, (torch.device("cuda", 1), None)),
    ("to", (torch.device("cuda", 2), torch.float64), {"non_blocking": True}, (torch.device("cuda", 2), torch.float64)),
    ("to", (), {"device": "cuda", "dtype": torch.float16}, (CUDA, torch.float16)),
    ("to", (torch.float64,), {}, (None, torch.float64)),
    ("to", ("cpu",), {"copy": True}, (torch.device("cpu"), None)),
    ("cuda", (), {}, (CUDA, None)),
    ("cuda", (3,), {}, (torch.device("cuda", 3), None)),
    ("cuda", (), {"device": "cuda:1"}, (torch.device("cuda", 1), None)),
    ("cpu", (), {}, (torch.device("cpu"), None)),
])
def test_parse_move_reads_every_form_of_a_move(method, args, kwargs, expected):
    assert parse_move(method, *args, **kwargs) == expected


def test_parse_move_of_to_another_tensor_asks_for_where_that_tensor_would_be():
    other = place(torch.zeros(1, dtype=torch.float64), "labels", "cuda:3")
    assert parse_move("to", other) == (torch.device("cuda", 3), torch.float64)


# -- tracked placed tensors --------------------------------------------------------------
def test_placed_tensors_move_by_name_and_record_a_mix_of_devices():
    """Data stays on the CPU, .device says where, autograd goes through, a mix of devices is recorded."""
    x = torch.randn(4, 2, requires_grad=True)
    reset()
    a, b = place(x, "batch").chunk(2)
    a1, b1 = a.to(torch.device("cuda", 1)), b.cuda()
    assert (a1.device, b1.device, plain(a1).device.type) == (torch.device("cuda", 1), torch.device("cuda", 0), "cpu")
    plain(torch.cat([a1, b1])).sum().backward()
    assert Placed.moves == [("batch", "cpu", "cuda:1"), ("batch", "cpu", "cuda")]
    assert Placed.mixes == [("cat", ["cuda:1", "cuda:0"])]
    assert torch.equal(x.grad, torch.ones(4, 2))


def test_placed_tensors_keep_their_device_through_chunks_and_arithmetic_and_log_every_move():
    reset()
    x = place(torch.arange(8.0).reshape(4, 2), "inputs", "cpu")
    parts = torch.chunk(x, 2)
    assert [p.device for p in parts] == [torch.device("cpu")] * 2 and parts[0].tag == "inputs"
    moved = parts[1].to("cuda:3", non_blocking=True)
    assert moved.device == torch.device("cuda", 3) and (moved * 2 + 1).device == torch.device("cuda", 3)
    assert x.cuda().device == torch.device("cuda", 0) and x.to(moved).device == torch.device("cuda", 3)
    assert Placed.moves == [("inputs", "cpu", "cuda:3"), ("inputs", "cpu", "cuda"), ("inputs", "cpu", "cuda:3")]
    assert torch.equal(plain(moved), torch.tensor([[4.0, 5.0], [6.0, 7.0]]))
    assert where(torch.ones(1)) == torch.device("cpu") and x.log().device == torch.device("cpu")


def test_a_dtype_only_to_is_no_move_but_changes_the_dtype():
    reset()
    x = place(torch.ones(2), "inputs", "cuda:1")
    y = x.to(torch.float64)
    assert Placed.moves == [] and y.dtype == torch.float64 and y.device == torch.device("cuda", 1)


# -- untracked placed tensors ------------------------------------------------------------
def test_untracked_tensors_log_their_moves_and_give_plain_tensors():
    reset()
    x = place(torch.ones(3), "inputs", tracked=False)
    moved, cpu, doubled = x.to("cuda:1", non_blocking=True), x.cpu(), x * 2
    assert [type(t) for t in (moved, cpu, doubled)] == [torch.Tensor] * 3
    assert moved.device.type == "cpu" and torch.equal(moved, torch.ones(3))  # the data stays here
    assert Placed.moves == [("inputs", "cpu", "cuda:1"), ("inputs", "cpu", "cpu")]


def test_a_dataloader_stacks_untracked_samples_into_batches_that_are_logged_and_keep_their_tag():
    data = [(place(torch.full((2,), float(i)), "inputs", tracked=False), place(torch.tensor(i), "labels",
                                                                              tracked=False)) for i in range(5)]
    reset()
    batches = list(torch.utils.data.DataLoader(data, batch_size=2))
    assert Placed.batches == ["inputs", "labels"] * 3
    x, y = batches[0]
    assert (type(x), x.tag, y.tag) == (Placed, "inputs", "labels") and type(x.to("cuda:0")) is torch.Tensor


# -- placed modules and losses -----------------------------------------------------------
def test_a_module_is_placed_by_to_reports_it_in_its_parameters_and_records_its_inputs():
    reset()
    stage = PlacedModule(nn.Linear(2, 3), name="stage1", out_tag="activations", virtual_parameters=True)
    assert stage.to(torch.device("cuda", 2)) is stage and next(stage.parameters()).device == torch.device("cuda", 2)
    assert next(copy.deepcopy(stage).parameters()).device == torch.device("cuda", 2)
    out = stage(place(torch.ones(5, 2), "inputs", "cpu"))
    assert out.device == torch.device("cuda", 2) and out.tag == "activations"
    assert Placed.moves == [("stage1", "cpu", "cuda:2")]
    assert PlacedModule.inputs == [(stage, "inputs", "cpu", "cuda:2", 5)]
    loss = PlacedLoss(nn.CrossEntropyLoss())(out, place(torch.tensor([0, 1, 2, 0, 1]), "labels", "cpu"))
    assert PlacedLoss.calls == [("cuda:2", "cpu", "labels")] and loss.device == torch.device("cuda", 2)
    loss.backward()
    assert stage[0].weight.grad is not None and stage[0].weight.grad.shape == (3, 2)


def test_a_plain_module_keeps_its_layers_keys_and_cpu_parameters_and_gives_plain_outputs():
    torch.manual_seed(0)
    plain_net = nn.Sequential(nn.Linear(2, 3), nn.Tanh())
    torch.manual_seed(0)
    net = PlacedModule(nn.Linear(2, 3), nn.Tanh(), name="model")
    reset()
    assert net.cuda(1) is net and net.cpu() is net and net.to(torch.float64) is net
    assert Placed.moves == [("model", "cpu", "cuda:1"), ("model", "cuda:1", "cpu")]
    assert list(net.state_dict()) == list(plain_net.state_dict()) and next(net.parameters()).dtype == torch.float64
    assert next(net.parameters()).device.type == "cpu"
    out = net(torch.ones(4, 2, dtype=torch.float64))
    assert type(out) is torch.Tensor and PlacedModule.inputs[-1][1:] == (UNTAGGED, "cpu", "cpu", 4)
    net.put_on("cuda:2")
    assert net.vdev == torch.device("cuda", 2) and len(Placed.moves) == 2  # the check's own placing is no move


def test_a_loss_of_plain_outputs_is_plain_and_records_the_labels_tag():
    reset()
    loss = PlacedLoss(nn.MSELoss())(torch.zeros(2), place(torch.ones(2), "labels", tracked=False))
    assert type(loss) is torch.Tensor and PlacedLoss.calls == [("cpu", "cpu", "labels")]


# -- the simulated torch.cuda --------------------------------------------------------------
CUDA_NAMES = ("is_available", "device_count", "current_device", "set_device", "device", "synchronize")


def test_simulated_gpus_name_the_gpus_log_set_device_and_put_everything_back():
    before = {name: getattr(torch.cuda, name) for name in CUDA_NAMES}
    device_before = os.environ.get("MGPU_LAB_DEVICE")
    reset()
    with simulated_gpus(4, local_rank=2):
        assert (torch.cuda.is_available(), torch.cuda.device_count(), torch.cuda.current_device()) == (True, 4, 0)
        torch.cuda.set_device(torch.device("cuda", 3))
        with torch.cuda.device(1):
            torch.cuda.synchronize()
        assert torch.cuda.current_device() == 3 and os.environ["MGPU_LAB_DEVICE"] == "cuda:2"
    assert Placed.moves == [("set_device", "cuda:0", "cuda:3")]
    assert {name: getattr(torch.cuda, name) for name in CUDA_NAMES} == before
    assert os.environ.get("MGPU_LAB_DEVICE") == device_before


def test_no_simulated_gpu_is_no_gpu():
    with simulated_gpus(0):
        assert (torch.cuda.is_available(), torch.cuda.device_count()) == (False, 0)


# -- DDP over the simulated GPUs ----------------------------------------------------------
def test_virtual_ddp_logs_the_device_ids_and_wraps_the_cpu_module_without_them():
    from torch.nn.parallel import DistributedDataParallel as DDP

    init_before = DDP.__init__
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        reset()
        with simulated_gpus(2, local_rank=1), virtual_ddp():
            ddp = DDP(PlacedModule(nn.Linear(2, 2), name="model").to("cuda:1"), device_ids=[1])
            DDP(nn.Linear(2, 2))
            assert ddp.device_ids is None and ddp(torch.ones(3, 2)).shape == (3, 2)
    finally:
        dist.destroy_process_group()
    assert Placed.moves == [("model", "cpu", "cuda:1"), ("DDP device_ids", "", "cuda:1"),
                            ("DDP device_ids", "", "None")]
    assert DDP.__init__ is init_before


# -- a call's outcome --------------------------------------------------------------------
def test_outcome_cuts_the_message_and_lets_not_implemented_through():
    def long_error():
        raise ValueError("x" * 1000)

    assert outcome(lambda a, b=0: a + b, 1, b=2) == ("ok", 3)
    assert outcome(long_error) == ("raised", "ValueError", "x" * CUT)
    with pytest.raises(NotImplementedError):
        outcome(stub)
    with pytest.raises(NotImplementedError):
        outcomes(stub, [()])


def test_outcomes_keep_what_travels_and_an_error_of_keep_is_the_calls_outcome():
    assert outcomes(lambda n: range(n), [(2,), (-1,)], keep=list) == [("ok", [0, 1]), ("ok", [])]
    assert outcomes(lambda v: v, [([1, 2],), ("ab",)], keep=lambda v: [int(i) for i in v]) == [
        ("ok", [1, 2]), ("raised", "ValueError", "invalid literal for int() with base 10: 'a'")]


def test_in_words():
    said = ("raised", "ValueError", "n=0")
    assert (in_words(said), in_words(said, raised=""), in_words(("ok", [1]))) == (
        "raised ValueError: n=0", "ValueError: n=0", "returned [1]")

"""mgpu_lab.parallel.ddp in real ranks: DDP equals one process, no_sync, exact evaluation, checkpoints."""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from mgpu_lab import launch
from mgpu_lab.data import datasets
from mgpu_lab.parallel import ddp
from mgpu_lab import dist as mdist

pytestmark = pytest.mark.timeout(240)
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none is visible")

DATA = datasets.synthetic_classification(96, seed=0)


def model_fn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))


def test_two_and_three_ranks_end_with_the_single_process_weights():
    ref = ddp.reference_train(model_fn, DATA, 2, 12, 0.2)
    two = launch(ddp.train, 2, model_fn, DATA, 2, 6, 0.2)
    three = launch(ddp.train, 3, model_fn, DATA, 2, 4, 0.2)
    assert ddp.max_diff(two[0], ref) < 1e-6 and ddp.max_diff(three[0], ref) < 1e-6
    assert ddp.max_diff(two[0], two[1]) == 0 and ddp.max_diff(three[0], three[2]) == 0
    assert not any(k.startswith("module.") for k in two[0])


def test_forgetting_set_epoch_changes_the_result():
    ref = ddp.reference_train(model_fn, DATA, 2, 12, 0.2)
    bug = launch(ddp.train, 2, model_fn, DATA, 2, 6, 0.2, set_epoch=False)
    assert ddp.max_diff(bug[0], ref) > 1e-4
    assert ddp.max_diff(bug[0], ddp.reference_train(model_fn, DATA, 2, 12, 0.2, set_epoch=False)) < 1e-6


def _accumulate(accumulate, no_sync):
    model = ddp.wrap(model_fn())
    loader, _ = ddp.distributed_loader(DATA, 12 // accumulate)
    stats = ddp.fit(model, loader, torch.optim.SGD(model.parameters(), lr=0.2), 1, accumulate=accumulate,
                    no_sync=no_sync)
    return ddp.cpu_state(model), stats["steps"], stats["allreduces"]


def test_no_sync_accumulation_all_reduces_once_per_step_with_the_same_weights():
    ref = ddp.reference_train(model_fn, DATA, 1, 24, 0.2)
    plain, synced, skipped = (launch(_accumulate, 2, a, ns)[0] for a, ns in ((1, True), (3, False), (3, True)))
    assert [r[1] for r in (plain, synced, skipped)] == [4, 4, 4]          # optimizer steps
    assert [r[2] for r in (plain, synced, skipped)] == [4, 12, 4]         # all-reduce calls (1 bucket)
    assert all(ddp.max_diff(r[0], ref) < 1e-6 for r in (plain, synced, skipped))


def test_fit_validates_and_runs_autocast_on_the_cpu():
    model = model_fn()
    loader, _ = ddp.distributed_loader(DATA, 32, num_replicas=1, rank=0)
    with pytest.raises(ValueError, match="accumulate=0 must be >= 1"):
        ddp.fit(model, loader, torch.optim.SGD(model.parameters(), lr=0.1), 1, accumulate=0)
    stats = ddp.fit(model, loader, torch.optim.SGD(model.parameters(), lr=0.1), 1, amp=True)
    assert stats["steps"] == 3 and stats["allreduces"] is None
    assert torch.isfinite(torch.tensor(stats["losses"])).all()


def test_autocast_dtype_is_bfloat16_where_the_hardware_has_it_else_float16(monkeypatch):
    assert ddp.autocast_dtype(torch.device("cpu")) == torch.bfloat16
    for capability, dtype in (((7, 0), torch.float16), ((7, 5), torch.float16), ((8, 0), torch.bfloat16),
                              ((9, 0), torch.bfloat16)):  # V100, T4, A100, H100
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert ddp.autocast_dtype(torch.device("cuda", 0)) == dtype, capability


def test_distributed_loader_refuses_a_second_sampler_or_shuffle():
    with pytest.raises(ValueError, match="not sampler= or a DataLoader shuffle=True"):
        ddp.distributed_loader(DATA, 8, shuffle=True, num_replicas=1, rank=0, sampler=None)
    loader, sampler = ddp.distributed_loader(DATA, 8, num_replicas=4, rank=1)
    assert len(sampler) == 24 and len(loader) == 3 and loader.batch_size == 8


def test_max_diff_names_missing_keys():
    with pytest.raises(ValueError, match=r"only in the first \['module.w'\].*unwrap DDP"):
        ddp.max_diff({"module.w": torch.ones(1)}, {"w": torch.ones(1)})


def _evaluate(state, val):
    model = model_fn()
    model.load_state_dict(state)
    return {how: ddp.evaluate(model, val, how=how) for how in ("exact", "padded", "drop_last")}


def test_exact_evaluation_matches_one_process_and_the_shortcuts_do_not():
    state = ddp.reference_train(model_fn, DATA, 1, 12, 0.2)
    val = datasets.synthetic_classification(10, seed=3)
    model = model_fn()
    model.load_state_dict(state)
    truth = ddp.evaluate(model, val)
    got = launch(_evaluate, 4, state, val)
    shared = [{how: {k: v for k, v in r.items() if k != "local"} for how, r in g.items()} for g in got]
    assert all(s == shared[0] for s in shared[1:])  # every rank gets the same numbers
    assert [g["exact"]["local"] for g in got] == [3, 3, 2, 2]
    got = got[0]
    assert got["exact"]["counted"] == 10 and got["padded"]["counted"] == 12 and got["drop_last"]["counted"] == 8
    assert got["exact"]["accuracy"] == pytest.approx(truth["accuracy"])
    assert got["exact"]["loss"] == pytest.approx(truth["loss"], rel=1e-6)
    assert got["padded"]["loss"] != pytest.approx(truth["loss"], rel=1e-3)
    with pytest.raises(ValueError, match="how='sum'"):
        ddp.evaluate(model, val, how="sum")


def _mean_over_ranks(sums, counts):
    r = mdist.rank()
    return ddp.mean_over_ranks(sums[r], counts[r])


def test_mean_over_ranks_weighs_every_sample_the_same():
    assert launch(_mean_over_ranks, 3, [9.0, 3.0, 4.0], [1, 3, 8]) == [pytest.approx(16 / 12)] * 3
    assert ddp.mean_over_ranks(6.0, 3) == 2.0  # no process group: this process's mean


def _checkpoint(path, epochs, resume):
    model = ddp.wrap(model_fn())
    loader, _ = ddp.distributed_loader(DATA, 6)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    start = ddp.load_checkpoint(path, model, optimizer)["epoch"] + 1 if resume else 0
    ddp.fit(model, loader, optimizer, epochs, start_epoch=start,
            on_epoch_end=lambda e: ddp.save_checkpoint(path, model, optimizer, e, note="x"))
    return ddp.cpu_state(model), sorted(os.listdir(os.path.dirname(path)))


def test_checkpoints_resume_exactly_where_an_uninterrupted_run_ends(tmp_path):
    straight = launch(_checkpoint, 2, str(tmp_path / "a" / "last.pt"), 3, False)
    launch(_checkpoint, 2, str(tmp_path / "b" / "last.pt"), 2, False)
    resumed = launch(_checkpoint, 2, str(tmp_path / "b" / "last.pt"), 3, True)
    assert ddp.max_diff(straight[0][0], resumed[0][0]) == 0
    assert resumed[0][1] == ["last.pt"]  # no temporary file left behind
    state = torch.load(tmp_path / "b" / "last.pt", weights_only=True)
    assert state["epoch"] == 2 and state["note"] == "x" and "momentum_buffer" in str(state["optimizer"])
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        ddp.load_checkpoint(tmp_path / "none.pt", model_fn())


def _wrapped_on_gpu():
    model = ddp.wrap(model_fn())
    stats = ddp.fit(model, ddp.distributed_loader(DATA, 6)[0], torch.optim.SGD(model.parameters(), lr=0.1), 1, amp=True)
    return (model.device_ids, str(next(model.parameters()).device), stats["steps"],
            ddp.autocast_dtype(torch.device("cuda", 0)), all(torch.isfinite(torch.tensor(stats["losses"]))))


@needs_gpu
def test_on_a_gpu_ddp_gets_device_ids_and_amp_trains_in_the_gpus_dtype():
    device_ids, device, steps, dtype, finite = launch(_wrapped_on_gpu, 1)[0]
    assert device_ids == [0] and device == "cuda:0" and steps == 8 and finite
    assert dtype == (torch.bfloat16 if torch.cuda.get_device_capability(0) >= (8, 0) else torch.float16)

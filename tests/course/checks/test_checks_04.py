"""Lesson 04's checkers against the solutions, a stub, and the wrong answers they exist for."""
from __future__ import annotations

import math
import os
import time

import pytest
import torch

from mgpu_lab.course.checks import check, exercises

pytestmark = pytest.mark.timeout(300)


def _failed(result) -> list[str]:
    return [c.name for c in result.cases if not c.passed]


def _stub(*args, **kwargs):
    raise NotImplementedError("write this")


def test_lesson_04_registers_its_four_exercises_with_one_point_per_case():
    got = {e.id: e.points for e in exercises("04")}
    assert got == {"04.ddp_train": 5, "04.download_once": 4, "04.global_mean": 4, "04.shard_indices": 5}


# -- shard_indices -------------------------------------------------------------------------
def shard_indices(n, rank, world_size, shuffle=False, seed=0, epoch=0, drop_last=False, pad=True,
                  with_epoch=True):
    if shuffle:
        g = torch.Generator()
        g.manual_seed(seed + epoch if with_epoch else seed)
        indices = torch.randperm(n, generator=g).tolist()
    else:
        indices = list(range(n))
    if drop_last and n % world_size:
        per_rank = math.ceil((n - world_size) / world_size)
    else:
        per_rank = math.ceil(n / world_size)
    total = per_rank * world_size
    if drop_last:
        indices = indices[:total]
    elif pad:
        missing = total - len(indices)
        indices += (indices * math.ceil(missing / len(indices)))[:missing] if missing else []
    return indices[rank:total:world_size]


def shard_no_padding(n, rank, world_size, shuffle=False, seed=0, epoch=0, drop_last=False):
    return shard_indices(n, rank, world_size, shuffle, seed, epoch, drop_last, pad=False)


def shard_seed_without_epoch(n, rank, world_size, shuffle=False, seed=0, epoch=0, drop_last=False):
    return shard_indices(n, rank, world_size, shuffle, seed, epoch, drop_last, with_epoch=False)


def shard_blocks(n, rank, world_size, shuffle=False, seed=0, epoch=0, drop_last=False):
    order = shard_indices(n, 0, 1, shuffle, seed, epoch)
    per = math.ceil(n / world_size)
    return order[rank * per:(rank + 1) * per]


def test_shard_indices_solution_gets_full_marks():
    result = check("04.shard_indices", shard_indices)
    assert result.points == result.max_points == 5, result


def test_shard_indices_stub_is_not_attempted():
    assert check("04.shard_indices", _stub).status == "not attempted"


@pytest.mark.parametrize("wrong,failing", [
    (shard_no_padding, "padded to 12"),
    (shard_seed_without_epoch, "seed + epoch"),
    (shard_blocks, "rank r takes r, r+3"),
])
def test_shard_indices_wrong_answers_fail_their_case(wrong, failing):
    failed = _failed(check("04.shard_indices", wrong))
    assert any(failing in name for name in failed), failed


# -- ddp_train ---------------------------------------------------------------------------
def ddp_train(model_fn, dataset, epochs, batch_size, lr, set_epoch=True, loader_shuffle=False, lr_scale=1.0,
              wrap=True):
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler

    from mgpu_lab import dist as mdist

    device = mdist.device()
    model = model_fn().to(device)
    ddp_model = (DDP(model, device_ids=[device.index]) if device.type == "cuda" else DDP(model)) if wrap else model
    if loader_shuffle:
        sampler, loader = None, DataLoader(dataset, batch_size=batch_size, shuffle=True)
    else:
        sampler = DistributedSampler(dataset)
        loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr * lr_scale)
    loss_fn = torch.nn.CrossEntropyLoss()
    for epoch in range(epochs):
        if sampler is not None and set_epoch:
            sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss_fn(ddp_model(x), y).backward()
            optimizer.step()
    return model.state_dict()


def ddp_no_set_epoch(model_fn, dataset, epochs, batch_size, lr):
    return ddp_train(model_fn, dataset, epochs, batch_size, lr, set_epoch=False)


def ddp_loader_shuffle(model_fn, dataset, epochs, batch_size, lr):
    return ddp_train(model_fn, dataset, epochs, batch_size, lr, loader_shuffle=True)


def ddp_lr_divided(model_fn, dataset, epochs, batch_size, lr):
    import torch.distributed as dist

    return ddp_train(model_fn, dataset, epochs, batch_size, lr, lr_scale=1 / dist.get_world_size())


def ddp_not_wrapped(model_fn, dataset, epochs, batch_size, lr):
    return ddp_train(model_fn, dataset, epochs, batch_size, lr, wrap=False)


def test_ddp_train_solution_gets_full_marks():
    result = check("04.ddp_train", ddp_train)
    assert result.points == result.max_points == 5, result


def test_ddp_train_library_version_gets_full_marks():
    from mgpu_lab.ddp import train

    assert check("04.ddp_train", train).passed


def test_ddp_train_stub_is_not_attempted():
    assert check("04.ddp_train", _stub).status == "not attempted"


@pytest.mark.parametrize("wrong,failing,hint", [
    (ddp_no_set_epoch, ["order changes"], "set_epoch"),
    (ddp_loader_shuffle, ["its own half"], "shuffle=True"),
    (ddp_lr_divided, ["weights of 1 process"], "lr / world_size"),
    (ddp_not_wrapped, ["same weights", "weights of 1 process"], "DistributedDataParallel"),
])
def test_ddp_train_wrong_answers_fail_their_case(wrong, failing, hint):
    result = check("04.ddp_train", wrong)
    failed = _failed(result)
    for name in failing:
        assert any(name in f for f in failed), failed
    assert hint in str(result), str(result)


# -- download_once -----------------------------------------------------------------------
def download_once(fn):
    import functools

    import torch.distributed as dist

    from mgpu_lab import dist as mdist

    @functools.wraps(fn)
    def wrapper(root):
        path = fn(root) if mdist.local_rank() == 0 else None
        dist.barrier()
        paths = [None] * dist.get_world_size()
        dist.all_gather_object(paths, path)
        return paths[dist.get_rank() - mdist.local_rank()]

    return wrapper


def every_rank_downloads(fn):
    return fn


def polls_without_barrier(fn):
    from mgpu_lab import dist as mdist

    def wrapper(root):
        if mdist.local_rank() == 0:
            return fn(root)
        while "data.bin" not in os.listdir(root):
            time.sleep(0.005)
        return os.path.join(root, "data.bin")

    return wrapper


def global_rank_zero(fn):
    import torch.distributed as dist

    def wrapper(root):
        path = [fn(root) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(path, src=0)
        return path[0]

    return wrapper


def test_download_once_solution_gets_full_marks():
    result = check("04.download_once", download_once)
    assert result.points == result.max_points == 4, result


def test_download_once_library_version_gets_full_marks():
    from mgpu_lab.download import download_once as library

    assert check("04.download_once", library).passed


def test_download_once_stub_is_not_attempted():
    assert check("04.download_once", lambda fn: _stub).status == "not attempted"


@pytest.mark.parametrize("wrong,failing,hint", [
    (every_rank_downloads, "exactly one rank per node", "every rank called fn"),
    (polls_without_barrier, "only once the file is complete", "before the file was complete"),
    (global_rank_zero, "exactly one rank per node", "local rank"),
    (global_rank_zero, "its node's path", "node 0's path"),
])
def test_download_once_wrong_answers_fail_their_case(wrong, failing, hint):
    result = check("04.download_once", wrong)
    assert any(failing in f for f in _failed(result)), result
    assert hint in str(result), str(result)


# -- global_mean -------------------------------------------------------------------------
def global_mean(local_sum, local_count):
    import torch.distributed as dist

    t = torch.tensor([float(local_sum), float(local_count)], dtype=torch.float64)
    dist.all_reduce(t)
    return (t[0] / t[1]).item()


def mean_of_means(local_sum, local_count):
    import torch.distributed as dist

    t = torch.tensor([local_sum / max(local_count, 1)], dtype=torch.float64)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).item()


def returns_tensor(local_sum, local_count):
    import torch.distributed as dist

    t = torch.tensor([float(local_sum), float(local_count)], dtype=torch.float64)
    dist.all_reduce(t)
    return t[0] / t[1]


def test_global_mean_solution_and_library_get_full_marks():
    from mgpu_lab.ddp import global_mean as library

    for answer in (global_mean, library):
        result = check("04.global_mean", answer)
        assert result.points == result.max_points == 4, result


def test_global_mean_stub_is_not_attempted():
    assert check("04.global_mean", _stub).status == "not attempted"


def test_global_mean_mean_of_means_fails_the_unequal_counts_case():
    failed = _failed(check("04.global_mean", mean_of_means))
    assert any("1, 3 and 8 samples" in f for f in failed), failed
    assert not any("4 samples each" in f for f in failed), failed


def test_global_mean_returning_a_tensor_fails_only_the_float_case():
    failed = _failed(check("04.global_mean", returns_tensor))
    assert failed == ["returns the same Python float on every rank"], failed

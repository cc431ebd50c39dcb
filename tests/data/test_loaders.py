"""mgpu_lab.data.loaders: lesson 02's reference loaders, and the fallback its demos use."""
from __future__ import annotations

import pytest
import torch

from mgpu_lab.data import loaders


def test_make_loader_trains_shuffled_full_batches_and_evaluates_everything_in_order():
    data = [torch.tensor([float(i)]) for i in range(10)]
    train = loaders.make_loader(data, 4, "cpu", num_workers=0, train=True)
    evaluate = loaders.make_loader(data, 4, torch.device("cuda", 1), num_workers=0, train=False)
    assert [len(b) for b in train] == [4, 4] and not train.pin_memory
    assert [b.flatten().tolist() for b in evaluate] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert evaluate.pin_memory  # decided from the device: building a pinned loader needs no GPU


def test_best_num_workers_refuses_nothing_to_measure():
    with pytest.raises(ValueError, match="candidates=\\[\\]"):
        loaders.best_num_workers(list(range(8)), [], 2, 1)


def test_yours_or_reference_uses_the_learner_s_function_once_it_is_written(capsys):
    def make_loader(*args, **kwargs):
        return "yours"

    assert loaders.yours_or_reference(make_loader, loaders.make_loader)(None, 4, "cpu") == "yours"
    assert capsys.readouterr().out == ""


def test_yours_or_reference_falls_back_with_one_note(capsys):
    def make_loader(*args, **kwargs):
        raise NotImplementedError("write this function")

    build = loaders.yours_or_reference(make_loader, loaders.make_loader)
    first, second = build(list(range(8)), 4, "cpu"), build(list(range(8)), 2, "cpu")
    assert (first.batch_size, second.batch_size) == (4, 2)
    assert capsys.readouterr().out == ("note: your make_loader is not written yet; this demo uses "
                                       "mgpu_lab.data.loaders.make_loader\n")


def test_yours_or_reference_lets_other_errors_through():
    def make_loader(*args, **kwargs):
        raise ValueError("a real bug")

    with pytest.raises(ValueError, match="a real bug"):
        loaders.yours_or_reference(make_loader, loaders.make_loader)(None, 4, "cpu")


def test_yours_or_reference_can_choose_at_once_and_leaves_the_random_state_alone(capsys):
    import random

    import numpy as np

    def seed_worker(worker_id):
        raise NotImplementedError("write this function")

    def seeds_globals(worker_id):
        random.seed(0)
        np.random.seed(0)

    random.seed(5)
    np.random.seed(5)
    before = (random.random(), float(np.random.rand()))
    random.seed(5)
    np.random.seed(5)
    assert loaders.yours_or_reference(seed_worker, loaders.seed_worker, try_now=(0,)) is loaders.seed_worker
    assert loaders.yours_or_reference(seeds_globals, loaders.seed_worker, try_now=(0,)) is seeds_globals
    assert (random.random(), float(np.random.rand())) == before
    assert capsys.readouterr().out.count("note: your seed_worker is not written yet") == 1

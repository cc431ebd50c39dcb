"""Lesson 02's checks against named wrong answers made from the solution, and correct variants.

Every mutant is the solution cell of ``solutions/02_data_loading.ipynb`` with
one learner bug put in; its check must fail with a message that names the bug.
Every variant is a correct answer written differently; it must get full marks.
"""
from __future__ import annotations

import os
import random
import time

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, get_worker_info

from batching import judge_many, shared_mutant_tests
from mutation import ExerciseMutants, Mutant, Variant, cell_of, define, replace, sub

pytestmark = pytest.mark.timeout(300)
NOTEBOOK = "02_data_loading.ipynb"
NAMESPACE = {"torch": torch, "np": np, "random": random, "time": time, "os": os, "DataLoader": DataLoader,
             "get_worker_info": get_worker_info}
PIN = 'torch.device(device).type == "cuda"'

LOADER = ExerciseMutants("02.make_loader", NOTEBOOK, ("make_loader",), mutants=[
    Mutant("always shuffles", replace("shuffle=train", "shuffle=True"), "reorders"),
    Mutant("keeps the last batch in training", replace("drop_last=train", "drop_last=False"), "drop_last=true"),
    Mutant("drops the last batch in evaluation too", replace("drop_last=train", "drop_last=True"), "every sample"),
    Mutant("pin_memory from torch.cuda.is_available()", replace(PIN, "torch.cuda.is_available()"),
           "not from torch.cuda.is_available()"),
    Mutant("pin_memory only for the name 'cuda'", replace(PIN, 'str(device) == "cuda"'), "cuda:1"),
    Mutant("always pins", replace(PIN, "True"), "your loader for the cpu pins"),
    Mutant("never persistent", replace("persistent_workers=num_workers > 0", "persistent_workers=False"),
           "keep them alive between epochs"),
    Mutant("always persistent", replace("persistent_workers=num_workers > 0", "persistent_workers=True"),
           "needs num_workers > 0"),
    Mutant("num_workers not passed through", replace("num_workers=num_workers, ", ""), "the asked number of workers"),
    Mutant("batch_size not passed (batches of 1)", replace("batch_size=batch_size, ", ""), "batch_size"),
], variants=[
    Variant("explicit samplers, positional batch size", '''
def make_loader(dataset, batch_size, device, num_workers=0, train=True):
    sampler = torch.utils.data.RandomSampler(dataset) if train else torch.utils.data.SequentialSampler(dataset)
    pin = torch.device(device).type == "cuda"
    return DataLoader(dataset, batch_size, sampler=sampler, drop_last=bool(train), num_workers=num_workers,
                      pin_memory=pin, persistent_workers=bool(num_workers))
'''),
    Variant("keyword dict, prefetch_factor only with workers", '''
def make_loader(dataset, batch_size, device, num_workers=0, train=True):
    kwargs = {"num_workers": num_workers, "pin_memory": "cuda" in str(device)}
    if num_workers > 0:
        kwargs["persistent_workers"] = True
        kwargs["prefetch_factor"] = 2
    if train:
        return DataLoader(dataset, batch_size=batch_size, shuffle=True, drop_last=True, **kwargs)
    return DataLoader(dataset, batch_size=batch_size, **kwargs)
'''),
])

SEED_LINE = "seed = int(np.random.SeedSequence([torch.initial_seed(), rank]).generate_state(1)[0])"
SEED = ExerciseMutants("02.seed_worker", NOTEBOOK, ("seed_worker",), mutants=[
    Mutant("the rank left out (ranks repeat each other)", replace("[torch.initial_seed(), rank]",
                                                                  "[torch.initial_seed()]"),
           ("worker w of another", "depend on the rank")),
    Mutant("the rank added to torch's per-worker seed",
           replace(SEED_LINE, "seed = (torch.initial_seed() + rank) % 2**32"),
           ("neighbours collide", "no two (rank, worker) pairs")),
    Mutant("torch not reseeded", replace("    torch.manual_seed(seed)\n", ""), ("torch:", "depend on the rank")),
    Mutant("NumPy not reseeded", replace("    np.random.seed(seed)\n", ""), ("numpy:", "classic bug")),
    Mutant("Python's random not reseeded", sub(r"^    random\.seed\(seed\)$", ""), ("python's random:", "classic bug")),
    Mutant("a constant seed", replace(SEED_LINE, "seed = 0"), ("classic bug",)),
    Mutant("seeded from worker_id and the rank", replace(SEED_LINE, "seed = worker_id + 100 * rank"),
           ("every epoch", "torch, python's random, numpy repeat")),
    Mutant("the 64-bit seed not reduced", replace(SEED_LINE, "seed = torch.initial_seed() + rank * 2**40"),
           "2**32-1"),
    Mutant("the rank from the process group (none in one process)",
           replace('int(os.environ.get("RANK", 0))', "torch.distributed.get_rank()"),
           ("without a launcher", "no process group")),
    Mutant("seed from the clock", replace(SEED_LINE, "seed = time.time_ns() % 2**32"), "not from the clock"),
], variants=[
    Variant("get_worker_info's seed plus the rank times the workers", '''
def seed_worker(worker_id):
    info = get_worker_info()
    rank = int(os.environ.get("RANK", "0"))
    seed = (info.seed + rank * info.num_workers) % 2**32
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
'''),
    Variant("a hash of (torch's seed, mgpu_lab.dist.rank()), torch seeded with the full 64 bits", '''
def seed_worker(worker_id):
    from mgpu_lab import dist as mdist
    full = hash((torch.initial_seed(), mdist.rank())) & (2**63 - 1)
    torch.manual_seed(full)
    random.seed(full)
    np.random.seed(full & 0xFFFFFFFF)
'''),
])

BEST = ExerciseMutants("02.best_num_workers", NOTEBOOK, ("best_num_workers",), mutants=[
    Mutant("the index returned, not the candidate",
           (replace("for k in candidates:", "for i, k in enumerate(candidates):"),
            replace("best, best_rate = k, rate", "best, best_rate = i, rate")), "position of the fastest"),
    Mutant("the slowest returned", (replace("best, best_rate = None, -1.0", "best, best_rate = None, float('inf')"),
                                    replace("rate > best_rate", "rate < best_rate")), "the slowest candidate"),
    Mutant("the largest candidate", replace("    return best", "    return max(candidates)"),
           "more workers is not always faster"),
    Mutant("best rate never updated", replace("best, best_rate = k, rate", "best = k"), "most samples per second"),
    Mutant("no warm-up", replace("range(max(1, k))", "range(0)"), "warm-up"),
    Mutant("a warm-up without workers only (the workers' start-up timed)",
           replace("range(max(1, k))", "range(1 if k == 0 else 0)"), ("start-up", "2, measured after a warm-up")),
    Mutant("num_workers not passed to the DataLoader", replace(", num_workers=k)", ")"),
           "really starts that many workers"),
    Mutant("n_batches ignored (one batch timed)", replace("range(n_batches)", "range(1)"),
           "times fewer batches than asked"),
    Mutant("whole epochs", replace("        for _ in range(n_batches):\n            next(it)",
                                   "        for _ in it:\n            pass"), "whole epochs"),
], variants=[
    Variant("times in a dict, the smallest time", '''
def best_num_workers(dataset, candidates, batch_size, n_batches):
    times = {}
    for k in candidates:
        it = iter(DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=k))
        for _ in range(max(1, k)):
            next(it)
        start = time.perf_counter()
        for _ in range(n_batches):
            next(it)
        times[k] = time.perf_counter() - start
        del it
    return min(times, key=times.get)
'''),
    Variant("islice, counted samples, k + 1 warm-up batches", '''
def best_num_workers(dataset, candidates, batch_size, n_batches):
    import itertools
    rates = []
    for k in candidates:
        loader = DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=k,
                            prefetch_factor=2 if k else None)
        it = iter(loader)
        for _ in range(k + 1):
            next(it)
        t0 = time.perf_counter()
        samples = sum(len(b) for b in itertools.islice(it, n_batches))
        rates.append((samples / (time.perf_counter() - t0), k))
        del it, loader
    return max(rates)[1]
'''),
])

SPECS = [LOADER, SEED, BEST]

# Every mutant and variant of an exercise is judged by its real checker, through one warm launch per round of
# calls (tests/mutants/batching.py) instead of one launch per answer: the same verdicts.
test_mutant_fails_naming_its_bug, test_correct_variant_passes, test_every_exercise_has_five_mutants_and_two_variants = \
    shared_mutant_tests(SPECS, "02", NAMESPACE)


@pytest.mark.parametrize("spec", [LOADER, SEED], ids=lambda s: s.exercise)  # best_num_workers: its sleeps
def test_shared_launches_judge_as_check_does(spec):
    """The solution gets full marks in the shared launches, and the same verdict, case by case, from check()."""
    from mgpu_lab.course.checks import check

    shared = judge_many(spec.exercise, [tuple(define(cell_of(spec), spec.names, NAMESPACE))])[0]
    alone = check(spec.exercise, *define(cell_of(spec), spec.names, NAMESPACE))
    assert shared.points == shared.max_points, str(shared)
    assert [(c.name, c.passed) for c in shared.cases] == [(c.name, c.passed) for c in alone.cases], str(shared)


def test_shared_launches_fail_a_mutant_as_check_does():
    """A failing answer (one that raises in a worker of every rank): the same cases fail, with the same words."""
    from mgpu_lab.course.checks import check

    mutant = next(m for m in SEED.mutants if m.name == "the 64-bit seed not reduced")
    answer = tuple(define(mutant.apply(cell_of(SEED)), SEED.names, NAMESPACE))
    alone = check(SEED.exercise, *answer)
    shared = judge_many(SEED.exercise, [answer])[0]  # whole (the mutant tests' verdicts may stop early)
    assert [(c.name, c.passed, c.hint, c.got) for c in shared.cases] == \
        [(c.name, c.passed, c.hint, c.got) for c in alone.cases], str(shared)

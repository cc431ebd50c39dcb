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

from mutation import ExerciseMutants, Mutant, Variant, mutant_tests, replace, sub

pytestmark = pytest.mark.timeout(300)
NOTEBOOK = "02_data_loading.ipynb"
NAMESPACE = {"torch": torch, "np": np, "random": random, "time": time, "os": os, "DataLoader": DataLoader,
             "get_worker_info": get_worker_info}
PIN = 'torch.device(device).type == "cuda"'

LOADER = ExerciseMutants("02.make_loader", NOTEBOOK, ("make_loader",), mutants=[
    Mutant("always shuffles", replace("shuffle=train", "shuffle=True"), "shuffle=false"),
    Mutant("keeps the last batch in training", replace("drop_last=train", "drop_last=False"), "drop_last=true"),
    Mutant("drops the last batch in evaluation too", replace("drop_last=train", "drop_last=True"), "every sample"),
    Mutant("pin_memory from torch.cuda.is_available()", replace(PIN, "torch.cuda.is_available()"),
           "not from torch.cuda.is_available()"),
    Mutant("pin_memory only for the name 'cuda'", replace(PIN, 'str(device) == "cuda"'), "cuda:1"),
    Mutant("always pins", replace(PIN, "True"), "must not pin"),
    Mutant("never persistent", replace("persistent_workers=num_workers > 0", "persistent_workers=False"),
           "persistent_workers=(num_workers > 0)"),
    Mutant("always persistent", replace("persistent_workers=num_workers > 0", "persistent_workers=True"),
           ("persistent_workers=(num_workers > 0)", "needs num_workers > 0")),
    Mutant("num_workers not passed through", replace("num_workers=num_workers, ", ""), "pass num_workers through"),
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

SEED = ExerciseMutants("02.seed_worker", NOTEBOOK, ("seed_worker",), mutants=[
    Mutant("nothing seeded", (replace("    np.random.seed(seed)\n", "    pass\n"), sub(r"^    random\.seed\(seed\)$", "")),
           ("numpy", "python's random", "classic bug")),
    Mutant("the 64-bit seed not reduced", replace(" % 2**32", ""), "% 2**32"),
    Mutant("a constant seed", replace("torch.initial_seed() % 2**32", "0"), ("classic bug", "every epoch")),
    Mutant("Python's random seeded from worker_id", sub(r"^    random\.seed\(seed\)$", "    random.seed(worker_id)"),
           ("python's random: the next epoch", "worker_id")),
    Mutant("NumPy seeded from worker_id", replace("np.random.seed(seed)", "np.random.seed(worker_id)"),
           ("numpy: the next epoch", "worker_id")),
    Mutant("NumPy only", sub(r"^    random\.seed\(seed\)$", "    pass"), ("python's random", "random.seed(s)")),
    Mutant("Python's random only", replace("np.random.seed(seed)", "pass"), ("numpy", "np.random.seed(s)")),
    Mutant("// for % (drops the worker's part)", replace("% 2**32", "// 2**32"), "classic bug"),
    Mutant("seed computed once in the kernel",
           (replace("def seed_worker", "KERNEL_SEED = torch.initial_seed() % 2**32\n\n\ndef seed_worker"),
            replace("seed = torch.initial_seed() % 2**32", "seed = KERNEL_SEED")), ("classic bug", "outside the worker")),
    Mutant("seed from the clock", replace("torch.initial_seed() % 2**32", "time.time_ns() % 2**32"),
           "not from time or os.urandom"),
    Mutant("a NumPy Generator that seeds nothing global",
           replace("np.random.seed(seed)", "rng = np.random.default_rng(seed)"), ("numpy", "np.random.seed(s)")),
], variants=[
    Variant("the seed from get_worker_info()", '''
def seed_worker(worker_id):
    s = get_worker_info().seed % 2**32
    random.seed(s)
    np.random.seed(s)
'''),
    Variant("a mask for NumPy, the whole seed for random", '''
def seed_worker(worker_id):
    full = torch.initial_seed()
    np.random.seed(full & 0xFFFFFFFF)
    random.seed(full)
'''),
])

BEST = ExerciseMutants("02.best_num_workers", NOTEBOOK, ("best_num_workers",), mutants=[
    Mutant("the index returned, not the candidate",
           (replace("for k in candidates:", "for i, k in enumerate(candidates):"),
            replace("best, best_rate = k, rate", "best, best_rate = i, rate")), "not its index"),
    Mutant("the slowest returned", (replace("best, best_rate = None, -1.0", "best, best_rate = None, float('inf')"),
                                    replace("rate > best_rate", "rate < best_rate")), "most samples per second"),
    Mutant("the largest candidate", replace("    return best", "    return max(candidates)"),
           "more workers is not always faster"),
    Mutant("best rate never updated", replace("best, best_rate = k, rate", "best = k"), "most samples per second"),
    Mutant("no warm-up", replace("range(max(1, k))", "range(0)"), "warm-up"),
    Mutant("num_workers not passed to the DataLoader", replace(", num_workers=k)", ")"), "num_workers=k"),
    Mutant("n_batches ignored (one batch timed)", replace("range(n_batches)", "range(1)"), "then time n_batches"),
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


test_mutant_fails_naming_its_bug, test_correct_variant_passes, test_every_exercise_has_five_mutants_and_two_variants = \
    mutant_tests(SPECS, "02", NAMESPACE)

"""Checks of lesson 02 (data loading): make_loader, seed_worker, best_num_workers.

Every answer runs in one fresh process per check (:mod:`.ranks`), with real
DataLoaders and real workers:

- ``make_loader`` is judged from the loaders it builds (sampler, drop_last,
  pin_memory, persistent_workers, the batches), so "pin_memory exactly when the
  device is CUDA" is checked on a CPU-only machine by passing ``cuda:1`` and
  ``cuda`` (building a loader with ``pin_memory=True`` needs no GPU; iterating
  would), and ``cpu`` on a machine that pretends to have 2 GPUs;
- ``seed_worker`` runs as the worker_init_fn of real forked DataLoaders whose
  workers start from the same copied random state, as forked workers did
  before PyTorch 1.9 reseeded NumPy itself; Python's ``random`` and NumPy are
  judged each on its own, across workers, epochs and runs;
- ``best_num_workers`` measures data sets whose speed per worker count the
  check controls (samples sleep), and which count the samples drawn; the
  winner is never at the index equal to its value.
"""
from __future__ import annotations

import torch

from .._core import exercise
from ..sim.outcome import in_words
from .judges import describe_fields, fastest_workers, need
from .ranks import run_best, run_loaders, run_seeds


# -- make_loader --------------------------------------------------------------------
CPU, CUDA1 = torch.device("cpu"), torch.device("cuda", 1)


LOADERS = {  # name: device, num_workers, train, iterate, simulated GPUs
    "train": (CPU, 0, True, True, None),
    "eval": (CPU, 0, False, True, None),
    "cuda:1": (CUDA1, 0, True, False, None),
    "cpu, 2 GPUs": (CPU, 0, True, False, 2),
    "2 workers": (CPU, 2, True, True, None),
    "cuda, 2 workers": (torch.device("cuda"), 2, False, False, None),
}


DROP_HINT = ("training wants shuffle=True (a new order every epoch) and drop_last=True (no tiny, noisy last "
             "batch); under DDP, equal step counts on every rank come from DistributedSampler (lesson 04), "
             "not from drop_last")


PIN_HINT = "pin_memory=(torch.device(device).type == 'cuda'): decide from the device argument, not from "\
           "torch.cuda.is_available()"


@exercise("02.make_loader", points=7, description="make_loader(dataset, batch_size, device, num_workers=0, "
          "train=True): shuffle and drop_last when training only, pin_memory exactly for CUDA, "
          "persistent_workers exactly when num_workers > 0")
def _make_loader(t, make_loader):
    """Catches: shuffling or dropping the last batch in evaluation, keeping it in training, pin_memory
    from ``torch.cuda.is_available()``, only for the string ``"cuda"``, or always; num_workers not
    passed through; persistent_workers never or always; batch_size ignored; not a DataLoader (one case)."""
    got = None

    def loader(name):
        need(t, got)
        result = got[name]
        if result[0] == "raised":
            t.fail("", "a DataLoader", in_words(result, raised="make_loader raised "))
        if result[1]["type"] != "DataLoader":
            t.fail("return a torch.utils.data.DataLoader", "DataLoader", result[1]["type"])
        return result[1]

    with t.case("train=True: shuffles (RandomSampler) and drops the last incomplete batch (10 samples: "
                "2 batches of 4)", hint=DROP_HINT):
        got = t.call(run_loaders, make_loader, LOADERS)
        train = loader("train")
        t.equal(describe_fields(train, ("sampler", "drop_last")), "sampler='RandomSampler', drop_last=True")
        sizes = [len(b) for b in train["batches"]]
        if sizes != [4, 4] or len({v for b in train["batches"] for v in b}) != 8:
            t.fail("pass batch_size through; drop_last=True keeps only full batches", "2 batches of 4 distinct "
                   "samples", str(train["batches"]))
    with t.case("train=False: keeps the order and every sample (batches [0..3], [4..7], [8, 9])",
                hint="evaluation must see every sample once, in order: shuffle=False, drop_last=False"):
        ev = loader("eval")
        t.equal(describe_fields(ev, ("sampler", "drop_last", "batches")),
                "sampler='SequentialSampler', drop_last=False, batches=[[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]")
    with t.case("device=cuda:1: pin_memory=True (judged on the loader, which needs no GPU)",
                hint=PIN_HINT + "; every CUDA device counts, cuda:1 as well as cuda"):
        t.equal(loader("cuda:1").get("pin_memory"), True)
    with t.case("device=cpu on a machine with 2 GPUs: pin_memory=False",
                hint="pinning only helps copies to a GPU; a loader for the CPU must not pin: " + PIN_HINT):
        t.equal(loader("cpu, 2 GPUs").get("pin_memory"), False)
    with t.case("num_workers=2: two workers, persistent_workers=True, full shuffled batches",
                hint="pass num_workers through and set persistent_workers=(num_workers > 0), so the "
                     "workers start once, not at every epoch"):
        two = loader("2 workers")
        t.equal(describe_fields(two, ("num_workers", "persistent_workers")), "num_workers=2, persistent_workers=True")
        if [len(b) for b in two["batches"]] != [4, 4]:
            t.fail("", "2 batches of 4", str(two["batches"]))
    with t.case("num_workers=0: persistent_workers=False (DataLoader refuses True without workers)",
                hint="persistent_workers=(num_workers > 0): with num_workers=0 there is no worker to keep"):
        t.equal(loader("eval").get("persistent_workers"), False)
    with t.case("evaluation on torch.device('cuda') with 2 workers: pinned, persistent, in order", hidden=True,
                hint=PIN_HINT):
        got_ = loader("cuda, 2 workers")
        t.equal(describe_fields(got_, ("sampler", "pin_memory", "persistent_workers", "batch_size")),
                "sampler='SequentialSampler', pin_memory=True, persistent_workers=True, batch_size=4")


# -- seed_worker ----------------------------------------------------------------------
SEED_HINT = ("seed from torch's per-worker seed: s = torch.initial_seed() % 2**32, then np.random.seed(s) "
             "and random.seed(s)")


GENERATORS = (("numpy", "NumPy", "np.random.seed(s)"), ("random", "Python's random", "random.seed(s)"))


@exercise("02.seed_worker", points=6, description="seed_worker(worker_id): seed Python's random and NumPy in "
          "each DataLoader worker from torch's per-worker seed")
def _seed_worker(t, seed_worker):
    """Judges NumPy and Python's random each on its own. Catches: nothing seeded, one generator left out,
    a constant seed, a seed from ``worker_id`` (repeats every epoch), an unreduced 64-bit seed, ``//``
    for ``%``, a seed computed once in the parent, a seed from the clock or ``os.urandom`` (not
    reproducible), a ``default_rng`` that seeds nothing global."""
    runs = None
    with t.case("runs in real workers, where torch's per-worker seed is a 64-bit number",
                hint="np.random.seed accepts only 0..2**32-1: reduce the seed with % 2**32"):
        runs = t.call(run_seeds, seed_worker)
        if "error" in runs:
            got, runs = runs["error"], None
            t.fail("", "no error", got)
    for gen, name, call in GENERATORS:
        with t.case(f"{name}: two workers that start from the same copied state draw different numbers",
                    hint=f"the classic bug: every worker makes the same 'random' augmentation. Seed {name} "
                         f"in every worker ({call}) from s = torch.initial_seed() % 2**32, which differs "
                         "from worker to worker"):
            need(t, runs)
            a, b = runs["epoch1"][gen]
            if a == b:
                t.fail("", "different first draws in worker 0 and worker 1", f"both {a}")
    with t.case("the same generator seed gives the same draws in a second run (reproducible)",
                hint="derive the seed from torch (torch.initial_seed()), not from time or os.urandom; "
                     "DataLoader(generator=torch.Generator().manual_seed(...)) fixes torch's seeds"):
        need(t, runs)
        t.equal(runs["again"], runs["epoch1"])
    for gen, name, call in GENERATORS:
        with t.case(f"{name}: the next epoch draws other numbers (augmentations change from epoch to epoch)",
                    hint=f"{name} repeats its draws every epoch: seeding it with worker_id or a constant (or a "
                         "seed computed once, outside the worker) repeats the same augmentations every epoch "
                         "and every run; use torch.initial_seed(), which the DataLoader draws anew at every "
                         "epoch (with persistent_workers=True only once, when the workers start: their "
                         "generators then run on from epoch to epoch)"):
            need(t, runs)
            if runs["epoch2"][gen] == runs["epoch1"][gen]:
                t.fail("", "other draws in epoch 2", f"the same draws: {runs['epoch1'][gen]}")


# -- best_num_workers -----------------------------------------------------------------
BEST_CASES = [  # name, costs per num_workers (s/sample), candidates, hidden; no winner sits at its own index
    ("workers help (a sample costs 12 ms alone, 6 ms in each of 2 workers): 2 of [2, 0, 1]",
     {0: .012, 1: .012, 2: .006}, [2, 0, 1], False),
    ("workers make samples slower (1 ms alone, 12-25 ms in workers): 0 of [2, 1, 0]",
     {0: .001, 1: .012, 2: .025}, [2, 1, 0], False),
    ("neither the fewest nor the most workers: 1 of [2, 0, 1]", {0: .03, 1: .002, 2: .06}, [2, 0, 1], True),
]


# The margins hold when every wake-up of a sleeping sample costs up to ~20 ms more (a machine loaded
# far beyond its cores): 2 samples per batch, 4 timed batches.
BATCH, N_BATCHES, SAMPLES = 2, 4, 48


BEST_HINT = ("time n_batches for every candidate (after a warm-up) and return the num_workers with the most "
             "samples per second: the candidate itself, not its index in the list; more workers is not always "
             "faster")


@exercise("02.best_num_workers", points=5, description="best_num_workers(dataset, candidates, batch_size, "
          "n_batches): measure each candidate after a warm-up and return the fastest")
def _best(t, best_num_workers):
    """Catches: the index returned instead of the candidate, the largest or the slowest candidate, a best
    rate never updated, no warm-up, num_workers not passed to the DataLoader, n_batches ignored, whole
    epochs drawn."""
    runs = None
    for i, (name, costs, candidates, hidden) in enumerate(BEST_CASES):
        expected = fastest_workers(costs, candidates)
        with t.case(name, hidden=hidden, hint=BEST_HINT):
            if i == 0:
                runs = t.call(run_best, best_num_workers, [(c, k) for _, c, k, _ in BEST_CASES], BATCH,
                              N_BATCHES, SAMPLES)
            need(t, runs)
            result = runs[i]["outcome"]
            if result[0] == "raised":
                t.fail("", expected, in_words(result, raised=""))
            t.equal(result[1], expected)
    first = runs[0]["counts"] if runs else None
    with t.case(f"draws a warm-up batch plus n_batches={N_BATCHES} from every candidate",
                hint="iterate a DataLoader(dataset, ..., num_workers=k) for every candidate k: first at least "
                     "one warm-up batch (workers start, caches fill), then time n_batches"):
        need(t, first)
        low = {k: c for k, c in first.items() if c < (N_BATCHES + (1 if k == 0 else 0)) * BATCH}
        if low:
            t.fail("", f"at least {(N_BATCHES + 1) * BATCH} samples with num_workers=0 and "
                       f"{N_BATCHES * BATCH} with workers", f"samples drawn per num_workers: {first}")
    with t.case("draws only what it measures (a few warm-up batches plus n_batches, not whole epochs)",
                hint="stop after the warm-up and n_batches batches: next(iterator) in a loop, then drop "
                     "the iterator; a sweep over whole epochs takes far longer"):
        need(t, first)
        high = {k: c for k, c in first.items() if c > (N_BATCHES + 5 + 2 * k) * BATCH}
        if high:
            t.fail("", f"about {(N_BATCHES + 1) * BATCH} samples per num_workers (plus what workers "
                       "prefetch)", f"samples drawn per num_workers: {first}")

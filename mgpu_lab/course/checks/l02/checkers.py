"""Checks of lesson 02 (data loading): make_loader, seed_worker, best_num_workers.

Every answer runs in a fresh process or in real ranks (:mod:`.ranks`), with real
DataLoaders and real workers (an answer to ``best_num_workers`` that calls the
library's own sweep of worker counts, in :mod:`mgpu_lab.data.rates`, fails):

- ``make_loader`` is judged from the loaders it builds (sampler, drop_last,
  pin_memory, persistent_workers, the batches), so "pin_memory exactly when the
  device is CUDA" is checked on a CPU-only machine by passing ``cuda:1`` and
  ``cuda`` (building a loader with ``pin_memory=True`` needs no GPU; iterating
  would), and ``cpu`` on a machine that pretends to have 2 GPUs;
- ``seed_worker`` runs as the worker_init_fn of real forked DataLoaders in 2
  real ranks whose loaders share one generator seed (as ranks started from one
  script do), their workers starting from the same copied Python and NumPy
  state, as forked workers did before PyTorch 1.9 reseeded NumPy itself; torch,
  Python's ``random`` and NumPy are judged each on its own, across workers and
  ranks, epochs and runs, and once more in one process without a launcher;
- ``best_num_workers`` measures data sets whose speed per worker count the
  check controls (samples sleep), and which count the samples drawn; the
  winner is never at the index equal to its value.
"""
from __future__ import annotations

import torch

from .._core import exercise
from ..sim.outcome import in_words
from .judges import best_diagnosis, describe_fields, fastest_workers, need, seed_diagnosis, seed_table
from .ranks import GENERATORS, run_best, run_loaders, run_seeds


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


DROP_HINT = ("your training loader keeps the order, or keeps a short last batch: training wants a new order every "
             "epoch and no tiny, noisy last batch (under DDP, equal step counts on every rank come from the "
             "DistributedSampler of lesson 04, not from dropping batches)")


PIN_HINT = ("pinning serves copies to a CUDA device, whatever its index: decide it from the device the loader "
            "feeds, not from whether this machine has a GPU (not from torch.cuda.is_available())")


# A setting that must follow an argument ("exactly when") is judged where it is off only beside the case where
# it is on: a loader that never pins, never persists or ignores train meets the "off" half by doing nothing.
UNPAIRED = {  # (hint, expected, got) of the "off" case when the "on" case did not hold
    "train": ("not judged: your loader is the same with train=True and train=False (see the case above): the "
              "evaluation loader's order and last batch count once train decides them",
              "a training loader and an evaluation loader that differ", "the same loader for both"),
    "pin": ("not judged: your loader does not pin for cuda:1 either (see the case above): pinning exactly for CUDA "
            "shows only beside a loader that pins for a CUDA device", "pin_memory=True for cuda:1",
            "pin_memory=False for every device"),
    "persistent": ("not judged: your loader keeps no workers alive with num_workers=2 either (see the case above): "
                   "persistent workers exactly when there are workers shows only beside a loader that keeps them",
                   "persistent_workers=True with 2 workers", "persistent_workers=False everywhere"),
}


# make_loader turns the text into code (depth 1): 2 points, for pinning for a GPU and workers kept alive; its
# other cases are practice (reported, no points)
@exercise("02.make_loader", points=2, description="make_loader(dataset, batch_size, device, num_workers=0, "
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
                "2 batches of 4)", hint=DROP_HINT, points=0):
        got = t.call(run_loaders, make_loader, LOADERS)
        train = loader("train")
        t.equal(describe_fields(train, ("sampler", "drop_last")), "sampler='RandomSampler', drop_last=True")
        sizes = [len(b) for b in train["batches"]]
        if sizes != [4, 4] or len({v for b in train["batches"] for v in b}) != 8:
            t.fail("your batches are not the asked batch_size, or a short last batch was kept in training",
                   "2 batches of 4 distinct "
                   "samples", str(train["batches"]))
    with t.case("train=False: keeps the order and every sample (batches [0..3], [4..7], [8, 9])",
                hint="your evaluation loader reorders or loses samples: evaluation sees every sample once, in "
                     "order, the last partial batch included", points=0):
        ev = loader("eval")
        fields = ("sampler", "drop_last")
        if describe_fields(loader("train"), fields) == describe_fields(ev, fields):
            t.fail(*UNPAIRED["train"])
        t.equal(describe_fields(ev, ("sampler", "drop_last", "batches")),
                "sampler='SequentialSampler', drop_last=False, batches=[[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]")
    with t.case("device=cuda:1: pin_memory=True (judged on the loader, which needs no GPU)",
                hint=PIN_HINT + "; every CUDA device counts, cuda:1 as well as cuda"):
        t.equal(loader("cuda:1").get("pin_memory"), True)
    with t.case("device=cpu on a machine with 2 GPUs: pin_memory=False",
                hint="your loader for the CPU pins its batches: pinning only helps copies to a GPU. " + PIN_HINT,
                points=0):
        if loader("cuda:1").get("pin_memory") is not True:
            t.fail(*UNPAIRED["pin"])
        t.equal(loader("cpu, 2 GPUs").get("pin_memory"), False)
    with t.case("num_workers=2: two workers, persistent_workers=True, full shuffled batches",
                hint="the loader must start the asked number of workers and keep them alive between epochs "
                     "(they then start once, not at every epoch)"):
        two = loader("2 workers")
        t.equal(describe_fields(two, ("num_workers", "persistent_workers")), "num_workers=2, persistent_workers=True")
        if [len(b) for b in two["batches"]] != [4, 4]:
            t.fail("", "2 batches of 4", str(two["batches"]))
    with t.case("num_workers=0: persistent_workers=False (DataLoader refuses True without workers)",
                hint="your loader without workers asks to keep workers alive: with num_workers=0 there is no "
                     "worker to keep, and the DataLoader refuses it", points=0):
        if loader("2 workers").get("persistent_workers") is not True:
            t.fail(*UNPAIRED["persistent"])
        t.equal(loader("eval").get("persistent_workers"), False)
    with t.case("evaluation on torch.device('cuda') with 2 workers: pinned, persistent, in order", hidden=True,
                hint=PIN_HINT, points=0):
        got_ = loader("cuda, 2 workers")
        t.equal(describe_fields(got_, ("sampler", "pin_memory", "persistent_workers", "batch_size")),
                "sampler='SequentialSampler', pin_memory=True, persistent_workers=True, batch_size=4")


# -- seed_worker ----------------------------------------------------------------------
SEED_RANKS, SEED_WORKERS = 2, 2
NAMES = {"torch": "torch", "random": "Python's random", "numpy": "NumPy"}


@exercise("02.seed_worker", points=7, description="seed_worker(worker_id): reseed torch, Python's random and "
          "NumPy in each DataLoader worker so that every (rank, worker) draws its own numbers, anew each epoch, "
          "the same in every run")
def _seed_worker(t, seed_worker):
    """Judges torch, NumPy and Python's random each on its own, over 2 real ranks x 2 workers whose loaders
    share one generator seed, and in one process without a launcher. Catches: nothing seeded, one generator
    left out, the rank left out (ranks repeat each other), the rank added to torch's per-worker seed (rank r's
    worker w + 1 is rank r + 1's worker w), a constant seed, a seed from ``worker_id`` (repeats every epoch), an
    unreduced 64-bit seed for NumPy, a seed computed once in the parent, a seed from the clock (not
    reproducible), a rank from the process group that fails without one."""
    runs = None
    with t.case(f"runs in every worker of {SEED_RANKS} ranks x {SEED_WORKERS} workers, and reseeds there",
                hint="your seed_worker raised inside a worker; NumPy's global seed must lie in 0..2**32-1, and "
                     "torch's per-worker seed is a 64-bit number"):
        runs = t.ranks(run_seeds, SEED_RANKS, seed_worker, num_workers=SEED_WORKERS)
        errors = [r["error"] for r in runs if "error" in r]
        if errors:
            runs = None
            t.fail("", "no error", errors[0])
        if all(run["epoch1"][gen][w] == run["copied"][gen] for run in runs for gen in ("random", "numpy")
               for w in range(SEED_WORKERS)):
            t.fail("your seed_worker ran, but every worker still draws from the Python and NumPy state it copied "
                   "from the training process: it reseeded neither there", "Python's random and NumPy reseeded "
                   "in the workers", "the copied state in every worker")
    for gen in GENERATORS:
        with t.case(f"{NAMES[gen]}: the {SEED_RANKS * SEED_WORKERS} workers of {SEED_RANKS} ranks draw "
                    f"{SEED_RANKS * SEED_WORKERS} different numbers (every rank's loader has the same "
                    "generator seed)"):
            need(t, runs)
            draws = {(r, w): run["epoch1"][gen][w] for r, run in enumerate(runs) for w in range(SEED_WORKERS)}
            verdict = seed_diagnosis(draws, NAMES[gen])
            if verdict:
                t.fail(verdict, "a different first draw in every (rank, worker)", seed_table(draws))
    with t.case("the same generator seed gives the same draws in a second run, on every rank (reproducible)",
                hint="your seed changes from run to run: derive it from what the DataLoader gives the worker "
                     "(torch's per-worker seed, which a seeded loader generator fixes) and from the rank, not "
                     "from the clock or os.urandom"):
        need(t, runs)
        alike = [NAMES[g] for g in GENERATORS if len({v for run in runs for v in run["epoch1"][g]})
                 < SEED_RANKS * SEED_WORKERS]
        if alike:
            t.fail(f"not judged: in {', '.join(alike)} some workers of some ranks drew the same numbers (see the "
                   "cases above), and draws that every worker shares repeat trivially; reproducibility counts for "
                   "seeds that differ in every (rank, worker)", "different draws that repeat in a second run",
                   f"repeated draws in {', '.join(alike)}")
        t.equal([run["again"] for run in runs], [run["epoch1"] for run in runs])
    with t.case("the next epoch draws other numbers, in every generator (augmentations change each epoch)"):
        need(t, runs)
        same = [NAMES[gen] for gen in GENERATORS if any(run["epoch2"][gen] == run["epoch1"][gen] for run in runs)]
        if same:
            t.fail(f"{', '.join(same)} repeat the same draws every epoch: a seed from worker_id, from the rank "
                   "alone, from a constant or computed once outside the worker does not change between epochs; "
                   "torch's per-worker seed does (the DataLoader draws its base anew at every epoch)",
                   "other draws in epoch 2", f"the same draws in {', '.join(same)}")
    with t.case("in one process without a launcher (as in this notebook): runs, and its 2 workers draw differently",
                hint="outside a launched job there is no RANK variable and no process group: the rank is then 0"):
        single = t.call(run_seeds, seed_worker, num_workers=SEED_WORKERS, single=True)
        if "error" in single:
            t.fail("", "no error", single["error"])
        same = [NAMES[g] for g in GENERATORS if len(set(single["epoch1"][g])) < SEED_WORKERS]
        if same:
            t.fail("", "different draws in worker 0 and worker 1", f"the same draws in {', '.join(same)}")


# -- best_num_workers -----------------------------------------------------------------
BEST_CASES = [  # name, costs per num_workers (s/sample), candidates, hidden; no winner sits at its own index
    ("workers help (a sample costs 24 ms alone, 12 ms in each of 2 workers): 2 of [2, 0, 1]",
     {0: .024, 1: .024, 2: .012}, [2, 0, 1], False),
    ("workers make samples slower (1 ms alone, 12-25 ms in workers): 0 of [2, 1, 0]",
     {0: .001, 1: .012, 2: .025}, [2, 1, 0], False),
    ("neither the fewest nor the most workers: 1 of [2, 0, 1]", {0: .03, 1: .002, 2: .06}, [2, 0, 1], True),
]


# Workers that start slowly (0.5 s each, at once) and then load twice as fast: timed from the loader's
# creation they lose to no workers (8 samples: > 0.5 s against 0.2 s); timed after a warm-up they win.
STARTUP = ({0: .024, 2: .012}, [0, 2], 0.5)

# 2 samples per batch, 4 timed batches. Where workers should win (the first case, STARTUP), no workers take
# 4 x 2 x 24 ms = 192 ms and two workers about a quarter of it: the choice holds while the workers' timed
# batches are held up less than ~140 ms in all (a machine loaded far beyond its cores). With 12 ms and 6 ms
# (half the margin) a right answer once chose 0 during the whole suite on this 2-core machine (2026-11-29).
BATCH, N_BATCHES, SAMPLES = 2, 4, 32  # a whole epoch (16 batches) is more than any right answer draws


@exercise("02.best_num_workers", points=5, description="best_num_workers(dataset, candidates, batch_size, "
          "n_batches): the num_workers with the most samples per second, measured after a warm-up",
          references=("mgpu_lab.data.rates:sweep_workers", "mgpu_lab.data.rates:measure"))
def _best(t, best_num_workers):
    """Catches: the index returned instead of the candidate, the largest or the slowest candidate, a best
    rate never updated, no warm-up (or one without workers only: their start-up timed), num_workers not passed to the DataLoader, n_batches ignored, whole
    epochs drawn."""
    runs = None
    for i, (name, costs, candidates, hidden) in enumerate(BEST_CASES):
        expected = fastest_workers(costs, candidates)
        with t.case(name, hidden=hidden):
            if i == 0:
                runs = t.call(run_best, best_num_workers, [(c, k, 0.0) for _, c, k, _ in BEST_CASES] + [STARTUP],
                              BATCH, N_BATCHES, SAMPLES)
            need(t, runs)
            result = runs[i]["outcome"]
            if result[0] == "raised":
                t.fail("", expected, in_words(result, raised=""))
            unmeasured = [k for k in candidates if not runs[i]["counts"][k]]
            if unmeasured:
                t.fail(f"you returned {result[1]!r} without loading a single sample with num_workers="
                       f"{unmeasured[0]}: a choice that measures no loader matches this case only by chance; "
                       "each candidate must be measured on a loader that really starts that many workers",
                       f"{expected}, measured", f"{result[1]!r}, with samples drawn per num_workers: "
                       f"{runs[i]['counts']}")
            if result[1] != expected:
                t.fail(best_diagnosis(result[1], costs, candidates, runs[i]["counts"]), expected, result[1])
    first = runs[0]["counts"] if runs else None
    with t.case(f"warm-up: the workers' start-up is left out of the rates (workers that take {STARTUP[2]:g} s to "
                f"start, then load twice as fast: 2 of [0, 2]); a warm-up batch plus n_batches={N_BATCHES} drawn "
                "from every candidate"):
        need(t, first)
        low = {k: c for k, c in first.items() if c < (N_BATCHES + (1 if k == 0 else 0)) * BATCH}
        if low:
            t.fail("some candidates gave fewer samples than one warm-up batch plus n_batches: a measurement "
                   "that includes the workers' start-up, or times fewer batches than asked, misjudges them",
                   f"at least {(N_BATCHES + 1) * BATCH} samples with num_workers=0 and {N_BATCHES * BATCH} with "
                   "workers", f"samples drawn per num_workers: {first}")
        slow_start = runs[len(BEST_CASES)]["outcome"]
        if slow_start[0] != "ok" or slow_start[1] != 2:
            t.fail("your rates count the workers' start-up: timed from the loader's creation, workers that start "
                   "slowly lose to no workers though they load faster for the rest of training; start the clock "
                   "once every worker has delivered (a warm-up, with workers too)", "2, measured after a warm-up",
                   in_words(slow_start, raised=""))
    with t.case("draws only what it measures (a few warm-up batches plus n_batches, not whole epochs)"):
        need(t, first)
        if not all(first.values()):
            t.fail("not judged: some candidates gave no sample at all (see the case above)", "samples drawn from "
                   "every candidate", f"samples drawn per num_workers: {first}")
        high = {k: c for k, c in first.items() if c > (N_BATCHES + 5 + 2 * k) * BATCH}
        if high:
            t.fail("you drew far more samples than you timed: a sweep that runs whole epochs per candidate costs "
                   "minutes on a real data set; a right one stops once it has its measurement",
                   f"about {(N_BATCHES + 1) * BATCH} samples per num_workers (plus what workers prefetch)",
                   f"samples drawn per num_workers: {first}")

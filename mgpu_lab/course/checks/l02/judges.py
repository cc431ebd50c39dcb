"""Lesson 02's verdicts: the evidence of :mod:`.ranks`, in the words of each case."""
from __future__ import annotations


FIRST = "not judged: your code did not finish the first case (see there)"


def need(t, evidence):
    if evidence is None:
        t.fail(FIRST, got="skipped")


def describe_fields(got: dict, keys) -> str:
    return ", ".join(f"{k}={got.get(k)!r}" for k in keys)


def fastest_workers(costs: dict, candidates) -> int:
    return max(candidates, key=lambda k: max(k, 1) / costs[k])


def seed_table(draws: dict) -> str:
    """``{(rank, worker): first draw}`` in words."""
    return ", ".join(f"rank {r} worker {w}: {v:.6f}" for (r, w), v in sorted(draws.items()))


def seed_diagnosis(draws: dict, name: str) -> str:
    """Why the first draws of ``{(rank, worker): draw}`` are not all different ("" when they are)."""
    if len(set(draws.values())) == len(draws):
        return ""
    ranks = sorted({r for r, _ in draws})
    workers = sorted({w for _, w in draws})
    if any(draws[r, w] == draws[r, v] for r in ranks for w in workers for v in workers if w < v):
        return (f"the workers of one rank draw the same {name} numbers (the classic bug: every worker makes the "
                f"same 'random' augmentation): {name} is not reseeded in the worker, or from something every "
                "worker shares")
    if any(draws[r, w] == draws[q, w] for w in workers for r in ranks for q in ranks if r < q):
        return (f"worker w of one rank draws the same {name} numbers as worker w of another: torch's per-worker "
                "seed is the same on every rank whose loader has the same generator seed, so the seed must also "
                "depend on the rank")
    return (f"rank r's worker w + 1 draws the same {name} numbers as rank r + 1's worker w: adding the rank to "
            "torch's per-worker seed (which already adds the worker id) makes neighbours collide; combine the "
            "rank and the per-worker seed so that no two (rank, worker) pairs share a seed")


def best_diagnosis(got, costs: dict, candidates, counts: dict) -> str:
    """Why ``got`` is not the fastest of ``candidates`` (whose seconds per sample are ``costs``): every known
    wrong answer it matches, named."""
    expected = fastest_workers(costs, candidates)
    idle = [k for k in candidates if k > 0 and not counts.get(k)]
    if idle:
        return (f"no worker loaded a sample while you measured num_workers={idle[0]}: each candidate must be "
                "measured on a loader that really starts that many workers")
    rate = {k: max(k, 1) / costs[k] for k in candidates}  # samples per second, as the costs are set
    slowest = min(rate.values())
    known = [
        (got == candidates.index(expected), f"the position of the fastest candidate ({expected}) in the list, "
                                            "not the candidate itself (a num_workers value)"),
        (got == max(candidates), "the most workers: more workers is not always faster, only a measurement tells"),
        # two candidates as slow as each other (or within 10 %): a measurement picks either, by noise
        (isinstance(got, int) and got in rate and got != expected and rate[got] <= 1.1 * slowest,
         "the slowest candidate: the right one has the most samples per second"),
    ]
    reasons = [why for found, why in known if found]
    if reasons:
        return f"you returned {got}: " + "; or ".join(reasons)
    return (f"{expected} loads the most samples per second here; you returned {got}: measure each candidate on its "
            "own loader and keep the best rate seen")

"""How lesson 05's checks judge: the sampler's lists, and train_uneven's weights against the reference.

The cost distributions (:func:`case_costs`) are ones the notebook never shows;
a list of per-rank index lists is judged as a partition (equal lengths, every
index covered, only the padding repeated), per rank (max/mean of the ranks'
total costs) and per step (the same max/mean sample position by sample
position, :func:`mgpu_lab.data.workload.step_imbalance` with one sample per step).
``train_uneven``'s weights are compared with :func:`uneven_reference`, computed in one
process, and with the weights of the known wrong answers (:func:`uneven_diagnosis`).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from mgpu_lab.data.workload import distributed_sampler_lists, step_imbalance
from ..sim.outcome import in_words
from .ranks import LR, uneven_model, uneven_shards


def _case(name, cfg, hint="", balance=False, steps=False, differ=False, hidden=False, same=False) -> dict:
    """``same``: every configuration of the case must give the same lists (they differ only in the seed)."""
    return {"name": name, "cfgs": cfg if isinstance(cfg, list) else [cfg], "hint": hint, "balance": balance,
            "steps": steps, "differ": differ, "hidden": hidden, "same": same}


UNSHUFFLED_HINT = ("with shuffle=False your lists changed with the {what}: shuffle=False draws no random order at "
                   "all, so nothing may depend on the epoch or the seed")


def judge_same_lists(t, results) -> None:
    """Fail unless every result (an outcome of :func:`.ranks.sampler_lists`) gave the first one's lists."""
    lists = [r[1]["epochs"][0][1] for r in results if r[0] == "ok"]
    if any(other != lists[0] for other in lists[1:]):
        t.fail(UNSHUFFLED_HINT.format(what="seed"), "the same lists for seeds 0 and 7",
               "different lists for another seed")


def sampler_cases() -> list[dict]:
    """05.BalancedDistributedSampler's cases in one process: name, configurations, hint, what to judge."""
    heavy = case_costs("lognormal", 400, 3)
    ds_step = step_imbalance(ds_lists(400, 4), heavy, 1)
    fresh = dict(balance=True, steps=True, differ=True, hidden=True)  # the hidden cases judge everything
    return [
        _case("a torch Sampler; len() is ceil(n / num_replicas): n=10, 3 ranks give 4 each", config([1.0] * 10, 3),
              "your len() is not what every rank needs: with drop_last=False each rank gets ceil(n / num_replicas) "
              "indices, the shortfall made up by repeating some"),
        _case("drop_last=False, n=103, 4 ranks: 26 each, together every index, repeats only the padding (1)",
              config(case_costs("lengths", 103, 1), 4),
              "your ranks together miss indices or repeat more than the padding: with drop_last=False the lists cover "
              "every index, and only the shortfall to num_samples x num_replicas is repeated"),
        _case("drop_last=True, n=103, 4 ranks: 25 each, no index twice, only 103 % 4 = 3 left out",
              config(case_costs("lengths", 103, 2), 4, drop_last=True),
              "with drop_last a rank gets n // num_replicas indices and none repeats: the rest is left out, "
              "never padded"),
        _case(f"balanced: max/mean per-rank cost <= {BALANCE_TOL} on heavy-tailed costs, n=400, 4 ranks "
              f"(DistributedSampler: {ds_balance(heavy, 4):.2f})", config(heavy, 4), SAMPLER_HINT, balance=True),
        _case(f"balanced step by step: the k-th samples of all ranks cost about the same, per-step max/mean <= "
              f"{STEP_TOL} with one sample per step (DistributedSampler: {ds_step:.2f}), epochs 0 and 1",
              config(heavy, 4, epochs=(0, 1)), STEP_HINT, balance=True, steps=True),
        _case("set_epoch: epoch 1 gives a new order, epoch 0 again the same lists; each a balanced partition",
              config(heavy, 4, epochs=(0, 1, 0)),
              "your lists do not follow the epoch set last: each epoch needs its own order, and the same epoch the "
              "same lists",
              balance=True, differ=True),
        _case("shuffle=False: no random order, the same balanced lists in every epoch and for every seed (0, 7)",
              [config(heavy, 4, shuffle=False, epochs=(0, 5)), config(heavy, 4, shuffle=False, seed=7)],
              UNSHUFFLED_HINT.format(what="epoch"), balance=True, same=True),
        _case("fresh costs: log-normal, n=1001, 2 ranks, seed=7",
              config(case_costs("lognormal", 1001, 11), 2, seed=7, epochs=(0, 3)), **fresh),
        _case("fresh costs: capped Pareto, n=240, 3 ranks, drop_last=True",
              config(case_costs("pareto", 240, 5), 3, drop_last=True, epochs=(2, 4)), **fresh),
        _case("fresh costs: integer lengths with ties and zeros, n=515, 5 ranks, and bimodal, n=707, 7 ranks",
              [config(case_costs("lengths", 515, 8), 5, epochs=(0, 1)),
               config(case_costs("bimodal", 707, 9), 7, seed=3, epochs=(0, 1))], **fresh),
        _case("tiny data: n=5 on 8 ranks (drop_last False and True), n=1 on 1 rank, all costs zero",
              [config([0.0] * 5, 8, epochs=(0, 1)), config([0.0] * 5, 8, drop_last=True), config([0.0], 1)],
              **{**fresh, "differ": False}),
    ]


# -- train_uneven ---------------------------------------------------------------------
def _rank_batches(shard, batch_size: int, drop_last: bool = False) -> list:
    x, y = shard.tensors
    ends = range(0, len(x) - (batch_size - 1 if drop_last else 0), batch_size)
    return [(x[i:i + batch_size], y[i:i + batch_size]) for i in ends if i < len(x)]


def uneven_reference(lengths, epochs: int, batch_size: int, seed: int, bug: str = "") -> dict:
    """The weights of ``train_uneven``: at each step of an epoch, the sum of the mean-loss gradients of the
    ranks that still have a batch (zeros from the others) over the world size; an epoch ends when no rank
    has a batch left, and every rank starts the next one together.

    ``bug`` gives the weights of a known wrong answer: ``"active"`` (divided by the ranks still training),
    ``"sum"`` (a summed loss), ``"back_to_back"`` (each rank runs its epochs back to back), ``"first_out"``
    (the epoch ends when the first rank runs out), ``"stale"`` (a rank out of data adds the last averaged
    gradient instead of zeros), ``"drop_last"`` (the last, shorter batch dropped).
    """
    model = uneven_model(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    world = len(lengths)
    per_epoch = [_rank_batches(s, batch_size, bug == "drop_last") for s in uneven_shards(seed, lengths)]
    if bug == "back_to_back":
        plan = [[b for _ in range(epochs) for b in mine] for mine in per_epoch]
        rounds = [plan]
    else:
        rounds = [per_epoch] * epochs
    last = [torch.zeros_like(p) for p in model.parameters()]
    for batches in rounds:
        steps = (min if bug == "first_out" else max)(len(b) for b in batches)
        for k in range(steps):
            total = [torch.zeros_like(p) for p in model.parameters()]
            for r in range(world):
                if k < len(batches[r]):
                    model.zero_grad()
                    x, y = batches[r][k]
                    F.mse_loss(model(x), y, reduction="sum" if bug == "sum" else "mean").backward()
                    total = [s + p.grad for s, p in zip(total, model.parameters())]
                elif bug == "stale":
                    total = [s + g for s, g in zip(total, last)]
            active = sum(1 for b in batches if k < len(b))
            last = [s / (active if bug == "active" else world) for s in total]
            for p, g in zip(model.parameters(), last):
                p.grad = g.clone()
            optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)


UNEVEN_BUGS = {
    "active": "your weights average each step over the ranks that still have a batch: a rank out of data still "
              "counts, its zero gradient included, so the sum is divided by the full world size (Join's default)",
    "sum": "your weights match a summed loss: each rank's gradient must be that of the mean loss over its batch",
    "back_to_back": "your weights match ranks that run their epochs back to back: a rank with a short shard began "
                    "its next epoch while the others were still in this one; an epoch ends on every rank at the "
                    "step where no rank has a batch left, and the next starts together",
    "first_out": "your weights match an epoch that ends when the first rank runs out of data: the samples the "
                 "other ranks still had were never trained on; go on while any rank has a batch",
    "stale": "your weights match a rank out of data that adds the gradient it still holds from an earlier step: "
             "it must contribute zeros",
    "drop_last": "your weights match training without each shard's last, shorter batch: it counts as a batch",
}


def uneven_diagnosis(state: dict, scenario) -> str:
    """What a wrong ``train_uneven`` did, when its weights match a known wrong answer."""
    for bug, words in UNEVEN_BUGS.items():
        if same_state(state, uneven_reference(*scenario, bug=bug)):
            return words
    return ("each step's update must be -lr x (the sum over ranks of the gradient of the mean loss of this "
            "step's batch, zeros from a rank out of data) / world size, with the batches in the shard's order; "
            "no gradient of an earlier step may carry over")


BALANCE_TOL = 1.05  # max/mean of the ranks' total costs a balanced sampler must reach


STEP_TOL = 1.35  # per-step max/mean, one sample per step: the reference reaches <= 1.21, a rank's own shuffle >= 1.5


SAMPLER_HINT = ("your ranks' total costs are further apart than a greedy plan leaves them: it places the samples "
                "costliest first, each on the rank with the smallest total cost so far that still has room, so the "
                "costly ones are spread first and the cheap ones fill the gaps")


STEP_HINT = ("position k holds very different costs on different ranks, so each step waits for the costliest: "
             "the ranks' lists must stay aligned by cost, reordered by ONE permutation of positions shared by "
             "every rank (a seed with the rank in it shuffles each rank its own way)")


GLOBAL_HINT = ("the ranks' plans differ: your plan depends on something besides costs, seed and epoch, such as the "
               "global random state (which differs between processes) or the rank; every process must draw the "
               "same random numbers")


def config(costs, world, drop_last=False, shuffle=True, seed=0, epochs=(0,)):
    return {"costs": list(costs), "num_replicas": world, "drop_last": drop_last, "shuffle": shuffle,
            "seed": seed, "epochs": tuple(epochs)}


def case_costs(kind: str, n: int, seed: int) -> list:
    """Heavy-tailed costs of a few shapes (the notebook shows none of these)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "lognormal":
        return (torch.randn(n, generator=g, dtype=torch.float64) * 1.2).exp().tolist()
    if kind == "pareto":  # capped, so that a balanced partition exists
        return torch.rand(n, generator=g, dtype=torch.float64).pow(-1 / 1.8).clamp(max=25).tolist()
    if kind == "lengths":  # integer token counts: many ties, some empty samples
        return (torch.randn(n, generator=g) + 3.5).exp().round().clamp(0, 2048).long().tolist()
    if kind == "bimodal":  # mostly short, 10% long
        long = torch.rand(n, generator=g) < 0.1
        return torch.where(long, 30 + 10 * torch.rand(n, generator=g), 1 + torch.rand(n, generator=g)).tolist()
    raise ValueError(f"unknown cost kind {kind!r}")


def partition_problem(lists, lengths, n, world, drop_last) -> str:
    """Why ``lists`` (one per rank) is not a valid epoch, or '' when it is."""
    per = n // world if drop_last else math.ceil(n / world)
    for r, (lst, length) in enumerate(zip(lists, lengths)):
        if length != per:
            return f"len() of rank {r}'s sampler is {length}, expected {per} (n={n}, num_replicas={world}, " \
                   f"drop_last={drop_last})"
        if len(lst) != per:
            return f"rank {r} yields {len(lst)} indices, expected {per}: every rank needs the same number"
        bad = [i for i in lst if not 0 <= i < n]
        if bad:
            return f"rank {r} yields index {bad[0]}, outside 0..{n - 1}"
    flat = [i for lst in lists for i in lst]
    owners: dict[int, list] = {}
    for r, lst in enumerate(lists):
        for i in lst:
            owners.setdefault(i, []).append(r)
    missing = sorted(set(range(n)) - set(owners))
    if drop_last:
        twice = sorted(i for i, rs in owners.items() if len(rs) > 1)
        if twice:
            return f"index {twice[0]} is yielded {len(owners[twice[0]])} times (ranks {owners[twice[0]]}); " \
                   "with drop_last=True every index appears at most once"
        return ""
    if missing:
        return f"{len(missing)} index(es) on no rank, e.g. {missing[:5]}: together the ranks must cover every index"
    extra = len(flat) - n
    if extra != per * world - n:
        return f"{extra} repeated indices; only the padding ({per * world - n}) may repeat"
    return ""


def rank_balance(lists, costs) -> float:
    totals = [sum(costs[i] for i in lst) for lst in lists]
    mean = sum(totals) / len(totals)
    return max(totals) / mean if mean > 0 else 1.0


def ds_lists(n, world) -> list:
    return distributed_sampler_lists(n, world).tolist()


def ds_balance(costs, world) -> float:
    return rank_balance(ds_lists(len(costs), world), costs)


def judge(t, got, cfg, check_balance=True, steps=False, epochs_differ=False, hint=""):
    """Fail the case unless every epoch of ``got`` is a valid, balanced partition (step by step too);
    with ``cfg["shuffle"]`` False every epoch must give the same lists, else ``epochs_differ`` asks for
    a new order in each epoch."""
    if got[0] == "raised":
        t.fail(hint, "a working sampler", in_words(got, raised="your code raised "))
    res, n, world = got[1], len(cfg["costs"]), cfg["num_replicas"]
    if not all(res["is_sampler"]):
        t.fail("subclass torch.utils.data.Sampler", "a torch Sampler", "another type")
    for e, lists in res["epochs"]:
        problem = partition_problem(lists, res["len"], n, world, cfg["drop_last"])
        if problem:
            t.fail(GLOBAL_HINT if res.get("plans_differ") else hint,
                   "equal-length lists that together cover the indices once", f"epoch {e}: {problem}")
        if check_balance and rank_balance(lists, cfg["costs"]) > BALANCE_TOL:
            t.fail(f"max/mean of the ranks' total costs must be <= {BALANCE_TOL}; " + SAMPLER_HINT,
                   f"<= {BALANCE_TOL}", f"epoch {e}: {rank_balance(lists, cfg['costs']):.3f}")
        if steps and step_imbalance(lists, cfg["costs"], 1) > STEP_TOL:
            t.fail(f"per-step max/mean must be <= {STEP_TOL}; " + STEP_HINT, f"<= {STEP_TOL}",
                   f"epoch {e}: {step_imbalance(lists, cfg['costs'], 1):.3f}")
    by_epoch: dict = {}
    for e, lists in res["epochs"]:
        if by_epoch.setdefault(e, lists) != lists:
            t.fail("set_epoch(e) a second time gave other lists: your plan draws from random state that carries "
                   "over between calls; it may depend only on costs, seed and epoch",
                   f"epoch {e} twice: the same lists", "different lists the second time")
    if not cfg["shuffle"] and any(v != res["epochs"][0][1] for v in by_epoch.values()):
        t.fail(UNSHUFFLED_HINT.format(what="epoch"), "the same lists in every epoch", "different lists in another epoch")
    if epochs_differ and len(by_epoch) > 1 and all(v == res["epochs"][0][1] for v in by_epoch.values()):
        t.fail("every epoch gave the same lists: a new order each epoch needs the epoch in the randomness",
               "a different order in each epoch", "the same lists in every epoch")

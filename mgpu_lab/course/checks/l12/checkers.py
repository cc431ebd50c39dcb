"""Checks of lesson 12 (pipeline schedules): one_f_one_b, bubble, pipeline_train.

``one_f_one_b`` runs in 4 real ranks (gloo): every rank's order is replayed with
``isend`` and blocking receives (bounded by :data:`.ranks.RECV_TIMEOUT`, so a
deadlock is reported with where each rank waits), every scenario in one launch;
other depths are judged without ranks on the same rules. ``bubble`` is judged in
one process against every schedule's order replayed with the given times
(:func:`.judges.reference_bubble`). ``pipeline_train`` runs in 2 real ranks,
every schedule in one launch, against one process. What runs in the fresh
process or the ranks is :mod:`.ranks`; :mod:`.judges` turns evidence into words.
"""
from __future__ import annotations

from .._core import exercise
from ..sim.scenarios import launch_scenarios
from . import ranks as R
from .judges import (ORDER_HINT, bubble_problem, bubble_problem_of_orders, in_flight_problem, orders_problem,
                     ran_problem, replay_problem, returns_problem, state_problem)

ORDER_REFERENCES = ("mgpu_lab.parallel.pp_orders:orders",
                    "torch.distributed.pipelining.schedules:_get_1f1b_rank_ops",
                    "torch.distributed.pipelining.schedules:ScheduleInterleaved1F1B._calculate_single_rank_operations")
ORDER_TIMEOUT = 60.0  # seconds for the launch; a deadlock ends after RECV_TIMEOUT on its own
MAIN = [(4, 8), (4, 4), (4, 6)]
FEW = [(4, 2), (4, 1)]
FLIGHT_HINT = ("a rank must run a backward as soon as n_stages - rank micro-batches are alive (or all of them, "
               "when there are fewer): 1F1B's memory bound is what it has over GPipe")
IDLE_HINT = ("1F1B keeps GPipe's bubble while bounding the memory: a rank that warms up with fewer forwards than "
             "n_stages - rank - 1 waits for gradients when it could be working")
DEPTHS = [(p, m) for p in (2, 3, 5, 8) for m in (1, 2, 3, 7, 16)]
CALLS = [(r, p, m) for p, m in DEPTHS for r in range(p)]


SAID = "the hint above says what a 1F1B order needs"


def _main_cases(t, evidence) -> bool:
    """The replay, gradient and memory cases of the main scenarios; True when the replay case gave ORDER_HINT.

    A scenario whose replay did not run to the end is reported once, in the replay case; the later cases
    judge the scenarios that ran and name the others as not judged."""
    ran, gave_hint = [], False
    with t.case("replayed on 4 real ranks with 8, 4 and 6 micro-batches (isend, blocking recv): every order runs "
                "to the end, each message the micro-batch its receiver expects", hint=ORDER_HINT):
        if evidence is None:
            t.fail("not judged: the orders could not be replayed", got="no replay")
        stuck = []
        for (p, m), per_rank in zip(MAIN, evidence):
            problem = replay_problem(per_rank, f"{p} stages, {m} micro-batches")
            if problem:
                stuck.append(problem)
            else:
                ran.append(((p, m), per_rank))
        if stuck:
            gave_hint = any("deadlock" in problem for problem in stuck)
            t.fail(ORDER_HINT if gave_hint else "", "every order runs to the end", "; ".join(stuck))
    not_run = ("not judged: no scenario's replay ran to the end (the replay's case says where each rank waits)"
               if evidence is not None else "not judged: the orders could not be replayed")
    with t.case("the replay's gradients equal one process's (the whole batch's mean loss)",
                hint="every micro-batch's forward and backward must run once, in an order both neighbours share"):
        if not ran:
            t.fail(SAID if gave_hint else "", "one process's gradients", not_run)
        for (p, m), per_rank in ran:
            if not all(ev["same"] for ev in per_rank):
                t.fail("", "one process's gradients", f"{p} stages, {m} micro-batches: other gradients")
    with t.case("at most n_stages - rank micro-batches alive at once on each rank (GPipe holds all of them), and "
                "no more idle than GPipe's bubble (p-1)/(m+p-1) when replayed with equal times"):
        if not ran:
            t.fail(SAID if gave_hint else "", "<= n_stages - rank", not_run)
        for (p, m), per_rank in ran:
            problem = in_flight_problem(per_rank, p, m)
            if problem:
                t.fail(FLIGHT_HINT, f"<= {p} - rank", problem)
            problem = bubble_problem_of_orders({r: ev["order"] for r, ev in enumerate(per_rank)}, p, m)
            if problem:
                t.fail(IDLE_HINT, "GPipe's bubble", problem)
    return gave_hint


@exercise("12.one_f_one_b", points=6, description="one_f_one_b(rank, n_stages, n_micro) -> list[str]: one rank's "
          "actions under 1F1B ('F3', 'B1', ...); replayed on real ranks: no deadlock, one process's gradients, at "
          "most n_stages - rank micro-batches alive", references=ORDER_REFERENCES)
def _one_f_one_b(t, one_f_one_b):
    """One launch of 4 ranks for every replayed scenario, one process for the other depths.

    Catches: GPipe's order (too many alive), a warm-up of n_stages (or one more, or one fewer: deadlock),
    no shrink with fewer micro-batches than stages, backwards out of order (the neighbours disagree),
    backward before forward, malformed labels, torch's own order.
    """
    evidence, outs = None, {}
    with t.case("4 stages, 8 micro-batches: each rank's order holds F0..F7 and B0..B7 once each, each B after "
                "its F", hint="a list of strings 'F<i>' and 'B<i>', micro-batches numbered from 0"):
        got = t.ranks(R.probe_orders, 4, one_f_one_b, MAIN + FEW, CALLS, timeout=ORDER_TIMEOUT)
        evidence = [list(per) for per in zip(*(r["scenarios"] for r in got))]
        outs = dict(zip(CALLS, got[0]["calls"]))
        problem = evidence[0][0]["problem"]
        if problem:
            t.fail("", "F0..F7 and B0..B7, each once", problem)
    gave_hint = _main_cases(t, evidence[:len(MAIN)] if evidence else None)
    with t.case("fewer micro-batches than stages (4 stages, 2 and 1 micro-batches): the warm-up shrinks to fit; "
                "the replay runs to the end with one process's gradients, within the bound"):
        if evidence is None:
            t.fail("not judged: the first case did not finish", got="no replay")
        for (p, m), per_rank in zip(FEW, evidence[len(MAIN):]):
            problem = (replay_problem(per_rank, f"{p} stages, {m} micro-batches")
                       or ("" if all(ev["same"] for ev in per_rank) else "other gradients than one process's")
                       or in_flight_problem(per_rank, p, m))
            if problem:
                t.fail(_few_hint(problem, gave_hint), "runs, one process's gradients, within the bound", problem)
    with t.case("2, 3, 5 and 8 stages with 1 to 16 micro-batches: well formed, neighbours agree, no deadlock, "
                "within the bound, GPipe's bubble (judged without ranks)", hidden=True):
        if evidence is None:
            t.fail("not judged: the first case did not finish", got="no orders")
        for p, m in DEPTHS:
            got = {r: outs[r, p, m][1] if outs[r, p, m][0] == "ok" else outs[r, p, m] for r in range(p)}
            problem = orders_problem(got, p, m)
            if problem:
                t.fail("", "a 1F1B order on every rank", problem)


def _few_hint(problem: str, gave_hint: bool) -> str:
    """The hint for a scenario with fewer micro-batches than stages, by what went wrong."""
    if "alive at once" in problem:
        return FLIGHT_HINT
    if "deadlock" in problem:
        return SAID if gave_hint else ORDER_HINT
    if "micro-batch(es)" in problem:  # an order with actions of micro-batches that do not exist, or missing ones
        return "with fewer micro-batches than stages a rank cannot forward more micro-batches than exist"
    return "every micro-batch's forward and backward must run once, in an order both neighbours share"


# -- bubble ----------------------------------------------------------------------------
_VISIBLE = [
    ("GPipe and 1F1B: 4 stages, 8 micro-batches, t_f=1, t_b=2: (p-1)/(m+p-1) for both; 2 stages, 1 micro-batch",
     [("gpipe", 4, 8, 1.0, 2.0, 0.0, 1), ("1f1b", 4, 8, 1.0, 2.0, 0.0, 1), ("1f1b", 2, 1, 1.0, 1.0, 0.0, 1),
      ("1f1b", 4, 2, 1.0, 1.0, 0.5, 1)]),
    ("interleaved, v=2 and v=3, micro-batches in whole rounds of p: (p-1)/(v*m+p-1)",
     [("interleaved", 4, 8, 1.0, 2.0, 0.0, 2), ("interleaved", 2, 4, 1.0, 1.0, 0.0, 3)]),
    ("interleaved with fewer micro-batches than stages (4 stages, 2 micro-batches, v=2): the formula does not "
     "hold; the schedule's own order does", [("interleaved", 4, 2, 1.0, 1.0, 0.0, 2)]),
    ("ZBV, t_f = t_b = t_w = 1: 2 stages x 4 micro-batches, 4 x 8 (two stages per rank in a V; weight gradients "
     "fill the bubble)", [("zbv", 2, 4, 1.0, 1.0, 1.0, 2), ("zbv", 4, 8, 1.0, 1.0, 1.0, 2)]),
    ("ZBV with unequal times (t_f=1, t_b=1.5, t_w=0.5) and with fewer micro-batches than 2p-1",
     [("zbv", 4, 12, 1.0, 1.5, 0.5, 2), ("zbv", 4, 3, 1.0, 1.0, 1.0, 2)]),
]


def _grid() -> list:
    import torch

    g = torch.Generator().manual_seed(12)
    out = []
    for schedule, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3), ("zbv", 2)):
        for p in (2, 3, 4):
            m = p * int(torch.randint(1, 4, (1,), generator=g)) if schedule == "interleaved" else \
                int(torch.randint(1, 13, (1,), generator=g))
            t_f, t_b, t_w = (0.5 + torch.rand(3, generator=g, dtype=torch.float64)).tolist()
            out.append((schedule, p, m, round(t_f, 3), round(t_b, 3), round(t_w, 3), v))
    return out


@exercise("12.bubble", points=6, description="bubble(schedule, n_stages, n_micro, t_f, t_b, t_w=0.0, virtual=1) "
          "-> float: the idle fraction of 'gpipe', '1f1b', 'interleaved' or 'zbv' with these per-stage times",
          references=("mgpu_lab.course.checks.l12.judges:reference_bubble",
                      "mgpu_lab.parallel.pp_orders:simulate", "mgpu_lab.parallel.pp_orders:formula",
                      "torch.distributed.pipelining.schedules:_simulate_comms_compute"))
def _bubble(t, bubble):
    """Every call in one process, judged against the schedules replayed (:func:`.judges.reference_bubble`).

    Catches: the closed formula for every schedule, interleaved without v, interleaved's formula with
    fewer micro-batches than stages, ZBV as 1F1B, ZBV without the split, a percentage.
    """
    grid = _grid()
    calls = [args for _, cases in _VISIBLE for args in cases] + grid
    results = {}
    for name, cases in _VISIBLE:
        with t.case(name):
            if not results:
                results.update(zip(calls, t.call(R.evaluate, bubble, calls)))
            for args in cases:
                problem = bubble_problem(args, results[args])
                if problem:
                    t.fail(*problem)
    with t.case("15 more: every schedule, 2 to 4 stages, random times and micro-batches", hidden=True):
        if not results:
            t.fail("the first case did not finish")
        for args in grid:
            problem = bubble_problem(args, results[args])
            if problem:
                t.fail(*problem)


# -- pipeline_train --------------------------------------------------------------------
TRAIN_REFERENCES = ("mgpu_lab.parallel.pp_train:train", "mgpu_lab.parallel.pp_train:_build",
                    "mgpu_lab.parallel.pp_train:split_layers", "mgpu_lab.parallel.pp_train:stage_ids",
                    "mgpu_lab.parallel.pp_train:make_schedule", "mgpu_lab.parallel.pp_train:_gather_state")
TRAIN_SCENARIOS = [("small", "gpipe", 4, 0.1), ("small", "1f1b", 4, 0.1), ("small", "interleaved", 2, 0.1),
                   ("small", "zbv", 4, 0.1), ("deep", "1f1b", 2, 0.05), ("deep", "zbv", 2, 0.05)]
# Seconds for the launch: the six scenarios take about a second on 2 idle cores, so 20 s is a wide margin for a
# loaded grader; a pipeline whose stages never meet (e.g. ZBV's stages in a loop) waits in torch's receive, with
# no timeout of its own, until this ends the launch, so the learner waits this long for the verdict.
TRAIN_TIMEOUT = 20.0


@exercise("12.pipeline_train", points=6, description="pipeline_train(model_fn, n_stages, schedule, n_micro, "
          "batches, lr) -> dict | None: train with torch.distributed.pipelining and the named schedule; rank 0 "
          "returns the whole model's state_dict, equal to one process's", references=TRAIN_REFERENCES)
def _pipeline_train(t, pipeline_train):
    """One launch of 2 ranks, every schedule in turn, against one process (:func:`.ranks.reference_state`).

    Catches: no gather (rank 0's stages only), a state on every rank, the wrong split (stages of the
    wrong length, or ZBV's stages in a loop), gradients not cleared, the sum of the micro-batch losses.
    """
    evidence = launch_scenarios(t, R.probe_train, 2, pipeline_train, TRAIN_SCENARIOS, timeout=TRAIN_TIMEOUT)
    for k, (name, hint) in enumerate((
            ("GPipe, 2 ranks, a Sequential of 8 modules, 4 micro-batches, 3 steps: rank 0 returns the whole "
             "model's state_dict and the weights equal one process's; the other rank returns None",
             "stage k holds the k-th of n_stages equal runs of consecutive layers (the stages' outputs must be "
             "the next stages' inputs), trained with the named schedule"),
            ("1F1B: the same as one process", ""),
            ("interleaved 1F1B, two stages per rank (stages 0, 2 on rank 0; 1, 3 on rank 1), 2 micro-batches: "
             "the same as one process", "interleaved: the model cut into 2 x n_stages runs of layers, rank r "
             "holding stages r and r + n_stages"),
            ("ZBV, two stages per rank in a V (rank 0: stages 0 and 3; rank 1: 1 and 2): the same as one process",
             "ZBV: the model cut into 2 x n_stages runs of layers, rank r holding stages r and 2 x n_stages - 1 - r"),
    )):
        with t.case(name, hint=hint):
            _judge_train(t, _returned(_scenario(t, evidence, k)), TRAIN_SCENARIOS[k])
    with t.case("8 layers with 1F1B and ZBV, 2 micro-batches, lr 0.05: the same as one process", hidden=True):
        for k in (4, 5):
            _judge_train(t, _returned(_scenario(t, evidence, k)), TRAIN_SCENARIOS[k])
    with t.case("the schedule really ran on the ranks: in every schedule above, each rank built torch's schedule "
                "of that name with its stages, each stage ran every micro-batch's forward and backward once per "
                "step, the ranks sent each other messages, and the weights of every stage changed",
                hint="train with torch.distributed.pipelining's schedule of the named kind on every rank, each rank "
                     "running its own stages; the check records what torch's stages and schedules did"):
        if evidence.complete < 4:
            t.fail("every schedule must first run to the end (the cases above say where one stopped)",
                   "torch's schedule run on every rank", "not judged: not every schedule ran to the end")
        for k in range(4):
            per_rank = evidence.get(t, k)
            _, schedule, n_micro, _ = TRAIN_SCENARIOS[k]
            problem = ran_problem([r["ran"] for r in per_rank], schedule, n_micro, len(R.train_batches("small")))
            if problem:
                t.fail("", "torch's schedule run on every rank", f"{schedule}: {problem}")
        per_rank = _returned(evidence.get(t, 0))
        problem = returns_problem(per_rank)
        if problem:
            t.fail("", "rank 0: the state_dict", problem)
        ref0 = R.train_model("small").state_dict()
        unchanged = [k for k, v in per_rank[0][1].items() if k in ref0 and v.shape == ref0[k].shape
                     and bool((v == ref0[k]).all())]
        if unchanged or len(per_rank[0][1]) < len(ref0):
            t.fail("every stage must train", "every tensor changed", f"unchanged or missing: {unchanged[:4]}")


def _scenario(t, evidence, k: int) -> list:
    """Scenario ``k``'s evidence; a rank's stages given to a schedule out of order is said in words."""
    from mgpu_lab.launcher.errors import LaunchError

    try:
        return evidence.get(t, k)
    except LaunchError as exc:
        said = str(exc).splitlines()[0]
        if "increasing order of their index" in said:
            t.fail("a schedule of several stages per rank takes the rank's stages in increasing order of their "
                   "index", "each rank's stages in increasing order", said)
        raise


def _returned(per_rank: list) -> list:
    return [r["returned"] for r in per_rank]


def _judge_train(t, per_rank, scenario):
    kind, schedule, n_micro, lr = scenario
    problem = returns_problem(per_rank)
    if problem:
        t.fail("rank 0 gathers the weights and returns them; every other rank returns None",
               "rank 0: the whole model's state_dict; every other rank: None", problem)
    hint, problem = state_problem(per_rank[0][1], R.reference_state(kind, lr), n_micro, lr,
                                  scaled=lambda c: R.reference_state(kind, lr * c))
    if problem:
        t.fail(hint, "one process's weights", f"{schedule}: {problem}")

"""Checks of lesson 12 (pipeline schedules): one_f_one_b, bubble, run_schedule.

``one_f_one_b`` runs in 4 real ranks (gloo): every rank's order is replayed with
``isend`` and blocking receives (bounded by :data:`.ranks.RECV_TIMEOUT`, so a
deadlock is reported with where each rank waits), every scenario in one launch;
other depths are judged without ranks on the same rules. ``bubble`` is judged in
one process against every schedule's order replayed with the given times
(:func:`.judges.reference_bubble`). ``run_schedule`` runs in 2 and in 4 real
ranks, one launch each with every scenario inside (named schedules and random
orders made at check time), against one process, its messages recorded. What runs in the fresh
process or the ranks is :mod:`.ranks`; :mod:`.judges` turns evidence into words.
"""
from __future__ import annotations

from .._core import exercise
from ..sim.scenarios import launch_scenarios, Scenarios
from . import ranks as R
from .judges import (ORDER_HINT, bubble_problem, bubble_problem_of_orders, in_flight_problem, orders_problem,
                     replay_problem)

ORDER_REFERENCES = ("mgpu_lab.pipelining.orders:orders",
                    "torch.distributed.pipelining.schedules:_get_1f1b_rank_ops",
                    "torch.distributed.pipelining.schedules:ScheduleInterleaved1F1B._calculate_single_rank_operations")
ORDER_TIMEOUT = 60.0  # seconds for the launch; a deadlock ends after RECV_TIMEOUT on its own
MAIN = [(4, 8), (4, 4), (4, 6)]
FEW = [(4, 2), (4, 1)]
FLIGHT_HINT = ("your order keeps more micro-batches alive on a rank than 1F1B's bound allows (also when there are fewer "
               "micro-batches than stages): that bound is what 1F1B has over GPipe")
IDLE_HINT = ("1F1B keeps GPipe's bubble while bounding the memory: replayed with equal times, your order leaves a rank "
             "waiting for a gradient at moments when it could still run a forward within its memory bound")
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
                      "mgpu_lab.pipelining.orders:simulate", "mgpu_lab.pipelining.orders:formula",
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


# -- run_schedule ----------------------------------------------------------------------
SCHEDULE_REFERENCES = ("torch.distributed.pipelining.stage:PipelineStage",
                       "torch.distributed.pipelining.schedules:PipelineScheduleSingle",
                       "torch.distributed.pipelining.schedules:PipelineScheduleMulti",
                       "mgpu_lab.pipelining.train:train")
# Seconds for each launch: a right answer judges every scenario of a world size in a few seconds; a deadlock ends
# at once (the recorder's deadlock finder), so only a hang outside sends and receives waits this long.
SCHEDULE_TIMEOUT = 60.0
NAMED = [("gpipe", "one"), ("1f1b", "one"), ("interleaved", "loop"), ("zbv", "v")]
N_MICRO = {2: 4, 4: 4}
RANDOM = [("one", 3), ("loop", 3), ("v", 3)]
EXTRA = {2: [("gpipe", "one", 1)], 4: [("1f1b", "one", 2)]}  # one micro-batch; fewer micro-batches than ranks

WAITS = ("every receive needs its send on the other rank, reached in an order both ranks' actions allow: a send "
         "that waits for its receiver (a blocking send) stops the sender while its receiver may be waiting for "
         "something the sender has yet to send")
DIED_HINT = ("a rank's process died without a Python error: gloo aborts a process that receives a message larger "
             "than the tensor it receives into, e.g. when a receive is matched with a message meant for another one")
ORDER_WORDS = ("each receive must get the message its action needs, whatever order the sender sent its messages in: "
               "between two ranks, the actions may need messages in another order than they were sent")
SHARED_WORDS = ("each micro-batch's input is its own tensor: a receive into the tensor another micro-batch used as its "
                "input overwrites what autograd saved for that one's backward, and the input's .grad adds up over "
                "the micro-batches")

UNWAITED_WORDS = ("a non-blocking receive returns at once, whether or not its message has arrived: until its request "
                  "says the receive is done, the tensor it receives into may hold what was in that memory before, "
                  "and which one a stage reads depends on timing (on a GPU the receive runs beside the computation)")


def schedule_scenarios(n_ranks: int, rng) -> list:
    """The scenarios of one world size: the named schedules, random orders (each with a receiver that needs some
    messages out of the order they were sent, when one is found), then the hidden extras."""
    from .judges import out_of_order, placements, random_actions, schedule_actions

    where = placements(n_ranks)
    out = [(where[p], schedule_actions(name, n_ranks, N_MICRO[n_ranks]), N_MICRO[n_ranks], "l1" if k == 1 else "mse")
           for k, (name, p) in enumerate(NAMED)]
    for p, m in RANDOM:
        for _ in range(200):
            actions = random_actions(where[p], m, rng)
            if out_of_order(where[p], actions):
                break
        out.append((where[p], actions, m, "mse"))
    out += [(where[p], schedule_actions(name, n_ranks, m), m, "mse") for name, p, m in EXTRA[n_ranks]]
    return out


def _schedule_evidence(t, runs, n_ranks: int, k: int) -> list:
    """Scenario ``k`` of the ``n_ranks`` launch, every rank's evidence; a raise there fails the case in words."""
    from mgpu_lab.launcher.errors import LaunchError, LaunchTimeout

    from .._core import _error_text

    evidence, _ = runs[n_ranks]
    try:
        return evidence.get(t, k)
    except LaunchTimeout:
        raise
    except LaunchError as exc:
        if exc.exc_type in ("NotImplementedError", "ReferenceCalled"):
            raise
        said = _error_text(exc)
        hint = WAITS if exc.exc_type == "Deadlock" else DIED_HINT if not exc.exc_type else \
            "your code raised in a rank: the error and its line are above"
        t.fail(hint, got=said)


def _what(scenario) -> str:
    placement, actions, n_micro, _ = scenario
    return f"{len(set(placement))} ranks, stages on ranks {placement}, {n_micro} micro-batches"


def _judge_grads(t, runs, n_ranks: int, k: int) -> None:
    from .judges import grads_problem, ran_problem

    per_rank = _schedule_evidence(t, runs, n_ranks, k)
    scenario = runs[n_ranks][1][k]
    unwaited = next(((r, ev["unwaited"][0]) for r, ev in enumerate(per_rank) if ev["unwaited"]), None)
    if unwaited:  # its gradients are right only when the message won the race: not evidence of a right answer
        rank, (kind, stage, i) = unwaited
        t.fail(UNWAITED_WORDS, "one process's gradients",
               f"{_what(scenario)}: rank {rank}'s {'forward' if kind == 'F' else 'backward'} of micro-batch {i} on "
               f"stage {stage} started from the tensor an irecv was receiving into, before that receive was "
               "waited for")
    hint, got = grads_problem(per_rank, scenario[2])
    if got:
        shared = next((ev["shared"] for ev in per_rank if ev["shared"]), None)
        if shared:
            stage, i, j = shared[0]
            hint = SHARED_WORDS
            got += f"; stage {stage}'s forward of micro-batch {i} received into the input tensor of micro-batch {j}"
        elif ran_problem(per_rank, scenario[1]):
            hint = ORDER_WORDS
            got += f"; {ran_problem(per_rank, scenario[1])}"
        t.fail(hint, "one process's gradients", f"{_what(scenario)}: {got}")


def _each(t, runs, judge) -> None:
    """``judge(per_rank, scenario)`` -> problem, on every scenario of both launches that ran to the end; fail at
    the first problem, or, when some scenario did not run to the end, saying it was not judged."""
    for n_ranks, (evidence, scenarios) in runs.items():
        for k, scenario in enumerate(scenarios[:evidence.complete]):
            problem = judge(evidence.get(t, k), scenario)
            if problem:
                t.fail("", "", f"{_what(scenario)}: {problem}")
    stopped = [f"{n_ranks} ranks: {len(scenarios) - evidence.complete} of {len(scenarios)}"
               for n_ranks, (evidence, scenarios) in runs.items() if evidence.complete < len(scenarios)]
    if stopped:
        t.fail("", "every scenario judged", f"not judged: scenarios that did not run to the end ({'; '.join(stopped)}"
               "; the case 'no deadlock' says why)")


def _launch_runs(t, run_schedule) -> dict:
    """``{n_ranks: (evidence, scenarios)}`` for 2 and 4 ranks, new random orders each time; the 4 ranks are not
    launched when the 2 stopped early (their cases then say not run)."""
    import random

    rng = random.Random(random.SystemRandom().randrange(2 ** 32))  # orders no one has seen before
    runs = {}
    for n_ranks in (2, 4):
        scenarios = schedule_scenarios(n_ranks, rng)
        if runs and runs[2][0].complete < len(runs[2][1]):
            runs[n_ranks] = (Scenarios([[] for _ in range(n_ranks)]), scenarios)
            continue
        runs[n_ranks] = (launch_scenarios(t, R.probe_schedule, n_ranks, run_schedule, scenarios,
                                          timeout=SCHEDULE_TIMEOUT), scenarios)
    return runs


@exercise("12.run_schedule", points=12, description="run_schedule(stages, placement, actions, inputs, targets, "
          "loss_fn) -> float | None: run this rank's forwards and backwards of a pipeline in the given order, on real "
          "ranks; one process's gradients, the mean loss, no deadlock, activations freed, one message each",
          references=SCHEDULE_REFERENCES)
def _run_schedule(t, run_schedule):
    """One launch of 2 ranks and one of 4 (not made when the 2 ranks stopped early), every scenario of each
    inside (:func:`.ranks.probe_schedule`).

    Catches: blocking sends (a deadlock, found by the recorder), messages matched by their order (the wrong
    micro-batch, or a rank aborted by a larger message), one receive buffer for every micro-batch, a non-blocking
    receive read before it was waited for (recorded: what it reads depends on timing), activations
    kept after their backward, losses summed, a loss never divided, the activations passed within a rank with
    their graph, torch's own pipelining.
    """
    from .judges import finished_problem, held_problem, loss_problem, messages_problem, ran_problem

    runs = _launch_runs(t, run_schedule)
    names = {"gpipe": "GPipe (every forward, then every backward)", "1f1b": "1F1B",
             "interleaved": "interleaved 1F1B: two stages per rank in a loop (rank r holds stages r and r + p)",
             "zbv": "a V: two stages per rank, rank r holds stages r and 2p - 1 - r, so the turn at the bottom "
                    "(stages p - 1 and p) stays on one rank"}
    for k, (name, _) in enumerate(NAMED):
        with t.case(f"{names[name]}, on 2 and 4 ranks: every stage's gradients equal one process's over the whole "
                    "batch", hint=WAITS if k == 1 else ""):
            for n_ranks in (2, 4):
                _judge_grads(t, runs, n_ranks, k)
    for n_ranks in (2, 4):
        with t.case(f"orders the lesson never shows, on {n_ranks} ranks: random orders that respect the dependencies "
                    "(one stage per rank, a loop, a V), where a receiver needs some messages in another order than "
                    "they were sent: one process's gradients"):
            for k in range(len(NAMED), len(NAMED) + len(RANDOM)):
                _judge_grads(t, runs, n_ranks, k)
    with t.case("no deadlock: every scenario on 2 and on 4 ranks ran to the end, every rank's stages running all its "
                "actions and the rank sending its messages (a deadlock is found and reported while it happens)",
                hint=WAITS):
        for n_ranks, (evidence, scenarios) in runs.items():
            if evidence.complete < len(scenarios):
                _schedule_evidence(t, runs, n_ranks, evidence.complete)
        _each(t, runs, lambda per_rank, sc: finished_problem(per_rank, sc[0], sc[1]))
    with t.case("the loss: the last stage's rank returns the mean loss over the micro-batches, a float, one "
                "process's loss over the whole batch; every other rank returns None",
                hint="the whole batch's loss is the mean of the micro-batches' losses when they are equal in size"):
        _each(t, runs, lambda per_rank, sc: loss_problem(per_rank, sc[0], sc[2]))
    with t.case("in the given order: each rank's stages ran its actions in the order of `actions`, each forward on "
                "the micro-batch its action names (recorded by the stages)", hint=ORDER_WORDS):
        _each(t, runs, lambda per_rank, sc: ran_problem(per_rank, sc[1]))
    with t.case("memory: at every forward, each rank held the activations (inputs, outputs, losses) of exactly as "
                "many micro-batches as its order implies: forwards run minus backwards run (recorded)",
                hint="a micro-batch's activations are needed from its forward until its backward, and no longer: "
                     "whatever still references them afterwards (a dict, a list of losses, a send in progress) "
                     "keeps them in memory"):
        _each(t, runs, lambda per_rank, sc: held_problem(per_rank, sc[1]))
    with t.case("messages: one per activation and per gradient that crosses ranks (and at most one per boundary to "
                "tell its shape), none between stages of one rank (recorded)",
                hint="a tensor that crosses ranks travels once; a stage's neighbour on the same rank needs no message"):
        _each(t, runs, lambda per_rank, sc: messages_problem(per_rank, sc[0], sc[1]))
    with t.case("one micro-batch (GPipe, 2 ranks) and fewer micro-batches than ranks (1F1B, 2 on 4 ranks): "
                "one process's gradients and loss", hidden=True):
        for n_ranks in (2, 4):
            k = len(runs[n_ranks][1]) - 1
            _judge_grads(t, runs, n_ranks, k)
            problem = loss_problem(_schedule_evidence(t, runs, n_ranks, k), runs[n_ranks][1][k][0],
                                   runs[n_ranks][1][k][2])
            if problem:
                t.fail("", "the mean loss", problem)

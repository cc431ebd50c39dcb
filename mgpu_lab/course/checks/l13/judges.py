"""Lesson 13's verdicts: the evidence of :mod:`.ranks`, in the words of each case.

:func:`reference_exposed_comm` is the reference of ``13.exposed_comm``. A trace recorded from real
ranks on a busy machine is never the same twice, so every answer is judged against the
reference computed on the very trace the answer read; when an answer is wrong, the known
wrong readings of that trace (:data:`WRONG`) are computed too, and a match names the bug.
"""
from __future__ import annotations

import statistics
from collections import defaultdict

PREFIXES = ("c10d::", "gloo:", "nccl:")


# -- exposed_comm: the reference and the known wrong readings -------------------------------------
def _union(spans) -> list:
    out: list = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _minus(spans, holes) -> list:
    """The parts of ``spans`` (united) outside ``holes``."""
    out, holes = [], _union(holes)
    for a, b in _union(spans):
        cur = a
        for h0, h1 in holes:
            if h1 <= cur or h0 >= b:
                continue
            if h0 > cur:
                out.append([cur, h0])
            cur = max(cur, h1)
        if cur < b:
            out.append([cur, b])
    return out


def _length(spans) -> float:
    return sum(b - a for a, b in _union(spans))


def busiest(events) -> object:
    time: dict = defaultdict(float)
    for e in events:
        if e.get("cat") == "cpu_op":
            time[e["tid"]] += e["dur"]
    return max(time, key=time.get) if time else None


def reference_exposed_comm(trace: dict, rank_thread=None, wrong: str | None = None) -> float:
    """Milliseconds of communication in ``trace`` that the main thread's computing does not hide.

    Communication: complete events named ``c10d::...``, ``gloo:...`` or ``nccl:...``, on any thread.
    The main thread computes while it is inside an operator (category ``cpu_op``) and not inside a
    communication call. ``wrong`` names one of :data:`WRONG`'s readings instead.
    """
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    is_comm = lambda e: str(e.get("name", "")).startswith(PREFIXES)  # noqa: E731
    if rank_thread is None or wrong == "ignores rank_thread":
        rank_thread = busiest(events)
    span = lambda e: (e["ts"], e["ts"] + e["dur"])  # noqa: E731
    comm = [span(e) for e in events if is_comm(e) and (wrong != "c10d only" or e["name"].startswith("c10d::"))]
    if wrong == "sum":
        return sum(b - a for a, b in comm) / 1e3
    compute_kinds = ("cpu_op", "user_annotation") if wrong == "annotations" else ("cpu_op",)
    ops = [span(e) for e in events if (e["tid"] == rank_thread or wrong == "all threads") and not is_comm(e)
           and e.get("cat") in compute_kinds]
    calls = [span(e) for e in events if e["tid"] == rank_thread and is_comm(e)]
    busy = ops if wrong == "calls as compute" else _minus(ops, calls)
    if wrong == "per event":
        return sum(_length(_minus([c], busy)) for c in comm) / 1e3
    ms = _length(_minus(comm, busy)) / 1e3
    return ms * 1e3 if wrong == "microseconds" else ms


#: Known wrong readings of a trace, and what to tell an answer that gives one.
WRONG = {
    "sum": "you added up the durations of the communication events: time the main thread spent computing while "
           "a collective ran is hidden, not exposed",
    "per event": "collectives in flight at the same time (on gloo's threads, or the c10d call and the backend's "
                 "work) were counted once each: exposed time is wall time",
    "all threads": "operators of other threads (here a helper thread) hid communication: only the main thread's "
                   "computing, the training loop's, hides it",
    "annotations": "labels (record_function, ProfilerStep#, the backend's user_annotation events) counted as "
                   "computing: they enclose the waits too; only operators (category cpu_op) compute",
    "calls as compute": "the operators that enclose a collective call (autograd's evaluate_function running DDP's "
                        "hook) counted as computing while the thread was inside the c10d:: call: the time inside a "
                        "communication call is not computing",
    "c10d only": "only the c10d:: calls counted as communication: the backend's own events (gloo:..., nccl:...) "
                 "on its threads are where the data moves",
    "microseconds": "the trace's ts and dur are microseconds: the answer is in milliseconds",
    "ignores rank_thread": "rank_thread was ignored: the thread it names is the main thread; the busiest thread is "
                           "only the default",
}


def diagnose(trace: dict, thread, got: float) -> str:
    """Name the known wrong readings ``got`` matches on this trace (all of them, when several give the same
    number), or say what a right reading is."""
    right = reference_exposed_comm(trace, thread)
    matches = [words for name, words in WRONG.items()
               if abs((value := reference_exposed_comm(trace, thread, wrong=name)) - got) <= 1e-6 + 1e-7 * abs(value)
               and abs(value - right) > 1e-6]
    if matches:
        return matches[0] if len(matches) == 1 else "your number fits several known mistakes: " + "; or ".join(matches)
    return ("exposed time is the union of the communication intervals (every thread) minus the time the main "
            "thread spends inside an operator that is not a communication call")


def _once(said: set | None, hint: str) -> str:
    """``hint`` the first time a check gives it; after that, a pointer to the case above that said it."""
    if said is None:
        return hint
    if hint in said:
        return "the same reading as in a failed case above: its hint says what it does"
    said.add(hint)
    return hint


def exposed_case(t, evidence, names, thread_kind=None, said: set | None = None) -> None:
    """Fail unless every rank's answer on the traces ``names`` equals the reference on the same trace.

    A reading of 0 ms is judged like any other (a busy helper thread can hide everything), but a case
    whose every reading is 0 has no evidence and fails: an answer that returns 0 must not pass it.
    ``said`` holds the hints earlier cases of the same check gave: a hint is given once, later cases
    point back to it.
    """
    if evidence is None:
        t.fail("the ranks did not finish")
    wants = []
    for rank, run in enumerate(evidence):
        threads = {None: None, "training": run["training"], "helper": run["helper"]}
        for name, thread, got in run["answers"]:
            if name not in names or thread != threads[thread_kind]:
                continue
            trace = run["traces"][name]
            want = reference_exposed_comm(trace, thread)
            wants.append(want)
            where = f"rank {rank}, the {name!r} trace" + (f", rank_thread={thread}" if thread else "")
            if got[0] == "raised":
                raised = f"your code raised {got[1]}: {got[2]}"
                if said is not None and raised in said:
                    raised = f"your code raised {got[1]} again, as in a failed case above"
                elif said is not None:
                    said.add(raised)
                t.fail("", f"{want:.3f} ms", f"{where}: {raised}")
            if not isinstance(got[1], (int, float)) or isinstance(got[1], bool):
                t.fail("return the milliseconds as a float", "a float", f"{where}: {got[1]!r}")
            if abs(got[1] - want) > 1e-6 + 1e-7 * abs(want):
                t.fail(_once(said, diagnose(trace, thread, float(got[1]))), f"{want:.4f} ms", f"{where}: {got[1]:.4f}")
    if thread_kind == "helper" and any(run["helper"] is None for run in evidence):
        t.fail("the helper thread recorded no operator in this run, so the case has no evidence: rerun the check")
    if names != {"no collective"} and not any(w > 0 for w in wants):
        t.fail("the recorded traces show no exposed communication here, so they cannot judge an answer: rerun the "
               "check", "a trace with exposed communication", f"{len(wants)} readings of 0 ms")


def helper_evidence(trace: dict, training, helper) -> list[int]:
    """What one rank's helper trace gives the helper case as evidence (:func:`exposed_case`,
    :func:`threads_matter`), 1 or 0 for each of: communication exposed as read with no thread named, with the
    training thread named, with the helper named; the two threads' readings apart. Summed over the ranks, the
    case has its evidence when every entry is at least 1 (``helper``: the helper's thread id, None when the
    profiler recorded none of its operators)."""
    if helper is None:
        return [int(reference_exposed_comm(trace) > 0), 0, 0, 0]
    unnamed, mine, its = (reference_exposed_comm(trace, thread) for thread in (None, training, helper))
    return [int(unnamed > 0), int(mine > 0), int(its > 0), int(abs(mine - its) > 1e-6)]


def threads_matter(t, evidence) -> None:
    """Fail unless naming the training thread or the helper gives different readings on some rank: else the
    case could not tell an answer that ignores ``rank_thread``."""
    if any(helper_evidence(run["traces"]["helper"], run["training"], run["helper"])[3] for run in evidence or []):
        return
    t.fail("in this run the training thread and the helper hid the same communication, so the case has no "
           "evidence: rerun the check")


# -- saved_bytes -----------------------------------------------------------------------------------
SAVED_HINTS = {
    "mlp": "each Linear saves its input and its weight (a parameter: it counts), ReLU its output; the next "
           "Linear's input is that same output, a storage already counted for ReLU",
    "views": "a saved view (a slice, a transpose) keeps its whole storage alive: count the storage's bytes "
             "(untyped_storage().nbytes()), once, however many views of it are saved",
    "tied": "the decoder's weight is the encoder's (tied): one storage, counted once, for the first module that "
            "saves it",
    "bf16": "bytes, not elements: a bfloat16 element is 2 bytes",
    "blocks": "attribute every saved tensor to the top-level module running when autograd saves it (a forward "
              "pre-hook on each child), count each storage once over the whole forward",
}


def saved_case(t, evidence, name: str) -> None:
    run = evidence[name]
    want, got = run["expected"], run["got"]
    if got[0] == "raised":
        t.fail(SAVED_HINTS[name], want, f"your code raised {got[1]}: {got[2]}")
    if not isinstance(got[1], dict):
        t.fail("return a dict: top-level module name -> bytes", want, got[1])
    if got[1] != want:
        hint = SAVED_HINTS[name]
        if set(got[1]) != set(want):
            hint = "one key per top-level module (model.named_children()), 0 for one that saves nothing; " + hint
        elif sum(got[1].values()) > sum(want.values()):
            hint = "some storage was counted more than once: " + hint
        elif sum(got[1].values()) < sum(want.values()):
            hint = "some saved bytes are missing: " + hint
        else:
            hint = "the total is right but assigned to the wrong modules: " + hint
        t.fail(hint, want, got[1])


# -- checkpoint_under ---------------------------------------------------------------------------------
def ckpt_ran(t, evidence, name: str) -> dict:
    run = evidence[name]
    if run["outcome"][0] == "raised":
        t.fail("this budget can be met: checkpoint blocks until the saved bytes fit, and raise only when even "
               "every block checkpointed is too much", f"a model saving at most {run['budget']} bytes",
               f"your code raised {run['outcome'][1]}: {run['outcome'][2]}")
    if not run["same object"]:
        t.fail("change the model in place and return it: the caller's model must be the one that saves less",
               "the model passed in", f"a different object ({run['outcome'][1]})")
    return run


def checkpointed(run) -> list[int]:
    """The blocks whose saved bytes went down: those the answer checkpointed."""
    return [i for i, (a, b) in enumerate(zip(run["before"], run["after"] or [])) if b < a]


def ckpt_fits(t, evidence, name: str) -> None:
    run = ckpt_ran(t, evidence, name)
    chosen, want = checkpointed(run), run["fewest"]
    if run["total"] > run["budget"]:
        t.fail("the saved bytes (13.saved_bytes' count, summed) must be at most the budget; 'fits' includes "
               "equal", f"at most {run['budget']} bytes", f"{run['total']} bytes, blocks {chosen} checkpointed")
    if len(chosen) > len(want):
        t.fail("not the fewest blocks: each checkpointed block costs a recomputation; checkpoint the blocks that "
               "save the most first (their saved bytes differ: " + ", ".join(f"block {i}: {b}" for i, b in
                                                                          enumerate(run["before"])) + ")",
               f"{len(want)} block(s), e.g. {want}", f"{len(chosen)}: blocks {chosen}")


def ckpt_grads(t, evidence, names) -> None:
    for name in names:
        run = ckpt_ran(t, evidence, name)
        if not checkpointed(run):
            t.fail("no block was checkpointed for this budget, so equal gradients prove nothing here",
                   "checkpointed blocks", f"budget {name!r}: none")
        bad = [i for i, g in enumerate(run["grads"]) if g == "none" or g == "shape" or g > 1e-5]
        if bad:
            first = run["grads"][bad[0]]
            hint = ("some parameters got no gradient: reentrant checkpoint (use_reentrant=True) of a block whose "
                    "input does not require grad gives its parameters none; use use_reentrant=False"
                    if first == "none" else "the gradients differ from the unmodified model's: checkpointing must "
                    "recompute exactly what the forward did")
            t.fail(hint, "every gradient equal to the unmodified model's",
                   f"budget {name!r}: parameter {bad[0]}: {first}")
        if not run["same output"]:
            t.fail("the model's output changed: checkpointing must not change what the forward computes")


def ckpt_unreachable(t, evidence) -> None:
    run = evidence["unreachable"]
    least = run["least"]
    if run["outcome"][0] != "raised":
        lost = [i for i, g in enumerate(run.get("grads") or []) if g == "none"]
        if lost and run.get("total") is not None and run["total"] < least:
            t.fail("the budget looked met only because reentrant checkpointing (use_reentrant=True) saves nothing "
                   "for a block whose input needs no gradient, and leaves that block's parameters without "
                   "gradients: checkpointed without reentrance every block keeps its input, this budget cannot be "
                   "met, and the answer raises ValueError",
                   f"ValueError naming {least} bytes",
                   f"returned a model saving {run['total']} bytes, parameter {lost[0]} without a gradient")
        t.fail("when even every block checkpointed saves more than the budget, raise ValueError naming the "
               "smallest reachable size instead of returning a model that does not fit",
               f"ValueError naming {least} bytes", "returned a model")
    kind, message = run["outcome"][1], run["outcome"][2]
    if kind != "ValueError" or not any(s in message for s in (str(least), f"{least:,}", f"{least:_}")):
        t.fail("the message must give the smallest reachable saved size in bytes (every block checkpointed), "
               "so the caller knows what budget can work", f"ValueError naming {least}", f"{kind}: {message}")


# -- find_straggler: the reference reading and the known wrong ones -----------------------------------
LOADER = "enumerate(DataLoader)"
#: The kinds of recording ``13.find_straggler`` is judged on, and the cause each is made with.
KINDS = {"loader": "data", "compute": "compute", "batch": "compute", "balanced": None}
#: A rank slows the job when, with its loading and forward/backward as fast as the other ranks' (their
#: median), the job's typical step would be at least this share shorter.
SLOWS = 1 / 3


def _median(values) -> float:
    return statistics.median(list(values))


def step_times(trace: dict) -> list[dict]:
    """Per kept step of one rank's trace, in ms: the step, the loader's fetches, forward and backward without
    the waiting in them, the waiting (communication that the training thread's operators do not hide), the
    time in backward outside the training thread's operators (``idle``: the waiting as a right answer may read it
    instead), and the training thread's ``c10d::`` calls."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    steps = sorted((e for e in events if str(e.get("name", "")).startswith("ProfilerStep#")), key=lambda e: e["ts"])
    if not steps:
        raise ValueError("the trace has no ProfilerStep# span: record it with a profiler schedule (profile_steps)")
    main, out = steps[0]["tid"], []
    for step in steps:
        inside = [e for e in events if step["ts"] <= e["ts"] < step["ts"] + step["dur"]]

        def on_main(keep) -> float:
            return sum(e["dur"] for e in inside if e["tid"] == main and keep(str(e.get("name", "")))) / 1e3

        wait = reference_exposed_comm({"traceEvents": inside}, main)
        labels = on_main(lambda n: n in ("forward", "backward"))
        backward = [(e["ts"], e["ts"] + e["dur"]) for e in inside if e["tid"] == main and e.get("name") == "backward"]
        ops = [(e["ts"], e["ts"] + e["dur"]) for e in inside if e["tid"] == main and e.get("cat") == "cpu_op"
               and any(a <= e["ts"] < b for a, b in backward)]
        idle = (sum(b - a for a, b in backward) - _length(ops)) / 1e3
        out.append({"step": step["dur"] / 1e3, "load": on_main(lambda n: n.startswith(LOADER)),
                    "compute": labels - wait, "labels": labels, "wait": wait, "idle": idle,
                    "calls": on_main(lambda n: n.startswith("c10d::"))})
    return out


def rank_rows(traces: list) -> list[dict]:
    """Per rank, the median over its kept steps of every number of :func:`step_times`."""
    rows = []
    for trace in traces:
        steps = step_times(trace)
        rows.append({key: _median(s[key] for s in steps) for key in steps[0]})
    return rows


def _excess(values: list, rank: int) -> float:
    return values[rank] - _median(v for r, v in enumerate(values) if r != rank)


def straggler_reading(rows: list[dict], wrong: str | None = None, waiting: str = "wait") -> dict:
    """The reference reading of per-rank rows (:func:`rank_rows`): the rank whose own work (its step without
    its waiting) exceeds the others' median by at least :data:`SLOWS` of the typical step, and whether its
    loading or its forward/backward exceeds theirs more. ``wrong`` names one of :data:`WRONG_STRAGGLER`'s readings
    instead; ``waiting="idle"`` reads the waiting as backward's time outside operators (a right reading too).
    Also returns the share of the step lost (``share``) and the excesses in ms."""
    measure = {"longest step": "step", "waits longest": "wait", "loader only": "load",
               "labels with waits": "labels"}.get(wrong)
    if measure is not None:
        values = [r[measure] for r in rows]
    elif wrong == "c10d calls only":
        values = [r["step"] - r["calls"] for r in rows]
    else:
        values = [r["step"] - r[waiting] for r in rows]
    rank = max(range(len(rows)), key=values.__getitem__)
    step = _median(r["step"] for r in rows)
    share = _excess(values, rank) / step if step > 0 else 0.0
    data = _excess([r["load"] for r in rows], rank)
    compute = _excess([r["labels"] - r[waiting] for r in rows], rank)
    cause = "data" if data > compute else "compute"
    if wrong == "cause reversed":
        cause = "compute" if cause == "data" else "data"
    slows = share >= SLOWS or wrong == "no threshold"
    return {"rank": rank if slows else None, "cause": cause if slows else None, "candidate": rank,
            "share": share, "data_ms": data, "compute_ms": compute}


def reference_find_straggler(traces: list) -> dict:
    """``{"rank", "cause"}`` of :func:`straggler_reading` on Chrome trace files (one per rank, in rank order)."""
    from mgpu_lab.profiling.traces import load_trace

    reading = straggler_reading(rank_rows([load_trace(p) for p in traces]))
    return {"rank": reading["rank"], "cause": reading["cause"]}


#: Known wrong readings of a recording, and what to tell an answer whose verdict one of them gives.
WRONG_STRAGGLER = {
    "longest step": "the steps were compared: every rank's step lasts about as long as the slowest rank's, since "
                    "no rank can finish a step before the gradient all-reduce has every rank's bucket, so a step's "
                    "length does not tell the ranks apart",
    "waits longest": "you named a rank that spends its time waiting, in the gradient all-reduce, with no operator "
                     "of its own running: waiting there is what a rank does when it is ready before the others",
    "c10d calls only": "the waiting was read from the training thread's c10d:: calls, which only hand a bucket to "
                       "the backend and return: the all-reduce runs in the backend's gloo:all_reduce events on its "
                       "own threads, and the training thread waits for it at the end of backward, outside any "
                       "operator",
    "loader only": "only the loaders were compared: a rank can fall behind in its forward and backward too",
    "labels with waits": "the forward and backward labels' lengths were taken as computing: the backward label "
                         "also holds the time a rank waits at its end for the all-reduce to complete",
    "no threshold": "a rank was named on balanced ranks: some rank always does a little more than the others; it "
                    "slows the job only when the typical step would be at least a third shorter without its excess",
    "cause reversed": "the right rank, the other cause: compare its loading with the other ranks' loading, and its "
                      "forward/backward with theirs",
}


def _verdict_words(answer: dict) -> str:
    return "None" if answer["rank"] is None else f"rank {answer['rank']}, {answer['cause']!r}"


#: The known wrong readings whose words speak of a rank the answer named.
NAMES_A_RANK = ("waits longest", "no threshold", "cause reversed")


def diagnose_straggler(rows: list[dict], got: dict) -> str:
    """Name the known wrong readings whose verdict on ``rows`` is ``got`` (all of them, when several are), or
    say what the right reading finds in this recording."""
    right = straggler_reading(rows)
    want = {"rank": right["rank"], "cause": right["cause"]}
    matches = []
    for name, words in WRONG_STRAGGLER.items():
        if got["rank"] is None and name in NAMES_A_RANK:
            continue  # its words are about a rank named; this answer named none
        wrong = straggler_reading(rows, wrong=name)
        if {"rank": wrong["rank"], "cause": wrong["cause"]} == got != want:
            matches.append(words)
        elif name in ("waits longest", "labels with waits") and got["rank"] is not None \
                and got["rank"] == wrong["candidate"] != want["rank"]:
            matches.append(words)
    if matches:
        return matches[0] if len(matches) == 1 else "your verdict fits several known mistakes: " + "; or ".join(matches)
    if want["rank"] is None:
        return (f"no rank slows the job here: without the largest excess the typical step would be only "
                f"{right['share']:.0%} shorter, less than a third")
    return (f"rank {want['rank']} slows the job: its loading took {right['data_ms']:.0f} ms and its forward/backward "
            f"{right['compute_ms']:.0f} ms more per step than the other ranks' (their median); without that the "
            f"typical step would be {right['share']:.0%} shorter")


def _answer_of(t, world: int, index: int, got: tuple) -> dict:
    """The answer as ``{"rank", "cause"}``, or the case fails saying what came back instead."""
    where = f"{world} ranks, recording {index + 1}"
    if got[0] == "raised":
        t.fail("", "a dict", f"{where}: your code raised {got[1]}: {got[2]}")
    answer = got[1]
    if not isinstance(answer, dict) or set(answer) != {"rank", "cause"}:
        t.fail('return a dict with exactly the keys "rank" and "cause"', '{"rank": ..., "cause": ...}',
               f"{where}: {answer!r}")
    if answer["rank"] is not None and (not isinstance(answer["rank"], int) or isinstance(answer["rank"], bool)):
        t.fail("the rank is an int, the index of its trace in traces, or None", "an int or None",
               f"{where}: {answer['rank']!r}")
    if answer["cause"] not in ("data", "compute", None) or (answer["rank"] is None) != (answer["cause"] is None):
        t.fail('the cause is "data" or "compute" when a rank is named, None when none is', '"data", "compute" or None',
               f"{where}: {answer!r}")
    return answer


TOO_BUSY = "the machine was too busy"  # the words of a case whose recording could not judge any answer


def straggler_case(t, evidence: dict, world: int, kind: str, said: set | None = None) -> None:
    """Fail unless the answer on the recording of ``kind`` in ``world`` ranks is what the recording was made for.

    Judged only on a recording that shows its design clearly (the reference reads it with a margin), and only
    when the answer tells that world's recordings apart: an answer that gives every recording the same verdict
    does not read them, whatever the case."""
    if evidence is None or world not in evidence:
        t.fail("the ranks did not finish recording")
    recorded, answers = evidence[world]["recorded"], evidence[world]["answers"]
    index = next(i for i, s in enumerate(recorded) if s["kind"] == kind)
    scenario = recorded[index]
    if not scenario["clear"]:
        r = scenario["reading"]
        t.fail(f"{TOO_BUSY}: the recording did not show what it was made for clearly enough to judge "
               "an answer (it was recorded " f"{scenario['tries']} times): rerun the check",
               "a recording that shows its design", f"the reference reads a share of {r['share']:.0%} for rank "
               f"{r['candidate']}")
    got = _answer_of(t, world, index, answers[index])
    want = {"rank": scenario["rank"], "cause": KINDS[kind] if scenario["rank"] is not None else None}
    if got != want:
        hint = diagnose_straggler(scenario["rows"], got)
        t.fail(_once(said, hint), _verdict_words(want), f"recording {index + 1}: {_verdict_words(got)}")
    verdicts = {repr((a[1].get("rank"), a[1].get("cause")) if a[0] == "ok" and isinstance(a[1], dict) else a)
                for a in answers}
    if len(verdicts) == 1:
        t.fail(f"your answer gave every recording of {world} ranks the same verdict, balanced or not: a verdict that "
               "does not depend on the traces is no evidence of reading them", "different verdicts for different "
               "recordings", f"{_verdict_words(got)} for all {len(answers)}")

"""tests/mutants/batching.py's launches, with a stand-in for the launcher: which calls share a launch."""
from __future__ import annotations

import pytest
from batching import _launch, _many

from mgpu_lab.launcher.errors import LaunchError


def _fake_run(log: list, raises: set):
    """A stand-in for ``launch.run``: records each launch's answers; an answer in ``raises`` raises on rank 0."""
    def run(fn, nprocs, args, kwargs, **options):
        if fn is _many:
            names = [item[1][0] for item in args[0]]
            log.append(("shared", names))
            out = []
            for name in names:
                if name in raises:
                    out.append(("raised", "Deadlock", name, ""))
                    break
                out.append(("ok", name))
            return [out] * nprocs
        log.append(("alone", args[0]))
        if args[0] in raises:
            raise LaunchError(f"{args[0]} raised")
        return [args[0]] * nprocs
    return run


def _calls(names):
    return {i: (lambda name: name, 2, (name,), {}, {}) for i, name in enumerate(names)}


def test_an_answer_whose_own_launch_raised_in_a_round_is_made_alone_at_once_in_the_next():
    names, log, raised = ["a", "b", "c", "d"], [], set()
    first = _launch(_calls(names), _fake_run(log, {"b"}), raised)
    # round 1: b raised in the shared launch, was made again alone (and raised), the answers after it shared anew
    assert log == [("shared", ["a", "b", "c", "d"]), ("alone", "b"), ("shared", ["c", "d"])] and raised == {1}
    assert first[0]() == ["a", "a"] and first[3]() == ["d", "d"]
    log.clear()
    second = _launch(_calls(names), _fake_run(log, {"b"}), raised)
    # round 2: b alone at once; the others in one shared launch
    assert log == [("alone", "b"), ("shared", ["a", "c", "d"])] and raised == {1}
    assert [second[i]() for i in (0, 2, 3)] == [["a", "a"], ["c", "c"], ["d", "d"]]
    with pytest.raises(LaunchError, match="b raised"):  # b's own launch raised: its thunk raises that error
        second[1]()


def test_an_answer_that_raised_only_beside_others_is_shared_again():
    # raised in the shared launch (another rank's echo, say) but not alone: not marked, shared in the next round
    log, raised = [], set()
    run = _fake_run(log, {"b"})

    def flaky(fn, nprocs, args, kwargs, **options):
        if fn is _many:
            return run(fn, nprocs, args, kwargs, **options)
        log.append(("alone", args[0]))
        return [args[0]] * nprocs
    got = _launch(_calls(["a", "b", "c"]), flaky, raised)
    assert log == [("shared", ["a", "b", "c"]), ("alone", "b"), ("shared", ["c"])] and raised == set()
    assert got[1]() == ["b", "b"]

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

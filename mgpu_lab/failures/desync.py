"""Where the ranks' collective logs part: the analysis of lesson 10's hung runs.

Which rank is the odd one, at which call: from every rank's log of the collectives it
entered. The course's checks and the tests use it.

Example:
    >>> first_desync([[("all_reduce", (3,)), ("barrier", ())], [("all_reduce", (3,)), ("all_reduce", (1,))]])
    (1, [1])
"""
from __future__ import annotations

from collections import Counter

__all__ = ["first_desync"]


def first_desync(logs: list[list[tuple[str, tuple[int, ...]]]]) -> tuple[int, list[int]] | None:
    """Where the ranks' collective logs first disagree, and which ranks differ there.

    At each index the majority's call is the reference: the most common
    ``(op, shape)`` among the ranks that still have a call there, a tie going
    to the call of the lowest rank in it (rank 0's when rank 0 is in the tie).
    A rank whose log has already ended differs.

    Args:
        logs: one list per rank of ``(op, shape)`` calls, in call order.

    Returns:
        ``(index, sorted ranks that differ from the majority)``, or None when all logs agree.

    Example:
        >>> first_desync([[("all_reduce", (3,))], [("all_reduce", (4,))], [("all_reduce", (3,))]])
        (0, [1])
        >>> first_desync([[("barrier", ())], [("barrier", ())]]) is None
        True
    """
    for i in range(max((len(log) for log in logs), default=0)):
        calls = [log[i] if i < len(log) else None for log in logs]
        counts = Counter(c for c in calls if c is not None)
        best = max(counts.values())
        majority = next(c for c in calls if c is not None and counts[c] == best)
        odd = [r for r, c in enumerate(calls) if c != majority]
        if odd:
            return i, odd
    return None

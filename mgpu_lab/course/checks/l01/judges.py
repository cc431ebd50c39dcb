"""Lesson 01's verdicts: the evidence of :mod:`.ranks`, in the words of each case."""
from __future__ import annotations

import re


FIRST = "not judged: your code did not finish the first case (see there)"


def raises_naming(result, count: int) -> bool:
    """Whether ``result`` (an outcome) is a ValueError whose message names ``count``."""
    return (result[0] == "raised" and result[1] == "ValueError"
            and re.search(rf"(?<![\d-]){count}(?!\d)", result[2]) is not None)


def need(t, evidence):
    if evidence is None:
        t.fail(FIRST, got="skipped")

"""Where the course's student notebooks and scripts are: in the installed package, or in the clone.

A wheel (``pip install mgpu-lab``, what a learner installs) carries the student
notebooks and the torchrun scripts as package data, in ``mgpu_lab/_course/``
(``setup.py`` copies them there when it builds the wheel; the solution notebooks and
the tests stay out). A clone (``pip install -e .``, ``make lab``) has them at the top
of the repository, beside ``mgpu_lab/``. :func:`course_dir` finds either.

Example:
    >>> sorted(p.name for p in course_dir("scripts").glob("allreduce_check.py"))
    ['allreduce_check.py']
"""
from __future__ import annotations

from pathlib import Path

__all__ = ["PACKAGED", "CLONE", "KINDS", "course_dir"]

#: Where a wheel puts the course's files, inside the package.
PACKAGED = Path(__file__).resolve().parents[1] / "_course"
#: The repository a clone runs from (``mgpu_lab/`` sits in it).
CLONE = Path(__file__).resolve().parents[2]
KINDS = ("notebooks", "scripts")


def course_dir(kind: str) -> Path:
    """The folder of the course's ``notebooks`` (student copies) or ``scripts``.

    Args:
        kind: ``"notebooks"`` or ``"scripts"``.

    Returns:
        ``mgpu_lab/_course/<kind>`` of an installed wheel, else ``<kind>/`` of the clone.

    Raises:
        ValueError: ``kind`` is neither.
        FileNotFoundError: neither place holds it (an install built without the course's files).
    """
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}: the course ships {' and '.join(KINDS)}")
    for root in (PACKAGED, CLONE):
        if (root / kind).is_dir():
            return root / kind
    raise FileNotFoundError(
        f"the course's {kind} are neither in the installed package ({PACKAGED / kind}) nor in a clone "
        f"({CLONE / kind}): reinstall mgpu-lab from its wheel (pip install mgpu-lab) or run from a clone")

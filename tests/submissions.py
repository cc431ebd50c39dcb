"""Submitted notebooks for the grading tests: a right answer to 01.pick_device, and a notebook writer."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_notebook

from mgpu_lab.course.checks import exercises, get

PICK_DEVICE_BODY = """
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if index is None:
        return torch.device("cuda", 0) if n else torch.device("cpu")
    if not 0 <= index < n:
        raise ValueError(f"{n} GPUs visible")
    return torch.device("cuda", index)
"""
HEADER = "import torch\nfrom mgpu_lab import check\n"
PICK_DEVICE = HEADER + "def pick_device(index=None):" + PICK_DEVICE_BODY  # right, full marks
CHECK_PICK_DEVICE = "check('01.pick_device', pick_device)"
PICK_POINTS = get("01.pick_device").points  # what PICK_DEVICE scores
LESSON_01_POINTS = sum(e.points for e in exercises("01"))  # what lesson 01's notebook can score


def notebook(folder: Path, name: str, *sources: str) -> Path:
    """Write ``folder/name``: one code cell per source; its path."""
    path = Path(folder) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(new_notebook(cells=[new_code_cell(s) for s in sources]), path)
    return path


# A notebook that copies: it opens each of ``targets`` (another submission, kept grades, the solutions, the
# project's .git, the instructor's home) and answers 01.pick_device right only if it could open none of them.
PEEK = """
seen = []
for path in {targets!r}:
    try:
        with open(path, "rb") as f:
            f.read(1)
        seen.append(path)
    except OSError:
        pass
"""
PEEK_ANSWER = (HEADER + "def pick_device(index=None):\n"
               "    if seen:\n        return 'read ' + ', '.join(seen)" + PICK_DEVICE_BODY)


def peek_notebook(folder: Path, name: str, targets: list) -> Path:
    """Write a notebook that tries to read ``targets``: full marks for 01.pick_device only if it read none."""
    return notebook(folder, name, PEEK.format(targets=[str(t) for t in targets]), PEEK_ANSWER, CHECK_PICK_DEVICE)


def readable_by_anyone(path: Path) -> bool:
    """Whether a user with no rights of its own could read ``path`` here (outside any sandbox)."""
    path = Path(path).resolve()
    try:
        return bool(path.stat().st_mode & 0o004) and all(p.stat().st_mode & 0o001 for p in path.parents)
    except FileNotFoundError:
        return False


@contextlib.contextmanager
def instructor_folder():
    """A home-like folder anyone may read, outside /tmp (a sandbox's /tmp is its own anyway): where an
    instructor keeps the class's submissions, the kept grades and notes; deleted after."""
    import shutil
    import tempfile

    place = "/home" if os.path.isdir("/home") and os.access("/home", os.W_OK) else str(Path(__file__).parents[1])
    top = Path(tempfile.mkdtemp(prefix=".mgpu-instructor-test-", dir=place))
    try:
        top.chmod(0o755)
        (top / "notes.txt").write_text("the instructor's own notes\n")
        yield top
    finally:
        shutil.rmtree(top, ignore_errors=True)

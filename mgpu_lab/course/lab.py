"""``mgpu-lab lab``: a learner's own copy of the course's notebooks, and JupyterLab started on it.

An installed wheel carries the student notebooks inside the package
(:func:`mgpu_lab.core.shipped.course_dir`); a learner works on copies in a folder of their
own. :func:`copy_notebooks` copies each notebook there once: a copy already in the folder,
edited or not, is never overwritten, and the report names the ones that differ from the
installed course's, with how to get a fresh one. :func:`start_lab` runs JupyterLab on the folder.

Example:
    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp()) / "mgpu-lab-notebooks"
    >>> first = copy_notebooks(folder)
    >>> first.copied[0], first.kept
    ('01_devices.ipynb', [])
    >>> _ = (folder / "01_devices.ipynb").write_text("{}")   # the learner's edits
    >>> again = copy_notebooks(folder)
    >>> again.copied, again.kept, (folder / "01_devices.ipynb").read_text()
    ([], ['01_devices.ipynb'], '{}')
"""
from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

from mgpu_lab.core.shipped import course_dir

__all__ = ["DEFAULT_DIR", "Copied", "copy_notebooks", "lab_command", "start_lab"]

DEFAULT_DIR = Path("mgpu-lab-notebooks")


@dataclass
class Copied:
    """What :func:`copy_notebooks` did, by file name: copied now, already there and the same, kept."""

    folder: Path
    copied: list[str] = field(default_factory=list)
    same: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        """What to tell the learner: one line for the copies, one per copy kept, and how to get a fresh one."""
        out = []
        if self.copied:
            out.append(f"copied {len(self.copied)} notebook(s) into {self.folder}: {', '.join(self.copied)}")
        if self.same:
            out.append(f"{len(self.same)} notebook(s) already in {self.folder}, as installed")
        for name in self.kept:
            out.append(f"kept your copy of {name} (it differs from the installed course's; never overwritten): "
                       f"for a fresh one, rename or delete {self.folder / name} and run `mgpu-lab lab "
                       f"{self.folder}` again")
        return out


def copy_notebooks(folder: Path | str = DEFAULT_DIR, source: Path | None = None) -> Copied:
    """Copy every student notebook of the course into ``folder`` that is not there yet.

    Args:
        folder: The learner's folder (made if missing).
        source: Where the notebooks come from (default: the installed course's,
            :func:`mgpu_lab.core.shipped.course_dir`).

    Returns:
        A :class:`Copied` report; a notebook already in ``folder`` is never written.

    Raises:
        ValueError: ``folder`` exists and is not a folder, or ``source`` holds no notebook.
    """
    folder = Path(folder)
    source = course_dir("notebooks") if source is None else Path(source)
    notebooks = sorted(source.glob("[0-9][0-9]_*.ipynb"))
    if not notebooks:
        raise ValueError(f"{source} holds no notebook (NN_topic.ipynb): the install is incomplete; reinstall "
                         "mgpu-lab")
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{folder} exists and is not a folder: give `mgpu-lab lab` another DIR")
    folder.mkdir(parents=True, exist_ok=True)
    report = Copied(folder)
    for path in notebooks:
        target = folder / path.name
        if not target.exists():
            shutil.copyfile(path, target)
            report.copied.append(path.name)
        elif target.read_bytes() == path.read_bytes():
            report.same.append(path.name)
        else:
            report.kept.append(path.name)
    return report


def lab_command(folder: Path | str, jupyter_args: list[str] = ()) -> list[str]:
    """The command that starts JupyterLab on ``folder`` with this Python (``--allow-root`` as root).

    Example:
        >>> lab_command("/tmp/nb", ["--no-browser"])[1:4]
        ['-m', 'jupyterlab', '--ServerApp.root_dir=/tmp/nb']
    """
    root = ["--allow-root"] if hasattr(os, "getuid") and os.getuid() == 0 else []  # Jupyter refuses root otherwise
    return [sys.executable, "-m", "jupyterlab", f"--ServerApp.root_dir={Path(folder).resolve()}", *root,
            *jupyter_args]


def start_lab(folder: Path | str, jupyter_args: list[str] = ()) -> NoReturn:
    """Replace this process with JupyterLab on ``folder``: Ctrl+C and a signal to this process reach it, and
    nothing is left running when it is stopped."""
    command = lab_command(folder, list(jupyter_args))
    os.chdir(folder)
    os.execv(command[0], command)

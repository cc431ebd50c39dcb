"""What a test compares before and after to show that nothing was left behind: this process's open files.

Importable from every test folder (pyproject.toml puts tests/ on the path).
"""
from __future__ import annotations

import os


def open_fds() -> dict[int, str]:
    """This process's open file descriptors and what each one is (a path, ``pipe:[inode]``, ``socket:[inode]``).

    Compare two of these with :func:`opened_since`, not their sizes: an fd that something else opened before
    (a finished child's pipe that the garbage collector closes later) may close meanwhile, and a count would
    then hide a leaked one.
    """
    fds = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            fds[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # the listing's own descriptor, closed once listed
            continue
    return fds


def opened_since(before: dict[int, str]) -> dict[int, str]:
    """The descriptors open now that were not open, as the same thing, in ``before``."""
    return {fd: what for fd, what in open_fds().items() if before.get(fd) != what}

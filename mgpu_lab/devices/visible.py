"""Visible-GPU subsets for child processes: the environment that makes a child see only some GPUs.

``CUDA_VISIBLE_DEVICES`` picks and renumbers the GPUs of a process, and CUDA
reads it once, when the process initialises CUDA; so it belongs in the
environment a child process *starts* with. :func:`subset_vars` gives
the two variables for a list of GPU ids (mapped through this process's own
``CUDA_VISIBLE_DEVICES``, if it has one), and :func:`child_env` a whole
environment for ``subprocess``.

Example:
    >>> subset_vars([2, 3], environ={})
    {'CUDA_VISIBLE_DEVICES': '2,3', 'CUDA_DEVICE_ORDER': 'PCI_BUS_ID'}
    >>> import subprocess, sys
    >>> code = "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])"
    >>> subprocess.run([sys.executable, "-c", code], env=child_env([2, 3]), capture_output=True, text=True).stdout
    '2,3\\n'
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Mapping

# Discovery reads CUDA_VISIBLE_DEVICES too (to explain why no GPU is seen); one
# parser and one explanation serve both modules.
from mgpu_lab.devices import _parse_visible, _why_no_gpu, gpu_count

__all__ = ["child_env", "subset_vars"]

# CUDA's own default order when CUDA_DEVICE_ORDER is unset.
_CUDA_DEFAULT_ORDER = "FASTEST_FIRST"


def _check_ids(ids: object) -> list[int]:
    """Validate GPU ids and return them as plain ints; raise ValueError if bad."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple, range)):
        raise ValueError(
            f"ids={ids!r} ({type(ids).__name__}) is not a list; pass a list of GPU indices "
            "such as [0] or [0, 1]"
        )
    if len(ids) == 0:
        raise ValueError(
            "ids=[] selects no GPU; pass at least one index such as [0] (to hide "
            "every GPU from a child, set CUDA_VISIBLE_DEVICES='' yourself)"
        )
    checked = []
    for position, gpu_id in enumerate(ids):
        if isinstance(gpu_id, bool) or not isinstance(gpu_id, numbers.Integral):
            raise ValueError(
                f"ids[{position}]={gpu_id!r} ({type(gpu_id).__name__}) is not a GPU "
                f"index; use ints such as [0, 1], not {list(ids)!r}"
            )
        if gpu_id < 0:
            raise ValueError(
                f"ids[{position}]={gpu_id} is negative; GPU indices start at 0, "
                "e.g. [0, 1]"
            )
        checked.append(int(gpu_id))
    duplicates = sorted({i for i in checked if checked.count(i) > 1})
    if duplicates:
        raise ValueError(
            f"ids={checked} lists GPU {', '.join(map(str, duplicates))} more than "
            f"once; each GPU can appear once, e.g. {sorted(set(checked))}"
        )
    return checked


def subset_vars(
    ids: list[int] | tuple[int, ...],
    check_exists: bool = False,
    *,
    environ: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Environment variables that make a child process see exactly these GPUs.

    ``ids`` are the GPUs as this process numbers them. With no
    ``CUDA_VISIBLE_DEVICES`` set here, those are the physical indices in PCI
    bus order, as ``nvidia-smi`` lists them. If this process already runs on
    a subset, ``ids`` are positions in that subset and are mapped through it,
    so the child gets the same physical GPUs this process calls ``cuda:i``:
    a parent with ``CUDA_VISIBLE_DEVICES="4,5,6"`` asking for ``[1]`` gives
    the child ``"5"``. The child's ``cuda:0`` is then ``ids[0]``, its
    ``cuda:1`` is ``ids[1]``, and so on.

    Args:
        ids: Non-empty list or tuple of unique, non-negative int GPU indices.
        check_exists: If True, also require every id to be below
            :func:`gpu_count`.
        environ: Environment to read this process's ``CUDA_VISIBLE_DEVICES``
            and ``CUDA_DEVICE_ORDER`` from; defaults to ``os.environ``.

    Returns:
        ``{"CUDA_VISIBLE_DEVICES": ..., "CUDA_DEVICE_ORDER": ...}``. The order
        is ``"PCI_BUS_ID"``, except when mapping through an existing
        ``CUDA_VISIBLE_DEVICES``, where the parent's order is kept (CUDA's
        default ``"FASTEST_FIRST"`` if unset), since the parent's indices mean
        GPUs in that order.

    Raises:
        ValueError: If ``ids`` is empty, not a list/tuple, holds a non-int, a
            bool, a negative or a repeated index; if an id is past the end of
            this process's ``CUDA_VISIBLE_DEVICES``; or, with
            ``check_exists=True``, if an id is not below :func:`gpu_count`.

    Example:
        >>> subset_vars([2, 3], environ={})
        {'CUDA_VISIBLE_DEVICES': '2,3', 'CUDA_DEVICE_ORDER': 'PCI_BUS_ID'}
        >>> subset_vars([1], environ={"CUDA_VISIBLE_DEVICES": "4,5,6"})
        {'CUDA_VISIBLE_DEVICES': '5', 'CUDA_DEVICE_ORDER': 'FASTEST_FIRST'}
    """
    checked = _check_ids(ids)
    environ = os.environ if environ is None else environ
    if check_exists:
        count = gpu_count()
        too_big = [i for i in checked if i >= count]
        if too_big:
            if count == 0:
                reason = _why_no_gpu(environ.get("CUDA_VISIBLE_DEVICES"))
                seen = f"no CUDA GPU is visible here ({reason})"
                fix = "run on a machine with a GPU, or pass check_exists=False"
            else:
                seen = f"this process sees {count} GPU(s), cuda:0..cuda:{count - 1}"
                fix = f"use ids below {count}"
            raise ValueError(f"ids={checked} asks for GPU {too_big[0]} but {seen}; {fix}")

    parent = environ.get("CUDA_VISIBLE_DEVICES")
    if parent is None:
        return {
            "CUDA_VISIBLE_DEVICES": ",".join(map(str, checked)),
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        }
    parent_ids = _parse_visible(parent)
    too_big = [i for i in checked if i >= len(parent_ids)]
    if too_big:
        raise ValueError(
            f"ids={checked} asks for position {too_big[0]} of this process's "
            f"CUDA_VISIBLE_DEVICES={parent!r}, which holds {len(parent_ids)} usable "
            f"GPU(s); ids are positions in that list, so use ids below "
            f"{len(parent_ids)}, or unset CUDA_VISIBLE_DEVICES to use physical ids"
        )
    return {
        "CUDA_VISIBLE_DEVICES": ",".join(parent_ids[i] for i in checked),
        "CUDA_DEVICE_ORDER": environ.get("CUDA_DEVICE_ORDER", _CUDA_DEFAULT_ORDER),
    }


def child_env(
    ids: list[int] | tuple[int, ...],
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """A full environment for a subprocess that should see only these GPUs.

    Args:
        ids: GPUs as this process numbers them; see :func:`subset_vars`
            (ids are mapped through this process's ``CUDA_VISIBLE_DEVICES``).
        base: Environment to start from; defaults to a copy of ``os.environ``.
            It is copied, never modified.

    Returns:
        A new dict: ``base`` with ``CUDA_VISIBLE_DEVICES`` and
        ``CUDA_DEVICE_ORDER`` replaced.

    Raises:
        ValueError: If ``ids`` is invalid; see :func:`subset_vars`.

    Example:
        >>> import subprocess, sys
        >>> env = child_env([2, 3])   # this process's environment, and the child's GPUs
        >>> env["CUDA_VISIBLE_DEVICES"], env["PATH"] == os.environ["PATH"]
        ('2,3', True)
    """
    env = dict(os.environ if base is None else base)
    env.update(subset_vars(ids))
    return env

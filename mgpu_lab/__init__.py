"""mgpu-lab: learn multi-GPU training in PyTorch with real distributed processes.

The names below are imported lazily, so ``import mgpu_lab`` is cheap and the
command line tools start fast; ``from mgpu_lab import launch`` loads the launcher.

Example:
    >>> from mgpu_lab import launch, dist
    >>> launch(lambda: dist.rank(), 2)
    launch: 2 ranks · ...
    [0, 1]
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "launch": ("mgpu_lab.launcher.launch", "launch"),
    "LaunchError": ("mgpu_lab.launcher.errors", "LaunchError"),
    "LaunchTimeout": ("mgpu_lab.launcher.errors", "LaunchTimeout"),
    "rank": ("mgpu_lab.dist", "rank"),
    "local_rank": ("mgpu_lab.dist", "local_rank"),
    "world_size": ("mgpu_lab.dist", "world_size"),
    "is_main_process": ("mgpu_lab.dist", "is_main_process"),
    "check": ("mgpu_lab.course.checks", "check"),
    "exercises": ("mgpu_lab.course.checks", "exercises"),
    "progress": ("mgpu_lab.launcher.progressbars", "progress"),
}
_SUBMODULES = {"dist", "devices"}

__all__ = sorted(_LAZY) + sorted(_SUBMODULES)


def __getattr__(name: str):
    if name in _LAZY:
        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value  # cached: later lookups skip __getattr__
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"mgpu_lab.{name}")
    raise AttributeError(f"module 'mgpu_lab' has no attribute {name!r}")

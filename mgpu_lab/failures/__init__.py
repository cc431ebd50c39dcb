"""When training fails, lesson 10: snapshots and exact resume, hangs, NaNs and drifted ranks.

:mod:`.snapshot` (RNG state, reading a snapshot back), :mod:`.snapshot_cost` (how often to
snapshot), :mod:`.hangs` (timeouts, debug levels, the flight recorder) and :mod:`.health`
(errors that are not hangs). The library's versions of lesson 10's exercises, which the
lesson's notebook does not import: :mod:`.resume` (atomic snapshot files, exact resume; used
by ``scripts/resumable_train.py``) and :mod:`.desync` (where the ranks' collective logs part).
Restarts under torchrun: :mod:`mgpu_lab.launcher.elastic`.
"""

"""When training fails, lesson 10: snapshots and exact resume, hangs, NaNs and drifted ranks.

:mod:`.snapshot` (RNG state, reading a snapshot back), :mod:`.snapshot_cost` (how often to
snapshot), :mod:`.hangs` (timeouts, debug levels, the flight recorder) and :mod:`.health`
(errors that are not hangs). Restarts under torchrun: :mod:`mgpu_lab.launcher.elastic`.
"""

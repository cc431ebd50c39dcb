"""The launcher: start N ranks from a notebook or a script, and everything a launch needs.

``launch`` (the public entry point, also ``from mgpu_lab import launch``), ``job``
(one launch: ranks, pipes, failures, hangs), ``errors`` (``LaunchError``,
``LaunchTimeout`` and the wording of a rank's failure), ``rank`` (what runs
inside each rank), ``procs`` (the forkserver and process-tree clean-up),
``lifetime`` (nothing of a launch outlives it: the lifeline, each rank's
process group and guard, Ctrl-C held back during start-up), ``server``
(preloaded by the forkserver only: its quick exit), ``relay`` (rank
output, prefixed and live), ``progressbars`` (per-rank progress bars), and
``elastic`` with ``torchrun_worker`` (real ``torchrun`` from a notebook, a test or
a check, as lessons 07 and 10 use it).

Kept empty on purpose: ranks import ``mgpu_lab.launcher.rank`` without starting
the forkserver that importing ``mgpu_lab.launcher.launch`` starts.
"""

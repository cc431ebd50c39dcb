"""The course's plumbing that every part shares, one module per job.

- :mod:`mgpu_lab.core.libc`: the Linux calls Python's standard library lacks
  (``mount``, ``umount2``, ``setns``, ``unshare``, ``prctl``), raising
  ``OSError`` with the errno; used by the launcher, ``cluster/`` and ``course/``.
- :mod:`mgpu_lab.core.procenv`: the process environment (torchrun and rank
  variables, a child's environment, a private TMPDIR per run).
- :mod:`mgpu_lab.core.compat`: torch 2.13's collective names on older releases.

``dist`` and ``devices`` (rank information and devices) stay where learners and
scripts import them: ``from mgpu_lab import dist, devices``.
"""

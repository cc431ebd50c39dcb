"""The course's plumbing that every part shares, one module per job.

- :mod:`mgpu_lab.core.libc`: the Linux calls Python's standard library lacks
  (``mount``, ``umount2``, ``setns``, ``unshare``, ``prctl``), raising
  ``OSError`` with the errno; used by the launcher, ``cluster/`` and ``course/``.

``dist`` and ``devices`` (rank information and devices) stay where learners and
scripts import them: ``from mgpu_lab import dist, devices``.
"""

"""Replicas and stages: DataParallel, DDP training and its checkpoints, a model split over devices.

Lessons 03 (``nn.DataParallel`` around its steps: :mod:`.dp_tools`, devices, threads, a timeline,
timing), 04 (DDP training: :mod:`.baseline`, one process with the global batch to measure a run
against, and :mod:`.checkpoint`, rank-0 checkpoints) and 06 (stages on devices, and DDP over replicas
that span two devices: :mod:`.model_parallel`), with the busy/idle :mod:`.timeline` they plot. The
pipelines of lessons 06 and 12 are :mod:`mgpu_lab.pipelining`'s. The training loops that ``scripts/``
and the benchmarks run live in modules of their own.
"""

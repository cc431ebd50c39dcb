"""Replicas and stages: DataParallel, DDP training and its checkpoints, model parallel and pipelines.

Lessons 03 (``nn.DataParallel`` around its steps: :mod:`.dp_tools`, devices, threads, a timeline,
timing), 04 (DDP training: :mod:`.baseline`, one process with the global batch to measure a run
against, and :mod:`.checkpoint`, rank-0 checkpoints) and 06 (stages on devices and on ranks:
:mod:`.model_parallel`, :mod:`.pipeline`, :mod:`.pinning`), with the busy/idle :mod:`.timeline` they
plot. Lesson 12 (pipeline schedules) measures torch's schedules with :mod:`.pp_measure` on the
fixed-work layers of :mod:`.pp_work`, timed in the ranks by :mod:`.pp_record`, and reads torch's own orders
with :mod:`.pp_torch`. The training loops
that ``scripts/`` and the benchmarks run live in modules of their own.
"""

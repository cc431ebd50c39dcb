"""Replicas and stages: DataParallel, DDP training and its checkpoints, model parallel and pipelines.

Lessons 03 (``nn.DataParallel`` step by step: :mod:`.data_parallel`, the
reference of its exercises, and :mod:`.dp_tools`, what its notebook uses), 04 (DDP
training: :mod:`.ddp`, :mod:`.baseline`, :mod:`.checkpoint`) and 06 (stages on devices and on ranks:
:mod:`.model_parallel`, :mod:`.pipeline`, :mod:`.pinning`), with the busy/idle :mod:`.timeline` they plot;
lesson 06's references, which its notebook does not import, are :mod:`.gpipe` and :mod:`.schedule`.
Lesson 12 (pipeline schedules) measures torch's schedules with :mod:`.pp_measure` on the fixed-work
layers of :mod:`.pp_work`, timed in the ranks by :mod:`.pp_record`; its references, which its notebook
does not import, are :mod:`.pp_orders` (each schedule's order of actions and its replay) and
:mod:`.pp_train` (training with any schedule, PP x DP).
"""

"""Pipeline parallelism, lessons 06 and 12: a model's stages on ranks, micro-batches through them, schedules.

Lesson 06 (GPipe): :mod:`.gpipe` times GPipe's step on one process and gives the bubble of a measured
step, :mod:`.schedule` replays GPipe's schedule from stage, transfer and host times, and
:mod:`.pipeline` runs torch's GPipe across real ranks with every micro-batch timed, each rank pinned to
its own core (:mod:`.pinning`). Lesson 12 (schedules): :mod:`.measure` runs torch's schedules on the
fixed-work layers of :mod:`.work`, timed in the ranks by :mod:`.record`, against a fitted model;
:mod:`.orders` gives each schedule's order of actions per rank and replays it, with torch's own
interleaved and ZBV orders read by :mod:`.torch_orders`; :mod:`.train` trains with torch's schedules,
PP alone or PP x DP (what ``scripts/pp_train.py`` runs). The stages on devices, the busy/idle
timeline and DDP over two-device replicas stay in :mod:`mgpu_lab.parallel`.
"""

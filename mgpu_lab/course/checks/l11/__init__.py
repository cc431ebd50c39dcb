"""Checks of lesson 11 (tensor parallelism): 11.tp_mlp, 11.sp_mlp, 11.tp_plan, 11.parallelize_2d, 11.tp_bytes.

Every lesson's checks have the same three modules: ``checkers`` (the exercises,
registered with their cases and hints), ``ranks`` (what runs in the check's fresh
process or real ranks, returning plain evidence) and ``judges`` (what the kernel
concludes from that evidence). Only ``checkers`` is imported by the registry, and only
when lesson 11 is checked.
"""

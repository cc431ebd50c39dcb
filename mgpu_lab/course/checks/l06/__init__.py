"""Checks of lesson 06 (model parallel and pipelining): 06.stage_step, 06.pipeline_step, 06.pipelined_step, 06.bubble_fraction.

Every lesson's checks have the same three modules: ``checkers`` (the exercises,
registered with their cases and hints), ``ranks`` (what runs in the check's fresh
process or real ranks, returning plain evidence) and ``judges`` (what the kernel
concludes from that evidence). Only ``checkers`` is imported by the registry, and only
when lesson 06 is checked.
"""

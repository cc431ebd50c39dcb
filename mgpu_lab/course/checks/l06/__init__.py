"""Checks of lesson 06 (model parallel and pipelining): stage_step, pipeline_step, pipelined_step, bubble_fraction.

Every lesson's checks have the same three modules: ``checkers`` (the exercises,
registered with their cases and hints), ``ranks`` (what runs in the check's fresh
process or real ranks, returning plain evidence) and ``judges`` (what the kernel
concludes from that evidence). Only ``checkers`` is imported by the registry, and only
when lesson 06 is checked.
"""

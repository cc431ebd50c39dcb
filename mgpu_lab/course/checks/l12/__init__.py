"""Checks of lesson 12 (pipeline schedules): 12.one_f_one_b, 12.bubble, 12.run_schedule.

Every lesson's checks have the same three modules: ``checkers`` (the exercises,
registered with their cases and hints), ``ranks`` (what runs in the check's fresh
process or real ranks, returning plain evidence) and ``judges`` (what the kernel
concludes from that evidence). Only ``checkers`` is imported by the registry, and only
when lesson 12 is checked.
"""

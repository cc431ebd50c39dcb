"""Checks of lesson 09 (inside DDP): 09.ring_allreduce, 09.MiniDDP, 09.error_feedback_hook.

Every lesson's checks have the same three modules: ``checkers`` (the exercises,
registered with their cases and hints), ``ranks`` (what runs in the check's fresh
process or real ranks, returning plain evidence) and ``judges`` (what the kernel
concludes from that evidence). Only ``checkers`` is imported by the registry, and only
when lesson 09 is checked.
"""

"""Checks of lesson 07 (multi-node torchrun): 07.hierarchical_allreduce, 07.torchrun_command,
07.pick_interface.

Every lesson's checks have the same three modules: ``checkers`` (the exercises,
registered with their cases and hints), ``ranks`` (what runs in the check's fresh
process or real ranks, returning plain evidence) and ``judges`` (what the kernel
concludes from that evidence). Only ``checkers`` is imported by the registry, and only
when lesson 07 is checked.
"""

"""Checks of lesson 05 (balanced samplers, uneven inputs): 05.BalancedDistributedSampler, 05.train_uneven.

Every lesson's checks have the same three modules: ``checkers`` (the exercises,
registered with their cases and hints), ``ranks`` (what runs in the check's fresh
process or real ranks, returning plain evidence) and ``judges`` (what the kernel
concludes from that evidence). Only ``checkers`` is imported by the registry, and only
when lesson 05 is checked.
"""

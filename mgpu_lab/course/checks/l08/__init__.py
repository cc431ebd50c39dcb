"""Checks of lesson 08 (sharding: ZeRO, FSDP2, DCP): 08.sharded_sgd_step, 08.ShardedAdam,
08.build_sharded, 08.load_full_into_sharded.

Every lesson's checks have the same three modules: ``checkers`` (the exercises,
registered with their cases and hints), ``ranks`` (what runs in the check's fresh
process or real ranks, returning plain evidence) and ``judges`` (what the kernel
concludes from that evidence). Only ``checkers`` is imported by the registry, and only
when lesson 08 is checked.
"""

"""Checks of lesson 04 (DDP and DistributedSampler): 04.shard_indices, 04.ddp_train, 04.download_once, 04.global_mean.

Every lesson's checks have the same three modules: ``checkers`` (the exercises,
registered with their cases and hints), ``ranks`` (what runs in the check's fresh
process or real ranks, returning plain evidence) and ``judges`` (what the kernel
concludes from that evidence). Only ``checkers`` is imported by the registry, and only
when lesson 04 is checked.
"""

"""Sharded training, lesson 08: ZeRO by hand, FSDP2, and distributed checkpoints.

:mod:`.zero` (what a rank holds, the formula, a flat parameter's sharded update),
:mod:`.fsdp` (``fully_shard`` in a rank), :mod:`.side_by_side` (DDP, ZeRO-1/2 and
FSDP2 measured in the same ranks) and :mod:`.distcp` (DCP: save at one world size,
load at another).
"""

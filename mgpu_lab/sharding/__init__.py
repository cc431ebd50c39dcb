"""Sharded training, lesson 08: ZeRO by hand, FSDP2, and distributed checkpoints.

:mod:`.zero` (what a rank holds, the formula), :mod:`.fsdp` (FSDP2 in a rank: the mesh,
full tensors back, peak memory), :mod:`.side_by_side` (DDP, ZeRO-1/2 and FSDP2 measured in
the same ranks, and the lesson's demos in ranks) and :mod:`.distcp` (DCP: save at one world
size, load at another).
"""

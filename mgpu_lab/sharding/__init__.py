"""Sharded training, lesson 08: ZeRO by hand, FSDP2, and distributed checkpoints.

:mod:`.zero` (what a rank holds, the formula), :mod:`.flat` (ZeRO by hand on a flat
parameter), :mod:`.fsdp` (FSDP2 in a rank: the mesh, full tensors back, peak memory),
:mod:`.wrap` (``fully_shard`` on every block, then the root), :mod:`.side_by_side`
(DDP, ZeRO-1/2 and FSDP2 measured in the same ranks, and the lesson's demos in ranks)
and :mod:`.distcp` (DCP: save at one world size, load at another). The lesson's
notebook imports neither :mod:`.flat` nor :mod:`.wrap`: its exercises build them.
"""

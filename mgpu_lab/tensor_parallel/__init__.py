"""Tensor and sequence parallelism, lesson 11: a layer's computation split over ranks, and 2D meshes.

:mod:`.block` (the lesson's transformer block, a stack of them, the named ``("dp", "tp")``
mesh) and :mod:`.measure` (what a TP step costs: bytes handed to collectives per step and per
mesh dimension, activation bytes autograd saves per module, the table of DP, FSDP, TP, TP+SP
and 2D) are what the lesson's notebook uses, with :mod:`.figures` (diagrams of the column/row
split and of sequence parallelism).
"""

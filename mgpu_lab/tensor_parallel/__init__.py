"""Tensor and sequence parallelism, lesson 11: a layer's computation split over ranks, and 2D meshes.

:mod:`.block` (the lesson's transformer block, a stack of them, the named ``("dp", "tp")``
mesh), :mod:`.measure` (what a TP step costs: bytes handed to collectives per step and per
mesh dimension, activation bytes autograd saves per module, the table of DP, FSDP, TP, TP+SP
and 2D) and :mod:`.plans` (the plans and the 2D wrap that the lesson's exercises build:
used by ``scripts/tp_train.py``, never imported by the lesson's notebook).
"""

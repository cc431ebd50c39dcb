"""Long sequences across ranks, lesson 14: context parallelism (CP).

:mod:`.layout` cuts a sequence into one shard per rank, ``"contiguous"`` or ``"zigzag"``
(the sequence in ``2W`` chunks, rank ``r`` holding chunks ``r`` and ``2W-1-r``), and
puts the shards back together; :mod:`.flops` counts a rank's attention FLOPs with
``torch.utils.flop_counter`` (including the CPU's attention kernel, which the counter
does not know); :mod:`.gather` is all-gather CP (Llama 3's choice: gather K and V,
attend locally); :mod:`.measure` runs an attention on W ranks and measures what each
rank sends, holds and computes, against sequence length and CP degree; :mod:`.figures` draws
the causal mask cut into ranks' blocks; :mod:`.torch_cp` runs torch's own ``context_parallel``
where CUDA GPUs allow it and says why not elsewhere; :mod:`.compose` records which group every
collective of a CP x DP and an EP x DP training step uses on a (2, 2) mesh.
"""

"""Profiling, lesson 13 (where the time and the memory go): traces, activation memory, ``torch.compile``.

:mod:`.traces` runs ``torch.profiler`` on every rank of a launch and writes one Chrome
trace per rank (and, on a GPU, the CUDA allocator's memory snapshot); :mod:`.lanes`
draws a trace's compute and communication lanes per rank and tabulates its operators;
:mod:`.blocks` holds the transformer blocks whose activation memory the lesson counts,
the formula for a block's activation bytes and a selective-checkpointing policy;
:mod:`.runs` the lesson's profiled DDP and FSDP2 steps and its measurements of
checkpointing and compilation; :mod:`.uneven` profiled DDP steps whose ranks do unequal work (a
slow loader, extra compute, a larger batch on a rank).
"""

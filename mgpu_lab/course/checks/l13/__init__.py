"""Checks of lesson 13 (where the time and the memory go): 13.exposed_comm, 13.find_straggler, 13.saved_bytes,
13.checkpoint_under.

Every lesson's checks have the same three modules: ``checkers`` (the exercises,
registered with their cases and hints), ``ranks`` (what runs in the check's fresh
process or real ranks, returning plain evidence; here also the checks' own answers
to ``saved_bytes`` and ``checkpoint_under``: ``reference_saved_bytes``,
``reference_checkpoint_under``) and ``judges`` (what the kernel concludes from that
evidence; here also ``reference_exposed_comm`` and ``reference_find_straggler``, the checks' own
``exposed_comm`` and ``find_straggler``).
Only ``checkers`` is imported by the registry, and only when lesson 13 is checked.
"""

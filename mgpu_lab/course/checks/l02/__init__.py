"""Checks of lesson 02 (DataLoader tuning): 02.make_loader, 02.seed_worker, 02.best_num_workers.

Every lesson's checks have the same three modules: ``checkers`` (the exercises,
registered with their cases and hints), ``ranks`` (what runs in the check's fresh
process or real ranks, returning plain evidence) and ``judges`` (what the kernel
concludes from that evidence). Only ``checkers`` is imported by the registry, and only
when lesson 02 is checked.
"""

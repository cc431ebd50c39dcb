"""Communication, lesson 09 (inside DDP): collectives, what they cost, and DDP's buckets, hooks and options.

:mod:`.collectives` (each collective on real ranks, a ring all-reduce from send/recv),
:mod:`.cost_model` (timed all-reduce, the alpha-beta model), :mod:`.ddp_buckets`,
:mod:`.ddp_hooks`, :mod:`.ddp_options`, and the recorders of what a rank communicates.
"""

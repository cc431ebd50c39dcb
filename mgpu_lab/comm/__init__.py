"""Communication, lesson 09 (inside DDP): collectives, what they cost, and DDP's buckets, hooks and options.

:mod:`.collectives` (each collective on real ranks, a ring all-reduce from send/recv),
:mod:`.cost_model` (timed all-reduce, the alpha-beta model), :mod:`.ddp_buckets`,
:mod:`.ddp_hooks`, :mod:`.ddp_options`, and :mod:`.record`, the one recorder of what a
rank communicates: every send, receive and collective, called through ``torch.distributed``
(your code, DDP's communication hooks, FSDP2) or as the functional collectives that DTensor
issues, and deadlocks of sends and receives. Lessons 08 and 09, and those after them,
show and judge communication with it.
"""

"""Many experts across ranks, lesson 14: expert parallelism (mixture of experts, MoE).

:mod:`.router` is what a router decides and costs, on one process: top-k probabilities,
tokens per expert, the capacity an expert is given and what it drops, and the
load-balancing auxiliary loss; :mod:`.measure` trains a small top-k model on one process
with and without that loss (tokens per expert as training goes) and records what a
mixture-of-experts layer's all-to-alls send on real ranks, against top-k and tokens.
"""

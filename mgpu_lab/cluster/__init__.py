"""The simulated cluster of lesson 07: ``netns`` (network namespaces joined by
veth links), ``multinode`` (real torchrun on simulated nodes), ``noderunner`` (one run across
the nodes: start, relay, stop), ``nodelogs`` (node
runs and their logs), ``troubleshoot`` (the failures of the troubleshooting table,
reproduced) and ``slurm`` (sbatch scripts).
"""

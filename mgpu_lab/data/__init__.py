"""Data for many ranks: data sets and archives, DataLoader throughput, samplers, balanced work.

Lessons 02 (DataLoader tuning: :mod:`.images`, :mod:`.throughput`),
04 (one shard per rank: :mod:`.datasets`, :mod:`.download`, :mod:`.per_node`, :mod:`.sampler_view`) and
05 (equal work, not equal counts: :mod:`.workload`, :mod:`.samplers`, :mod:`.uneven`).
"""

"""Lesson 14's diagram: the causal mask of a whole sequence cut into ranks' blocks, in either layout.

Rows are queries and columns keys, both in sequence order; a cell a query may attend to
(its own position and every earlier one) takes the colour of the rank holding that query,
and the grid marks the blocks of one rank's queries against one rank's keys. Beside each
panel, each rank's count of blocks holding at least one allowed (query, key) pair.

Example:
    >>> axes = plot_causal_blocks(world=2, seq=8)
    >>> [ax.get_title() for ax in axes]
    ['contiguous: blocks with work per rank [1, 2]', 'zigzag: blocks with work per rank [2, 2]']
"""
from __future__ import annotations

import torch

from .layout import LAYOUTS, shard

__all__ = ["plot_causal_blocks", "owners"]


def owners(seq: int, world: int, layout: str) -> torch.Tensor:
    """For each position of the sequence, the rank holding it."""
    owner = torch.empty(seq, dtype=torch.long)
    for r in range(world):
        owner[shard(torch.arange(seq), r, world, layout, dim=0)] = r
    return owner


def plot_causal_blocks(world: int = 4, seq: int = 32):
    """Two panels (contiguous, zig-zag): the causal mask coloured by the query's rank; returns the axes."""
    import matplotlib
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 2, figsize=(9, 4.4))
    colours = matplotlib.colormaps["tab10"]
    pos = torch.arange(seq)
    allowed = pos[:, None] >= pos[None, :]
    for ax, layout in zip(axes, LAYOUTS):
        owner = owners(seq, world, layout)
        image = np.ones((seq, seq, 3))
        for r in range(world):
            rows = (owner == r)[:, None] & allowed
            image[rows.numpy()] = colours(r)[:3]
        ax.imshow(image, interpolation="nearest")
        edges = [i - 0.5 for i in range(1, seq) if owner[i] != owner[i - 1]]
        for e in edges:
            ax.axhline(e, color="k", lw=0.6)
            ax.axvline(e, color="k", lw=0.6)
        work = [sum(bool(allowed[owner == r][:, owner == s].any()) for s in range(world)) for r in range(world)]
        ax.set_title(f"{layout}: blocks with work per rank {work}")
        ax.set_xlabel("key position")
        ax.set_ylabel("query position")
    handles = [matplotlib.patches.Patch(color=colours(r), label=f"rank {r}'s queries") for r in range(world)]
    fig.legend(handles=handles, loc="lower center", ncol=world)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return list(axes)

"""Which positions of a sequence each rank holds: contiguous and zig-zag shards.

Context parallelism cuts the sequence of ``S`` positions into one shard per rank. In the
``"contiguous"`` layout rank ``r`` holds positions ``r*S/W .. (r+1)*S/W - 1``; in the
``"zigzag"`` layout the sequence is cut into ``2W`` chunks and rank ``r`` holds chunk ``r``
followed by chunk ``2W-1-r``, so every rank holds one early and one late chunk.

Example:
    >>> x = torch.arange(8)
    >>> [shard(x, r, 2, "zigzag", dim=0).tolist() for r in range(2)]
    [[0, 1, 6, 7], [2, 3, 4, 5]]
    >>> unshard([shard(x, r, 2, "zigzag", dim=0) for r in range(2)], "zigzag", dim=0).tolist()
    [0, 1, 2, 3, 4, 5, 6, 7]
    >>> print(layout_table(8, 2))
    layout      rank 0       rank 1
    contiguous  0-3          4-7
    zigzag      0-1, 6-7     2-3, 4-5
"""
from __future__ import annotations

import torch

__all__ = ["LAYOUTS", "chunks_of", "shard", "unshard", "layout_table"]

LAYOUTS = ("contiguous", "zigzag")


def chunks_of(rank: int, world_size: int, layout: str) -> list[int]:
    """The chunks rank ``rank`` holds, in order: ``[rank]`` of W chunks, or ``[rank, 2W-1-rank]`` of 2W.

    Raises:
        ValueError: an unknown layout, or a rank outside ``0 .. world_size - 1``.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: use one of {LAYOUTS}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is not one of the {world_size} ranks 0..{world_size - 1}")
    return [rank] if layout == "contiguous" else [rank, 2 * world_size - 1 - rank]


def _pieces(length: int, world_size: int, layout: str) -> int:
    pieces = world_size if layout == "contiguous" else 2 * world_size
    if length % pieces:
        raise ValueError(f"a sequence of {length} positions does not split into {pieces} equal chunks "
                         f"({layout} layout on {world_size} ranks): pad it to a multiple of {pieces}")
    return pieces


def shard(x: torch.Tensor, rank: int, world_size: int, layout: str, dim: int = -2) -> torch.Tensor:
    """Rank ``rank``'s rows of ``x`` along ``dim`` (the sequence), in ``layout`` (a new tensor)."""
    pieces = _pieces(x.shape[dim], world_size, layout)
    parts = x.chunk(pieces, dim=dim)
    return torch.cat([parts[c] for c in chunks_of(rank, world_size, layout)], dim=dim)


def unshard(shards: list, layout: str, dim: int = -2) -> torch.Tensor:
    """The whole sequence from every rank's shard (``shards[r]`` is rank r's), positions in order."""
    world_size = len(shards)
    per = 1 if layout == "contiguous" else 2
    parts: list = [None] * (per * world_size)
    for rank, piece in enumerate(shards):
        for chunk, part in zip(chunks_of(rank, world_size, layout), piece.chunk(per, dim=dim)):
            parts[chunk] = part
    return torch.cat(parts, dim=dim)


def layout_table(length: int, world_size: int) -> str:
    """Which positions each rank holds in either layout, as a text table."""
    pos = torch.arange(length)
    rows = [["layout"] + [f"rank {r}" for r in range(world_size)]]
    for layout in LAYOUTS:
        cells = []
        for r in range(world_size):
            runs = shard(pos, r, world_size, layout, dim=0).chunk(len(chunks_of(r, world_size, layout)))
            cells.append(", ".join(f"{int(c[0])}-{int(c[-1])}" for c in runs))
        rows.append([layout] + cells)
    widths = [max(len(row[i]) for row in rows) + 2 for i in range(len(rows[0]))]
    return "\n".join("".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)

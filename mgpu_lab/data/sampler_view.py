"""Seeing what ``DistributedSampler`` does: index tables, grid plots, an explorer.

Everything here asks the real ``torch.utils.data.DistributedSampler`` (no
re-implementation), so the pictures show exactly what a training job gets.

Example:
    >>> sampler_indices(10, rank=1, world_size=4)          # padded with duplicates
    [1, 5, 9]
    >>> sampler_indices(10, rank=1, world_size=4, drop_last=True)
    [1, 5]
"""
from __future__ import annotations

from torch.utils.data import DistributedSampler

__all__ = ["sampler_indices", "shards", "assignment", "plot_assignment", "plot_shards", "explorer"]


def sampler_indices(n: int, rank: int, world_size: int, shuffle: bool = False, seed: int = 0,
                    epoch: int = 0, drop_last: bool = False) -> list[int]:
    """The indices ``DistributedSampler`` yields to ``rank`` for a data set of ``n`` samples.

    Args:
        n: data set length.
        rank, world_size: which shard, out of how many (``num_replicas``).
        shuffle, seed, drop_last: as in ``DistributedSampler``.
        epoch: the value passed to ``sampler.set_epoch``.

    Returns:
        The indices in the order the rank sees them.

    Raises:
        ValueError: ``rank`` outside ``0..world_size-1`` (DistributedSampler's own message).

    Example:
        >>> sampler_indices(6, 0, 2, shuffle=True, seed=0, epoch=1)   # randperm(6) seeded 1: [1, 5, 2, 0, 3, 4]
        [1, 2, 3]
    """
    sampler = DistributedSampler(range(n), num_replicas=world_size, rank=rank, shuffle=shuffle,
                                 seed=seed, drop_last=drop_last)
    sampler.set_epoch(epoch)
    return list(sampler)


def shards(n: int, world_size: int, epoch: int = 0, **kwargs) -> list[list[int]]:
    """Every rank's indices for one epoch: ``shards(...)[rank]``.

    Example:
        >>> shards(5, 2)
        [[0, 2, 4], [1, 3, 0]]
    """
    return [sampler_indices(n, r, world_size, epoch=epoch, **kwargs) for r in range(world_size)]


def assignment(n: int, world_size: int, epochs: int, set_epoch: bool = True, **kwargs) -> list[list[list[int]]]:
    """Which ranks get each sample, per epoch: ``assignment(...)[epoch][sample]`` lists ranks.

    An empty list means the sample was dropped (``drop_last=True``); two entries
    mean it was duplicated as padding. ``set_epoch=False`` reproduces the bug of
    never calling ``sampler.set_epoch``: every epoch is epoch 0.

    Example:
        >>> assignment(5, 2, 1)[0]
        [[0, 1], [1], [0], [1], [0]]
    """
    table = []
    for epoch in range(epochs):
        row: list[list[int]] = [[] for _ in range(n)]
        for r, indices in enumerate(shards(n, world_size, epoch if set_epoch else 0, **kwargs)):
            for i in indices:
                row[i].append(r)
        table.append(row)
    return table


def _rank_colours(world_size: int):
    import matplotlib

    cmap = matplotlib.colormaps["tab10"]
    palette = [cmap(i) for i in (0, 1, 2, 4, 5, 6, 8, 9, 7)]  # no red: red marks padding
    return [palette[r % len(palette)] for r in range(world_size)]


def plot_assignment(n: int, world_size: int, epochs: int = 3, set_epoch: bool = True, ax=None, **kwargs):
    """Grid plot: one row per epoch, one column per sample, coloured by the rank that gets it.

    Each cell also shows the sample's position in that rank's order, so a
    reshuffle is visible; padding duplicates are split cells marked ``x2``,
    dropped samples are left white and marked ``-``.

    Args:
        n, world_size, epochs: data set length, ranks, epochs to draw.
        set_epoch: ``False`` draws the bug (the same order every epoch).
        ax: a matplotlib Axes to draw into (a new figure otherwise).
        **kwargs: ``shuffle``, ``seed``, ``drop_last`` for the sampler.

    Returns:
        The Axes.

    Example:
        >>> ax = plot_assignment(12, 3, epochs=3, shuffle=True)
        >>> len(ax.patches) >= 12 * 3   # a cell per sample and epoch
        True
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    kwargs.setdefault("shuffle", True)
    if ax is None:
        _, ax = plt.subplots(figsize=(max(6.0, 0.42 * n), 0.55 * epochs + 1.3))
    colours = _rank_colours(world_size)
    for epoch in range(epochs):
        per_rank = shards(n, world_size, epoch if set_epoch else 0, **kwargs)
        slots: list[list[tuple[int, int]]] = [[] for _ in range(n)]
        for r, indices in enumerate(per_rank):
            for pos, i in enumerate(indices):
                slots[i].append((r, pos))
        for i, got in enumerate(slots):
            if not got:
                ax.text(i + 0.5, epoch + 0.5, "-", ha="center", va="center", color="0.4")
            height = 1.0 / max(1, len(got))
            for k, (r, pos) in enumerate(got):
                ax.add_patch(Rectangle((i, epoch + k * height), 1, height, facecolor=colours[r], edgecolor="white"))
            if got:
                label = f"{got[0][1]}" if len(got) == 1 else f"x{len(got)}"
                ax.text(i + 0.5, epoch + 0.5, label, ha="center", va="center", fontsize=8, color="white")
    ax.set_xlim(0, n)
    ax.set_ylim(epochs, 0)
    ax.set_xticks([i + 0.5 for i in range(n)], [str(i) for i in range(n)], fontsize=8)
    ax.set_yticks([e + 0.5 for e in range(epochs)], [f"epoch {e}" for e in range(epochs)])
    ax.set_xlabel("sample index (cell text: position in that rank's order; x2: padding duplicate)")
    opts = ", ".join(f"{k}={v}" for k, v in sorted(kwargs.items()))
    ax.set_title(f"DistributedSampler: {n} samples, {world_size} ranks, {opts}"
                 + ("" if set_epoch else ", set_epoch never called"), fontsize=10)
    ax.legend(handles=[Patch(color=colours[r], label=f"rank {r}") for r in range(world_size)],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    return ax


def plot_shards(n: int, world_size: int, epoch: int = 0, ax=None, **kwargs):
    """One epoch as a table: one row per rank, the sample indices it gets in order.

    Padding duplicates are red, and the title lists the samples dropped by ``drop_last``.

    Returns:
        The Axes.

    Example:
        >>> ax = plot_shards(10, 4, drop_last=False)   # 10 samples, 4 ranks: 2 padding duplicates
        >>> ax.get_title()
        '...'
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    per_rank = shards(n, world_size, epoch, **kwargs)
    width = max(1, max(len(s) for s in per_rank))
    if ax is None:
        _, ax = plt.subplots(figsize=(max(4.0, 0.5 * width + 1.5), 0.45 * world_size + 1.0))
    seen: set[int] = set()
    colours = _rank_colours(world_size)
    # DistributedSampler lays samples out rank after rank; a repeat is padding.
    order = sorted(((pos, r) for r, s in enumerate(per_rank) for pos in range(len(s))))
    for pos, r in order:
        i = per_rank[r][pos]
        dup = i in seen
        seen.add(i)
        ax.add_patch(Rectangle((pos, r), 1, 1, facecolor="tab:red" if dup else colours[r],
                               edgecolor="white", alpha=1.0 if dup else 0.85))
        ax.text(pos + 0.5, r + 0.5, str(i), ha="center", va="center", fontsize=9, color="white")
    dropped = sorted(set(range(n)) - seen)
    ax.set_xlim(0, width)
    ax.set_ylim(world_size, 0)
    ax.set_yticks([r + 0.5 for r in range(world_size)], [f"rank {r}" for r in range(world_size)])
    ax.set_xticks([])
    opts = ", ".join(f"{k}={v}" for k, v in sorted(kwargs.items()))
    ax.set_title(f"n={n}, world_size={world_size}, epoch={epoch}" + (f", {opts}" if opts else "")
                 + f"\n{len(per_rank[0])} per rank; red: padding duplicates; dropped: {dropped or 'none'}",
                 fontsize=9)
    return ax


def explorer(n: int = 10):
    """An ipywidgets explorer: world size, epoch, drop_last and shuffle, drawn by :func:`plot_shards`.

    Where no widget frontend is running (nbconvert, CI), the widgets still
    render their default view.

    Returns:
        The drawing function that ``ipywidgets.interact`` wrapped (the widgets are displayed).

    Example:
        >>> import contextlib, io
        >>> with contextlib.redirect_stdout(io.StringIO()):   # no frontend here: the default view, as text
        ...     view = explorer(10)
        >>> callable(view)
        True
    """
    import ipywidgets as widgets
    import matplotlib.pyplot as plt

    def draw(world_size=4, epoch=0, drop_last=False, shuffle=True):
        plot_shards(n, world_size, epoch, drop_last=drop_last, shuffle=shuffle)
        plt.show()

    return widgets.interact(draw, world_size=widgets.IntSlider(4, 1, 8, description="world_size"),
                            epoch=widgets.IntSlider(0, 0, 5, description="epoch"),
                            drop_last=widgets.Checkbox(False, description="drop_last"),
                            shuffle=widgets.Checkbox(True, description="shuffle"))

"""Lesson 11's diagrams: how a linear layer is split over TP ranks, and how a block's activations
travel with and without sequence parallelism.

Both draw tensors as boxes, one colour per rank, a grey box for a tensor every rank holds
whole, a hatched box for a partial sum that still has to be added over the ranks, and each
collective in its own colour (the legend names them).

Example:
    >>> ax = plot_column_row(tp=2)
    >>> [t.get_text() for t in ax.get_legend().get_texts()][:3]
    ["rank 0's shard", "rank 1's shard", 'whole, the same on every rank']
"""
from __future__ import annotations

__all__ = ["plot_column_row", "plot_block_flow"]

COLLECTIVE_COLOURS = {"all-reduce": "tab:red", "all-gather": "tab:green", "reduce-scatter": "tab:purple"}
WHOLE = "0.75"
IDENTITY_ENTRY = "identity\n(all-reduce\nin backward)"


def _rank_colour(r: int):
    import matplotlib

    return matplotlib.colormaps["tab10"]((0, 1, 2, 4, 5, 6, 8, 9)[r % 8])


def _box(ax, x, y, w, h, face, text="", hatch=None, fontsize=8):
    from matplotlib.patches import Rectangle

    ax.add_patch(Rectangle((x, y), w, h, facecolor=face, edgecolor="black", lw=0.8, hatch=hatch))
    if text:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize,
                bbox={"facecolor": "white", "edgecolor": "none", "pad": 1} if hatch else None)


def _arrow(ax, x0, x1, y, colour="black", text="", lw=1.2, ls="-"):
    ax.annotate("", (x1, y), (x0, y), arrowprops={"arrowstyle": "->", "color": colour, "lw": lw, "ls": ls})
    if text:
        ax.text((x0 + x1) / 2, y + 0.12, text, ha="center", va="bottom", fontsize=7 if len(text) < 12 else 6,
                color=colour)


def plot_column_row(tp: int = 2, ax=None):
    """Megatron's MLP on ``tp`` ranks: ``fc1`` split by output features (column-parallel), ``fc2``
    by input features (row-parallel), one all-reduce of the output forward, one of ``x``'s gradient
    backward.

    Args:
        tp: the number of TP ranks drawn (1 to 8).
        ax: a matplotlib Axes to draw into (a new figure otherwise).

    Returns:
        The Axes.
    """
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    if not 1 <= tp <= 8:
        raise ValueError(f"tp={tp}: draw 1 to 8 ranks")
    if ax is None:
        _, ax = plt.subplots(figsize=(11, 1.1 + 1.1 * tp))
    red = COLLECTIVE_COLOURS["all-reduce"]
    for r in range(tp):
        y, c = (tp - 1 - r) * 1.2, _rank_colour(r)
        _box(ax, 0, y, 1.0, 0.9, WHOLE, "x\n[b, d]")
        _arrow(ax, 1.05, 1.75, y + 0.45)
        _box(ax, 1.8, y, 1.2, 0.9, c, f"fc1 rows\n{r}/{tp} [h/{tp}, d]")
        _arrow(ax, 3.05, 3.75, y + 0.45, text="GELU")
        _box(ax, 3.8, y, 1.0, 0.9, c, f"h slice {r}\n[b, h/{tp}]")
        _arrow(ax, 4.85, 5.55, y + 0.45)
        _box(ax, 5.6, y, 1.2, 0.9, c, f"fc2 columns\n{r}/{tp} [d, h/{tp}]")
        _arrow(ax, 6.85, 7.55, y + 0.45)
        _box(ax, 7.6, y, 1.0, 0.9, c, "partial y\n[b, d]", hatch="//")
        _arrow(ax, 8.65, 9.35, y + 0.45, red, "sum")
        _box(ax, 9.4, y, 1.0, 0.9, WHOLE, "y + b2\n[b, d]")
    top = tp * 1.2 - 0.1
    if tp > 1:  # the two all-reduces run across the ranks: forward the partial outputs, backward x's gradient
        ax.plot([9.0, 9.0], [0.45, (tp - 1) * 1.2 + 0.45], color=red, lw=2)
        ax.plot([1.4, 1.4], [0.45, (tp - 1) * 1.2 + 0.45], color=red, lw=2, ls="--")
    ax.text(0.5, top + 0.1, "whole input\non every rank", ha="center", fontsize=8)
    ax.text(2.4, top + 0.1, "column-parallel\n(no communication)", ha="center", fontsize=8)
    ax.text(6.2, top + 0.1, "row-parallel\n(partial sums)", ha="center", fontsize=8)
    ax.text(9.0, top + 0.1, "ReduceFromTP:\nall-reduce", ha="center", fontsize=8, color=red)
    ax.text(0.5, -0.45, "CopyToTP: identity forward,\nall-reduce of x's gradient backward", ha="left",
            fontsize=8, color=red)
    handles = [Patch(facecolor=_rank_colour(r), edgecolor="black", label=f"rank {r}'s shard") for r in range(tp)]
    handles += [Patch(facecolor=WHOLE, edgecolor="black", label="whole, the same on every rank"),
                Patch(facecolor="white", edgecolor="black", hatch="//", label="partial sum (still to be added)"),
                Line2D([], [], color=red, label="all-reduce (forward)"),
                Line2D([], [], color=red, ls="--", label="all-reduce (x's gradient, backward)")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.set_xlim(-0.1, 10.5)
    ax.set_ylim(-0.9, top + 0.8)
    ax.axis("off")
    ax.set_title(f"MLP on {tp} TP ranks: column-parallel fc1, GELU on the slices, row-parallel fc2", fontsize=10)
    return ax


def _tensor(ax, x, y, kind: str, tp: int, text: str):
    """One activation: "whole" (grey), "seq" (split along the sequence: one colour per rank, stacked),
    "feat" (split along the features: side by side) or "partial" (hatched)."""
    w, h = 0.7, 1.2
    if kind == "seq":
        for r in range(tp):
            _box(ax, x, y + h - (r + 1) * h / tp, w, h / tp, _rank_colour(r))
    elif kind == "feat":
        for r in range(tp):
            _box(ax, x + r * w / tp, y, w / tp, h, _rank_colour(r))
    else:
        _box(ax, x, y, w, h, WHOLE if kind == "whole" else "white", hatch="//" if kind == "partial" else None)
    ax.text(x + w / 2, y - 0.08, text, ha="center", va="top", fontsize=7)


def _flow(ax, y, steps, tp):
    """Draw one row: ``steps`` alternates tensors ``(kind, text)`` and operators ``(label, colour)`` or
    ``(label, colour, linestyle)``."""
    x = 0.0
    for i, step in enumerate(steps):
        if i % 2 == 0:
            _tensor(ax, x, y, step[0], tp, step[1])
            x += 0.7
        else:
            label, colour, ls = (*step, "-") if len(step) == 2 else step
            _arrow(ax, x + 0.05, x + 1.2, y + 0.6, colour, label, lw=2.0 if colour != "black" else 1.2, ls=ls)
            x += 1.25
    return x


def plot_block_flow(tp: int = 2, ax=None):
    """The activations of one transformer block on ``tp`` ranks, without and with sequence parallelism,
    as the lesson's plan places them: which operator sees a slice of the sequence, which the whole
    sequence, and where each collective sits.

    Args:
        tp: the number of TP ranks drawn (1 to 8).
        ax: a matplotlib Axes to draw into (a new figure otherwise).

    Returns:
        The Axes.

    Example:
        >>> ax = plot_block_flow(tp=2)
        >>> "reduce-scatter" in [t.get_text() for t in ax.get_legend().get_texts()]
        True
    """
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    if not 1 <= tp <= 8:
        raise ValueError(f"tp={tp}: draw 1 to 8 ranks")
    if ax is None:
        _, ax = plt.subplots(figsize=(16, 4.4))
    k, ar, ag, rs = "black", *(COLLECTIVE_COLOURS[n] for n in ("all-reduce", "all-gather", "reduce-scatter"))
    entry = (IDENTITY_ENTRY, ar, "--")  # nothing forward; backward all-reduces the input's gradient
    plain = [("whole", "x"), ("norm1", k), ("whole", "normed"), entry, ("whole", "normed"), ("wq wk wv", k),
             ("feat", "heads/tp"), ("wo", k), ("partial", "partial"), ("all-reduce", ar), ("whole", "+ x"),
             ("norm2", k), ("whole", "normed"), entry, ("whole", "normed"), ("fc1", k), ("feat", "hidden/tp"),
             ("fc2", k), ("partial", "partial"), ("all-reduce", ar), ("whole", "+ h")]
    with_sp = [("seq", "x slice"), ("norm1", k), ("seq", "normed"), ("all-gather", ag), ("whole", "whole seq"),
               ("wq wk wv", k), ("feat", "heads/tp"), ("wo", k), ("partial", "partial"), ("reduce-scatter", rs),
               ("seq", "+ x slice"), ("norm2", k), ("seq", "normed"), ("all-gather", ag), ("whole", "whole seq"),
               ("fc1", k), ("feat", "hidden/tp"), ("fc2", k), ("partial", "partial"), ("reduce-scatter", rs),
               ("seq", "+ h slice")]
    width = max(_flow(ax, 2.4, plain, tp), _flow(ax, 0.0, with_sp, tp))
    ax.text(-0.2, 3.0, "without SP", ha="right", va="center", fontsize=9, weight="bold")
    ax.text(-0.2, 0.6, "with SP", ha="right", va="center", fontsize=9, weight="bold")
    handles = [Patch(facecolor=_rank_colour(r), edgecolor="black", label=f"rank {r}'s slice") for r in range(tp)]
    handles += [Patch(facecolor=WHOLE, edgecolor="black", label="whole, on every rank"),
                Patch(facecolor="white", edgecolor="black", hatch="//", label="partial sum"),
                *(Line2D([], [], color=c, lw=2, label=n) for n, c in COLLECTIVE_COLOURS.items()),
                Line2D([], [], color=ar, lw=2, ls="--", label="identity (all-reduce in backward)")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.set_xlim(-1.6, width + 0.1)
    ax.set_ylim(-0.6, 3.9)
    ax.axis("off")
    ax.set_title(f"One block's forward on {tp} TP ranks. Boxes: activations [batch, seq, dim]; a slice of the "
                 "sequence is stacked,\na slice of the features side by side. Backward runs each collective's "
                 "conjugate: all-reduce <-> identity, all-gather <-> reduce-scatter", fontsize=9)
    return ax

"""mgpu_lab.tensor_parallel.figures: the lesson's diagrams draw each rank, each collective and a legend."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from mgpu_lab.tensor_parallel.figures import plot_block_flow, plot_column_row  # noqa: E402


@pytest.mark.parametrize("plot", [plot_column_row, plot_block_flow])
def test_every_rank_has_its_colour_in_the_legend_and_too_many_ranks_are_refused(plot):
    labels = [t.get_text() for t in plot(tp=4).get_legend().get_texts()]
    piece = "shard" if plot is plot_column_row else "slice"
    assert [label for label in labels if label.startswith("rank ")] == [f"rank {r}'s {piece}" for r in range(4)]
    with pytest.raises(ValueError, match="tp=9: draw 1 to 8 ranks"):
        plot(tp=9)
    plt.close("all")


def test_the_block_flow_labels_each_collective_where_the_plan_places_it():
    ax = plot_block_flow(tp=2)
    arrows = [t.get_text() for t in ax.texts]
    assert arrows.count("all-reduce") == 2          # without SP: after attention and after the MLP
    assert arrows.count("all-gather") == 2 and arrows.count("reduce-scatter") == 2   # with SP
    # without SP the entry of each sub-layer is drawn: an identity whose backward all-reduces, before wq/wk/wv and fc1
    row = sorted((t.get_position()[0], t.get_text()) for t in ax.texts
                 if t.get_position()[1] == next(u.get_position()[1] for u in ax.texts if u.get_text() == "all-reduce"))
    labels = [text for _, text in row]
    entries = [i for i, text in enumerate(labels) if text == "identity\n(all-reduce\nin backward)"]
    assert [labels[i + 1] for i in entries] == ["wq wk wv", "fc1"]
    assert "identity (all-reduce in backward)" in [t.get_text() for t in ax.get_legend().get_texts()]
    plt.close("all")

"""mgpu_lab.data.sampler_view: index tables from the real DistributedSampler, the plots, the explorer."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from torch.utils.data import DistributedSampler  # noqa: E402

from mgpu_lab.data import sampler_view  # noqa: E402


def test_sampler_indices_are_the_samplers_own():
    for kwargs in ({"shuffle": False}, {"shuffle": True, "seed": 3, "epoch": 2}, {"shuffle": False, "drop_last": True}):
        epoch = kwargs.pop("epoch", 0)
        sampler = DistributedSampler(range(11), num_replicas=3, rank=2, **kwargs)
        sampler.set_epoch(epoch)
        assert sampler_view.sampler_indices(11, 2, 3, epoch=epoch, **kwargs) == list(sampler)
    with pytest.raises(ValueError, match="rank"):
        sampler_view.sampler_indices(5, 3, 3)


def test_assignment_shows_padding_drops_and_the_set_epoch_bug():
    padded = sampler_view.assignment(10, 4, 1)[0]
    assert padded[0] == [0, 2] and padded[1] == [1, 3] and padded[9] == [1]
    dropped = sampler_view.assignment(10, 4, 1, drop_last=True)[0]
    assert dropped[8] == [] and dropped[9] == []
    bug = sampler_view.assignment(12, 3, 3, set_epoch=False, shuffle=True)
    fixed = sampler_view.assignment(12, 3, 3, shuffle=True)
    assert bug[0] == bug[1] == bug[2] and fixed[0] != fixed[1]


def test_plots_draw_one_cell_per_sample_and_rank_slot():
    ax = sampler_view.plot_assignment(14, 3, epochs=2)
    assert len(ax.patches) == 2 * 15  # 14 samples + 1 padding duplicate per epoch
    ax = sampler_view.plot_shards(10, 4, drop_last=True)
    assert len(ax.patches) == 8 and "dropped: [8, 9]" in ax.get_title()
    ax = sampler_view.plot_shards(10, 4)
    red = [p for p in ax.patches if p.get_facecolor()[:3] == matplotlib.colors.to_rgb("tab:red")]
    assert len(red) == 2
    plt.close("all")


def test_explorer_builds_its_widgets():
    widget = sampler_view.explorer(10)
    plt.close("all")
    assert widget is not None

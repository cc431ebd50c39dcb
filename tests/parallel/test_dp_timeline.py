"""mgpu_lab.parallel.dp_timeline: spans per device lane, recorded from several threads, totals and the plot."""
from __future__ import annotations

import threading

import pytest

from mgpu_lab.parallel.dp_timeline import Timeline


def test_spans_per_lane_from_threads_and_across_every_lane():
    tl = Timeline()
    tl.add_lane("cpu 0")

    def work(lane):
        with tl.span(lane, "forward", "cpu"):
            pass

    threads = [threading.Thread(target=work, args=(f"cpu {i}",)) for i in (1, 0)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    with tl.span(None, "optimizer"):  # no lane: a span of every lane
        pass
    assert sorted(tl.lanes) == ["cpu 0", "cpu 1"] and tl.lanes[0] == "cpu 0"  # added first, listed first
    assert sorted(e[:2] for e in tl.events[:2]) == [("cpu 0", "forward"), ("cpu 1", "forward")]
    assert tl.events[2][:2] == (None, "optimizer")
    assert all(0 <= start <= end for *_, start, end in tl.events)
    assert set(tl.totals()) == {"forward", "optimizer"}
    assert tl.totals()["forward"] == pytest.approx(sum(e[3] - e[2] for e in tl.events if e[1] == "forward"))


def test_plot_and_reset(tmp_path):
    tl = Timeline()
    for phase in ("scatter", "forward", "a phase with no colour"):
        with tl.span("cpu 0", phase):
            pass
    with tl.span(None, "loss+backward"):
        pass
    import matplotlib

    matplotlib.use("Agg")
    ax = tl.plot()
    ax.figure.savefig(tmp_path / "timeline.png")
    assert [t.get_text() for t in ax.get_yticklabels()] == ["cpu 0"]
    tl.reset()
    assert tl.events == []

"""mgpu_lab.parallel.timeline: lesson 03's use (lanes per device, spans from threads, spans of every lane, totals,
the plot); lesson 06's (idle fraction, GPipe) is tested in test_model_parallel.py."""
from __future__ import annotations

import threading

import pytest

from mgpu_lab.parallel.timeline import Timeline


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
    assert sorted(s[:2] for s in tl.spans[:2]) == [("cpu 0", "forward"), ("cpu 1", "forward")]
    assert tl.spans[2][:2] == (None, "optimizer")
    assert all(0 <= start <= end for *_, start, end in tl.shifted().spans)
    assert set(tl.totals()) == {"forward", "optimizer"}
    assert tl.totals()["forward"] == pytest.approx(sum(s[3] - s[2] for s in tl.spans if s[1] == "forward"))
    optimizer = tl.spans[2][3] - tl.spans[2][2]  # a span of every lane: busy time of both lanes
    assert tl.totals()["optimizer"] == pytest.approx(2 * optimizer)
    own = next(s[3] - s[2] for s in tl.spans if s[0] == "cpu 0")
    assert tl.busy("cpu 0") == pytest.approx(own + optimizer)


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
    legend = [text.get_text() for text in ax.get_legend().get_texts()]
    assert legend == ["scatter", "forward", "loss+backward"]  # the phases drawn, in the lesson's order
    tl.reset()
    assert tl.spans == [] and tl.lanes == []  # undeclared lanes go with their spans


def test_an_annotated_pipeline_plot_numbers_micro_batches_lightens_later_stages_and_names_the_kinds():
    import matplotlib

    matplotlib.use("Agg")
    tl = Timeline([("rank 0", "F0/s0", 0, 1), ("rank 0", "F0/s2", 1, 2), ("rank 0", "wait", 2, 3),
                   ("rank 0", "I0/s2", 3, 4), ("rank 0", "W0/s2", 4, 5), ("rank 0", "B0/s0", 5, 6)])
    ax = tl.plot(annotate=True, unit=1.0)
    assert sorted(t.get_text() for t in ax.texts) == ["0"] * 5  # every action's micro-batch, not the wait
    legend = [text.get_text() for text in ax.get_legend().get_texts()]
    assert legend == ["forward", "backward", "input gradient", "weight gradient", "wait for a message",
                      "lighter: the rank's later stage", "numbers: micro-batch"]
    assert [bar.get_alpha() for bar in ax.collections] == [1.0, 0.5, 1.0, 0.5, 0.5, 1.0]
    plain = Timeline([("rank 0", "F0/s0", 0, 1)]).plot(unit=1.0)
    assert len(plain.texts) == 0 and plain.get_legend() is None  # without annotate: as before

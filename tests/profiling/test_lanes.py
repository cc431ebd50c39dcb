"""mgpu_lab.profiling.lanes: the training thread, its lanes, a drawing and a table of operators."""
from __future__ import annotations

import matplotlib

from mgpu_lab.profiling import lanes

matplotlib.use("Agg")


def _x(name, tid, ts, dur, cat="cpu_op"):
    return {"ph": "X", "name": name, "tid": tid, "ts": float(ts), "dur": float(dur), "cat": cat}


TRACE = {"traceEvents": [
    _x("aten::linear", 1, 0, 10), _x("aten::addmm", 1, 1, 8), _x("aten::relu", 1, 12, 3),
    _x("c10d::allreduce_", 1, 16, 2), _x("gloo:all_reduce", 7, 16, 20, "user_annotation"),
    _x("gloo:all_reduce", 8, 20, 5, "user_annotation"), _x("aten::mm", 9, 0, 4),
    _x("ncclDevKernel_AllReduce_Sum_f32", 13, 30, 5, "kernel"), _x("ampere_sgemm", 12, 0, 9, "kernel"),
]}


def test_the_busiest_thread_is_the_one_with_the_most_operator_time():
    assert lanes.busiest_thread(TRACE) == 1
    assert lanes.busiest_thread({"traceEvents": []}) is None


def test_lanes_hold_the_outermost_operators_every_collective_and_a_lane_per_gpu_stream():
    got = dict(lanes.lanes(TRACE))
    assert [label for label, _, _ in got["operators (thread 1)"]] == ["aten::linear", "aten::relu"]
    assert sorted(label for label, _, _ in got["communication"]) == ["c10d::allreduce_", "gloo:all_reduce",
                                                                    "gloo:all_reduce"]
    assert [label for label, _, _ in got["GPU stream 13"]] == ["ncclDevKernel_AllReduce_Sum_f32"]
    assert list(dict(lanes.lanes(TRACE, thread=9))) [0] == "operators (thread 9)"


LABELLED = {"traceEvents": TRACE["traceEvents"] + [
    _x("forward", 1, 0, 11, "user_annotation"), _x("DistributedDataParallel.forward", 1, 0, 10, "user_annotation"),
    _x("backward", 1, 11, 30, "user_annotation"), _x("ProfilerStep#2", 1, 0, 50, "user_annotation"),
    _x("c10d::_allgather_base_", 1, 40, 2), _x("forward", 9, 0, 4, "user_annotation")]}


def test_the_labels_lane_holds_the_training_threads_outermost_labels_only():
    got = dict(lanes.lanes(LABELLED))
    assert [label for label, _, _ in got["labels (thread 1)"]] == ["forward", "backward"]
    assert "labels (thread 1)" not in dict(lanes.lanes(TRACE))  # no labels, no lane


def test_plot_lanes_draws_one_row_per_lane_and_rank():
    ax = lanes.plot_lanes([TRACE, TRACE], title="two ranks")
    assert len(ax.get_yticks()) == 2 * len(lanes.lanes(TRACE))
    assert ax.get_title() == "two ranks"


def test_plot_lanes_writes_the_labels_and_gives_each_communication_kind_its_colour_in_the_legend():
    import matplotlib.pyplot as plt

    ax = lanes.plot_lanes([LABELLED])
    assert {t.get_text() for t in ax.texts} == {"forward", "backward"}
    legend = {t.get_text(): h.get_facecolor() for t, h in zip(ax.get_legend().get_texts(),
                                                               ax.get_legend().legend_handles)}
    kinds = ["c10d::allreduce_", "gloo:all_reduce", "c10d::_allgather_base_"]
    assert set(kinds) | {"GPU kernels", "NCCL kernels"} <= set(legend)
    assert len({legend[k] for k in kinds}) == 3  # one colour per kind
    bars = {tuple(c.get_facecolor()[0][:3]) for c in ax.collections}
    assert all(tuple(legend[k][:3]) in bars for k in kinds)  # the legend's colours are the ones drawn
    plt.close(ax.figure)


def test_op_table_sums_each_operator_of_the_thread():
    assert lanes.op_table(TRACE, top=2) == [("aten::linear", 1, 0.01), ("aten::addmm", 1, 0.008)]

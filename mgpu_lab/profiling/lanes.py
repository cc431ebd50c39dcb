"""A trace drawn: each rank's compute and communication lanes on one time axis; a table of its operators.

:func:`plot_lanes` draws, for every rank's trace (:func:`mgpu_lab.profiling.traces.load_trace`),
the ``record_function`` labels of the training thread (``forward``, ``backward``, ...) written
on their spans, its operators (the training thread is the thread with the most operator time,
or the one named), the communication events of every thread (``c10d::`` calls, the backend's
``gloo:``/``nccl:`` work, on strips that keep overlapping events apart, each kind in a colour
of its own with a legend) and, when the trace has them, the GPU kernels per CUDA stream.
The ranks of one machine share a clock, so their lanes line up. :func:`op_table` lists the operators that took the most time.

Example:
    >>> trace = {"traceEvents": [
    ...     {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "tid": 1, "ts": 0.0, "dur": 900.0},
    ...     {"ph": "X", "cat": "user_annotation", "name": "gloo:all_reduce", "tid": 2, "ts": 500.0, "dur": 800.0}]}
    >>> [(lane, len(spans)) for lane, spans in lanes(trace)]
    [('operators (thread 1)', 1), ('communication', 1)]
    >>> op_table(trace)
    [('aten::mm', 1, 0.9)]
"""
from __future__ import annotations

from collections import defaultdict

from .traces import COLLECTIVE_PREFIXES, complete_events

__all__ = ["busiest_thread", "lanes", "plot_lanes", "op_table"]


def _is_comm(event: dict) -> bool:
    return event["name"].startswith(COLLECTIVE_PREFIXES) or event["name"].lower().startswith("nccl")


def busiest_thread(trace: dict):
    """The thread id with the most ``cpu_op`` time in ``trace`` (None when it has no operator).

    Example:
        >>> busiest_thread({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "a", "tid": 3, "ts": 0, "dur": 5},
        ...                                 {"ph": "X", "cat": "cpu_op", "name": "b", "tid": 4, "ts": 0, "dur": 2}]})
        3
    """
    time = defaultdict(float)
    for e in complete_events(trace):
        if e.get("cat") == "cpu_op":
            time[e["tid"]] += e["dur"]
    return max(time, key=time.get) if time else None


def _is_label(event: dict) -> bool:
    """A ``record_function`` label of the training thread (``forward``, ``backward``...), not a step or a collective."""
    return (event.get("cat") == "user_annotation" and not _is_comm(event)
            and not event["name"].startswith("ProfilerStep#"))


def lanes(trace: dict, thread=None) -> list[tuple[str, list[tuple[str, float, float]]]]:
    """``[(lane name, [(label, start us, end us), ...]), ...]``: the training thread's outermost
    ``record_function`` labels (a lane only when it has some), its operators (outermost only), the communication of every
    thread, and one lane per GPU stream with kernels."""
    thread = busiest_thread(trace) if thread is None else thread
    labels, ops, comm, gpu = [], [], [], defaultdict(list)
    end = label_end = float("-inf")
    for e in sorted(complete_events(trace), key=lambda e: (e["ts"], -e["dur"])):
        span = (e["name"], e["ts"], e["ts"] + e["dur"])
        if _is_comm(e) and e.get("cat") != "kernel":
            comm.append(span)
        elif e.get("cat") == "kernel":
            gpu[f"GPU stream {e['tid']}"].append(span)
        elif e["tid"] == thread and _is_label(e):
            if e["ts"] >= label_end:  # outermost labels only: the step's own, not those of torch inside them
                labels.append(span)
                label_end = span[2]
        elif e.get("cat") == "cpu_op" and e["tid"] == thread and e["ts"] >= end:  # outermost operators only
            ops.append(span)
            end = span[2]
    found = [(f"labels (thread {thread})", labels)] if labels else []
    return found + [(f"operators (thread {thread})", ops), ("communication", comm)] + sorted(gpu.items())


#: Colours of the communication kinds, in the order they first appear in a drawing.
COMM_COLOURS = ("tab:green", "tab:orange", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive",
                "tab:cyan")


def plot_lanes(traces: list[dict], ax=None, title: str = "", thread=None):
    """Draw every rank's lanes (:func:`lanes`) on one time axis, in ms from the first rank's first event.

    The labels lane writes each ``record_function`` label on its span; operators are blue; each kind of
    communication event (``c10d::allreduce_``, ``gloo:all_reduce``, ...) has a colour of its own, named
    in the legend; GPU kernels are grey, NCCL's black.

    Args:
        traces: one trace per rank, in rank order.
        thread: the training thread's id, when it is not the busiest thread of every trace.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = [(f"rank {r} {name}", spans) for r, trace in enumerate(traces) for name, spans in lanes(trace, thread)]
    start = min((a for _, spans in rows for _, a, _ in spans), default=0.0)
    stop = max((b for _, spans in rows for _, _, b in spans), default=start + 1.0)
    if ax is None:
        _, ax = plt.subplots(figsize=(11, 1.0 + 0.45 * len(rows)))
    kinds = list(dict.fromkeys(label for name, spans in rows if name.endswith("communication") for label, _, _ in spans))
    colour = {kind: COMM_COLOURS[i % len(COMM_COLOURS)] for i, kind in enumerate(kinds)}
    for row, (name, spans) in enumerate(rows):
        strips = _strips(spans) if "operators" not in name else [0] * len(spans)
        height = 0.8 / (max(strips, default=0) + 1)
        for (label, a, b), strip in zip(spans, strips):
            x, width, y = (a - start) / 1e3, max(b - a, 1.0) / 1e3, row - 0.4 + strip * height
            fill = ("tab:blue" if "operators" in name else "lightgrey" if "labels" in name
                    else colour[label] if label in colour else "black" if "nccl" in label.lower() else "dimgrey")
            ax.broken_barh([(x, width)], (y, height), color=fill, alpha=0.85, edgecolor="white", linewidth=0.3)
            if "labels" in name and b - a > 0.06 * (stop - start):  # a label only where it fits
                ax.text(x + width / 2, y + height / 2, label, ha="center", va="center", fontsize=7, clip_on=True)
    ax.set_yticks(range(len(rows)), [name for name, _ in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_title(title, fontsize=10)
    handles = [Patch(color="tab:blue", label="operators (training thread)")]
    handles += [Patch(color=colour[k], label=k) for k in kinds]
    if any(name.split(" ", 2)[2].startswith("GPU") for name, _ in rows):
        handles += [Patch(color="dimgrey", label="GPU kernels"), Patch(color="black", label="NCCL kernels")]
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return ax


def _strips(spans) -> list[int]:
    """A strip per span so that overlapping spans (collectives on several threads) do not hide each other."""
    ends, out = [], []
    for _, a, b in spans:
        free = next((i for i, end in enumerate(ends) if end <= a), None)
        if free is None:
            ends.append(b)
            free = len(ends) - 1
        ends[free] = b
        out.append(free)
    return out


def op_table(trace: dict, thread=None, top: int = 8) -> list[tuple[str, int, float]]:
    """The operators of ``thread`` (default: the busiest) with the most time: ``(name, calls, total ms)``.

    Times are inclusive (an operator's time holds the operators it called), so nested ones
    count in both; communication events are listed with the operators that issued them.
    """
    thread = busiest_thread(trace) if thread is None else thread
    calls, total = defaultdict(int), defaultdict(float)
    for e in complete_events(trace):
        if e.get("cat") == "cpu_op" and e["tid"] == thread:
            calls[e["name"]] += 1
            total[e["name"]] += e["dur"]
    names = sorted(total, key=total.get, reverse=True)[:top]
    return [(n, calls[n], round(total[n] / 1e3, 3)) for n in names]

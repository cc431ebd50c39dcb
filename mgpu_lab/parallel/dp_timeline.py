"""The per-device timeline of nn.DataParallel's steps (lesson 03): which phase ran where, and when.

One process runs a DataParallel step: scatter, replicate, then one thread per
device for the forward, gather, backward and the optimizer step. A
:class:`Timeline` records each phase as a span of the lane (device) it ran on,
or of every lane at once (``lane=None``: backward runs through all replicas),
from any of those threads, and draws them as a Gantt chart coloured by phase.
A span on a CUDA device waits for that device, so it ends when its work does.

This is not :class:`mgpu_lab.parallel.timeline.Timeline` (lesson 06), which times
pipeline stages with CUDA events and measures their idle fraction.

Example:
    >>> tl = Timeline()
    >>> with tl.span("cpu 0", "forward"):
    ...     _ = torch.ones(3).sum()
    >>> tl.totals().keys()
    dict_keys(['forward'])
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import torch

__all__ = ["Timeline"]


class Timeline:
    """Spans of work per lane (one lane per device), to plot what ran where and when.

    Example:
        >>> tl = Timeline()
        >>> with tl.span("cpu 0", "forward"):
        ...     _ = torch.ones(3).sum()
        >>> [e[:2] for e in tl.events]
        [('cpu 0', 'forward')]
    """

    COLOURS = {"scatter": "tab:orange", "replicate": "tab:red", "forward": "tab:blue",
               "gather": "tab:purple", "loss+backward": "tab:green", "optimizer": "tab:gray"}

    def __init__(self):
        self.events: list[tuple[str | None, str, float, float]] = []
        self.lanes: list[str] = []
        self.t0 = time.perf_counter()
        self._lock = threading.Lock()

    def add_lane(self, lane: str) -> None:
        if lane not in self.lanes:
            self.lanes.append(lane)

    @contextmanager
    def span(self, lane: str | None, phase: str, device=None):
        """Record the time the body takes in ``lane`` (``None``: every lane); syncs a CUDA ``device``."""
        start = time.perf_counter()
        yield
        if device is not None and torch.device(device).type == "cuda":
            torch.cuda.synchronize(torch.device(device))  # the span ends when the device's work does
        end = time.perf_counter()
        with self._lock:
            if lane is not None:
                self.add_lane(lane)
            self.events.append((lane, phase, start - self.t0, end - self.t0))

    def reset(self) -> None:
        self.events.clear()
        self.t0 = time.perf_counter()

    def totals(self) -> dict[str, float]:
        """Seconds per phase, summed over lanes."""
        out: dict[str, float] = {}
        for _, phase, start, end in self.events:
            out[phase] = out.get(phase, 0.0) + end - start
        return out

    def plot(self, ax=None, title: str = ""):
        """A Gantt chart: one row per lane, one coloured bar per span, time in ms."""
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch

        if ax is None:
            _, ax = plt.subplots(figsize=(9, 0.6 + 0.55 * max(len(self.lanes), 1)))
        rows = list(reversed(self.lanes))
        for lane, phase, start, end in self.events:
            colour = self.COLOURS.get(phase, "tab:olive")
            targets = rows if lane is None else [lane]
            for row in targets:
                ax.broken_barh([(start * 1e3, max(end - start, 1e-6) * 1e3)], (rows.index(row) - 0.35, 0.7),
                               facecolors=colour, edgecolor="white", linewidth=0.4)
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels(rows)
        ax.set_xlabel("time (ms)")
        seen = [p for p in self.COLOURS if any(e[1] == p for e in self.events)]
        ax.legend(handles=[Patch(color=self.COLOURS[p], label=p) for p in seen], ncol=len(seen),
                  loc="upper center", bbox_to_anchor=(0.5, -0.35 if len(rows) < 3 else -0.2), fontsize=8)
        ax.set_title(title or "one process, one thread per device")
        return ax

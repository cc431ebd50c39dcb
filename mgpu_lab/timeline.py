"""Busy/idle timelines of devices or ranks: when each one worked, and the idle fraction.

Spans on the CPU are timed with ``time.perf_counter``, one clock for every
process of a machine, so spans recorded in different ranks line up; spans on a
CUDA device are timed with CUDA events, so recording never makes the host wait
for the GPU.

Example:
    >>> tl = Timeline()
    >>> with tl.span("cpu", "F0"):
    ...     pass
    >>> tl.lanes
    ['cpu']
"""
from __future__ import annotations

import time
from contextlib import contextmanager

import torch

__all__ = ["Timeline"]


class Timeline:
    """Busy spans of several lanes (devices or ranks); idle is everything else.

    Spans on a CUDA device are timed with CUDA events, so the host never waits
    for the GPU while recording; call :meth:`resolve` (done by every reader)
    after the work. CPU spans use ``time.perf_counter``, one clock for every
    process of the machine, so spans recorded in different ranks line up; they
    also count the CPU time the thread got (:attr:`cpu_share`), which shows
    when other processes took the cores.

    Example:
        >>> tl = Timeline()
        >>> tl.add("dev 0", "F0", 0.0, 1.0); tl.add("dev 1", "F0", 1.0, 2.0)
        >>> tl.makespan, tl.idle_fraction()
        (2.0, 0.5)
    """

    def __init__(self, spans=()):
        self.spans: list[tuple[str, str, float, float]] = [tuple(s) for s in spans]
        self._pending: list = []
        self._base: dict = {}
        self.cpu_seconds = self.cpu_wall_seconds = 0.0  # thread CPU time and wall time of CPU spans

    def add(self, lane: str, label: str, start: float, end: float) -> None:
        """Record that ``lane`` was busy with ``label`` from ``start`` to ``end`` (seconds)."""
        self.spans.append((str(lane), str(label), float(start), float(end)))

    @contextmanager
    def span(self, lane: str, label: str, device=None):
        """Time the body as one busy span of ``lane``; on a CUDA ``device``, with CUDA events."""
        device = torch.device(device) if device is not None else None
        if device is None or device.type != "cuda":
            start, cpu = time.perf_counter(), time.thread_time()
            yield
            end = time.perf_counter()
            self.cpu_seconds += time.thread_time() - cpu
            self.cpu_wall_seconds += end - start
            self.add(lane, label, start, end)
            return
        if device not in self._base:  # one host/GPU clock pairing per device
            torch.cuda.synchronize(device)
            base = torch.cuda.Event(enable_timing=True)
            base.record(torch.cuda.current_stream(device))
            torch.cuda.synchronize(device)
            self._base[device] = (base, time.perf_counter())
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(torch.cuda.current_stream(device))
        yield
        end.record(torch.cuda.current_stream(device))
        self._pending.append((lane, label, device, start, end))

    @property
    def cpu_share(self) -> float | None:
        """CPU time this thread got during its CPU spans / their wall time (None: no CPU span).

        Near 1 when the spans ran undisturbed (with one intra-op thread); well
        below when other processes shared the cores, which stretches the spans.
        """
        return self.cpu_seconds / self.cpu_wall_seconds if self.cpu_wall_seconds else None

    def resolve(self) -> "Timeline":
        """Turn pending CUDA spans into seconds (waits for those GPUs)."""
        for lane, label, device, start, end in self._pending:
            end.synchronize()
            base, host = self._base[device]
            self.add(lane, label, host + base.elapsed_time(start) / 1e3, host + base.elapsed_time(end) / 1e3)
        self._pending.clear()
        return self

    @property
    def lanes(self) -> list[str]:
        """Lane names in order of first appearance."""
        self.resolve()
        return list(dict.fromkeys(lane for lane, *_ in self.spans))

    @property
    def makespan(self) -> float:
        """Seconds from the first span's start to the last span's end."""
        self.resolve()
        if not self.spans:
            return 0.0
        return max(s[3] for s in self.spans) - min(s[2] for s in self.spans)

    def busy(self, lane: str) -> float:
        """Seconds ``lane`` was busy."""
        self.resolve()
        return sum(end - start for name, _, start, end in self.spans if name == lane)

    def idle_fraction(self) -> float:
        """The measured bubble: 1 - busy time of all lanes / (lanes x makespan)."""
        span = self.makespan
        lanes = self.lanes
        return 0.0 if span == 0 else 1.0 - sum(map(self.busy, lanes)) / (len(lanes) * span)

    def shifted(self) -> "Timeline":
        """A copy whose first span starts at 0."""
        self.resolve()
        t0 = min((s[2] for s in self.spans), default=0.0)
        return Timeline((lane, label, a - t0, b - t0) for lane, label, a, b in self.spans)

    def plot(self, ax=None, title: str = "", unit: float = 1e3):
        """Draw the lanes as bars: forward spans (labels F...) blue, backward (B...) orange, idle blank."""
        import matplotlib.pyplot as plt

        ax = ax or plt.gca()
        tl, lanes = self.shifted(), self.lanes
        for row, lane in enumerate(lanes):
            for name, label, a, b in tl.spans:
                if name == lane:
                    color = "tab:blue" if label.startswith("F") else "tab:orange"
                    ax.broken_barh([(a * unit, (b - a) * unit)], (row - 0.4, 0.8), color=color, edgecolor="white")
        ax.set_yticks(range(len(lanes)), lanes)
        if not ax.yaxis_inverted():  # axes that share y would flip back and forth
            ax.invert_yaxis()
        ax.set_xlabel("time (ms)" if unit == 1e3 else "time")
        ax.set_title(title or f"idle {self.idle_fraction():.0%}", fontsize=9)
        return ax

"""Busy/idle timelines of devices or ranks: when each one worked, and the idle fraction.

One :class:`Timeline` serves lesson 03 (``nn.DataParallel`` step by step: one
lane per device, spans recorded from one thread per device, and spans of every
lane at once, ``lane=None``, for the backward that runs through all replicas)
and lesson 06 (pipeline stages on devices or ranks, and their idle fraction).

Spans on the CPU are timed with ``time.perf_counter``, one clock for every
process of a machine, so spans recorded in different ranks line up; spans on a
CUDA device are timed with CUDA events, so recording never makes the host wait
for the GPU.

:func:`fit_gpipe` reads a measured GPipe step as a few numbers (stage times, a
transfer time and an overhead); :func:`mgpu_lab.pipelining.schedule.gpipe_schedule`, which
lesson 06's notebook does not import (its learners model the bubble themselves),
replays the schedule from them.

Example:
    >>> tl = Timeline()
    >>> with tl.span("cpu", "F0"):
    ...     pass
    >>> tl.lanes
    ['cpu']
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

__all__ = ["Timeline", "GPipeFit", "fit_gpipe"]


class Timeline:
    """Busy spans of several lanes (devices or ranks); idle is everything else.

    A span is ``(lane, label, start, end)``, in seconds; a span whose lane is
    ``None`` is a span of every lane (work that runs on all of them at once).
    Spans may be recorded from several threads.

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
        >>> tl.add(None, "B0", 2.0, 3.0)   # both lanes busy
        >>> tl.busy("dev 0"), tl.totals()
        (2.0, {'F0': 2.0, 'B0': 2.0})
    """

    #: Colours of lesson 03's DataParallel phases; other labels: F... blue, B... orange.
    PHASES = {"scatter": "tab:orange", "replicate": "tab:red", "scatter+replicate": "tab:red", "forward": "tab:blue",
              "gather": "tab:purple", "loss+backward": "tab:green", "optimizer": "tab:gray"}

    def __init__(self, spans=()):
        self.spans: list[tuple[str | None, str, float, float]] = []
        self._declared: list[str] = []
        self._pending: list = []
        self._base: dict = {}
        self._lock = threading.Lock()
        self.cpu_seconds = self.cpu_wall_seconds = 0.0  # thread CPU time and wall time of CPU spans
        for span in spans:
            self.add(*span)

    def add(self, lane: str | None, label: str, start: float, end: float) -> None:
        """Record that ``lane`` (``None``: every lane) was busy with ``label`` from ``start`` to ``end`` (s)."""
        with self._lock:
            self.spans.append((None if lane is None else str(lane), str(label), float(start), float(end)))

    def add_lane(self, lane: str) -> None:
        """Declare a lane before any span of it, so that lanes are listed in this order."""
        if lane not in self._declared:
            self._declared.append(str(lane))

    def reset(self) -> None:
        """Forget every span (declared lanes stay): e.g. after a warm-up step."""
        self.resolve()
        with self._lock:
            self.spans.clear()
            self.cpu_seconds = self.cpu_wall_seconds = 0.0

    @contextmanager
    def span(self, lane: str | None, label: str, device=None):
        """Time the body as one busy span of ``lane``; on a CUDA ``device``, with CUDA events."""
        device = torch.device(device) if device is not None else None
        if device is None or device.type != "cuda":
            start, cpu = time.perf_counter(), time.thread_time()
            yield
            end = time.perf_counter()
            with self._lock:
                self.cpu_seconds += time.thread_time() - cpu
                self.cpu_wall_seconds += end - start
            self.add(lane, label, start, end)
            return
        start = self.stamp(device)
        yield
        self.add_stamped(lane, label, start, self.stamp(device), device)

    def stamp(self, device=None):
        """Now, on ``device``'s clock: a recorded CUDA event on a CUDA device, else ``time.perf_counter()``.

        For spans whose start and end are seen in different places (hooks of forward and
        backward): pass two stamps to :meth:`add_stamped`.
        """
        device = torch.device(device) if device is not None else None
        if device is None or device.type != "cuda":
            return time.perf_counter()
        if device not in self._base:  # one host/GPU clock pairing per device
            torch.cuda.synchronize(device)
            base = torch.cuda.Event(enable_timing=True)
            base.record(torch.cuda.current_stream(device))
            torch.cuda.synchronize(device)
            self._base[device] = (base, time.perf_counter())
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(device))
        return event

    def add_stamped(self, lane: str | None, label: str, start, end, device=None) -> None:
        """Record a span between two :meth:`stamp` s of ``device``."""
        if isinstance(start, float):
            self.add(lane, label, start, end)
            return
        with self._lock:
            self._pending.append((lane, label, torch.device(device), start, end))

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
        """Lane names: the declared ones (:meth:`add_lane`), then the others in order of first appearance."""
        self.resolve()
        return list(dict.fromkeys([*self._declared, *(lane for lane, *_ in self.spans if lane is not None)]))

    @property
    def makespan(self) -> float:
        """Seconds from the first span's start to the last span's end."""
        self.resolve()
        if not self.spans:
            return 0.0
        return max(s[3] for s in self.spans) - min(s[2] for s in self.spans)

    def busy(self, lane: str) -> float:
        """Seconds ``lane`` was busy (its spans and the spans of every lane)."""
        self.resolve()
        return sum(end - start for name, _, start, end in self.spans if name in (lane, None))

    def totals(self) -> dict[str, float]:
        """Seconds per label, summed over lanes (a span of every lane counts once per lane)."""
        self.resolve()
        out: dict[str, float] = {}
        lanes = max(len(self.lanes), 1)
        for lane, label, start, end in self.spans:
            out[label] = out.get(label, 0.0) + (end - start) * (lanes if lane is None else 1)
        return out

    def idle_fraction(self) -> float:
        """The measured bubble: 1 - busy time of all lanes / (lanes x makespan)."""
        span = self.makespan
        lanes = self.lanes
        return 0.0 if span == 0 else 1.0 - sum(map(self.busy, lanes)) / (len(lanes) * span)

    def shifted(self) -> "Timeline":
        """A copy whose first span starts at 0 (declared lanes kept)."""
        self.resolve()
        t0 = min((s[2] for s in self.spans), default=0.0)
        out = Timeline((lane, label, a - t0, b - t0) for lane, label, a, b in self.spans)
        out._declared = list(self._declared)
        return out

    def _colour(self, label: str) -> str:
        if label in self.PHASES:
            return self.PHASES[label]
        if label == "wait":  # lesson 12: a rank waiting for a message
            return "0.85"
        colours = {"F": "tab:blue", "B": "tab:orange", "I": "tab:orange", "W": "tab:green"}
        return colours.get(label[:1], "tab:olive")

    def plot(self, ax=None, title: str = "", unit: float = 1e3, annotate: bool = False):
        """Draw the lanes as bars, idle blank: lesson 03's phases in their colours (with a legend),
        forward spans (labels F...) blue, backward (B...) and input-gradient (I...) orange, weight-gradient
        (W...) green, ``wait`` light grey; a span of every lane in every row.

        With ``annotate``, pipeline actions (``F3/s1``: kind, micro-batch, stage) carry their micro-batch's
        number, the actions of a lane's later stages (virtual stages) are drawn lighter, and a legend beside
        the lanes names the kinds drawn.
        """
        import matplotlib.pyplot as plt

        tl, lanes = self.shifted(), self.lanes
        if ax is None:
            _, ax = plt.subplots(figsize=(9, 0.6 + 0.55 * max(len(lanes), 1)))
        first_stage = {lane: min(st) for lane, st in self._stages(tl.spans).items()} if annotate else {}
        for row, lane in enumerate(lanes):
            for name, label, a, b in tl.spans:
                if name in (lane, None):
                    kind, mb, stage = self._action(label)
                    later = annotate and kind and stage != first_stage.get(name, stage)
                    ax.broken_barh([(a * unit, max(b - a, 1e-9) * unit)], (row - 0.4, 0.8), color=self._colour(label),
                                   edgecolor="white", linewidth=0.4, alpha=0.5 if later else 1.0)
                    if annotate and kind:
                        ax.text((a + b) / 2 * unit, row, str(mb), ha="center", va="center", fontsize=6)
        ax.set_yticks(range(len(lanes)), lanes)
        if not ax.yaxis_inverted():  # axes that share y would flip back and forth
            ax.invert_yaxis()
        ax.set_xlabel("time (ms)" if unit == 1e3 else "time")
        self._legend(ax, tl.spans, len(lanes), annotate)
        ax.set_title(title or f"idle {self.idle_fraction():.0%}", fontsize=9)
        return ax

    #: Names of the pipeline action kinds in a legend.
    KINDS = {"F": "forward", "B": "backward", "I": "input gradient", "W": "weight gradient", "wait": "wait for a message"}

    @staticmethod
    def _action(label: str) -> tuple:
        """``"F3/s1"`` -> ``("F", 3, 1)``; ``(None, None, None)`` for any other label."""
        head, _, stage = label.partition("/s")
        if head[:1] in "FBIW" and head[1:].isdigit() and stage.isdigit():
            return head[0], int(head[1:]), int(stage)
        return None, None, None

    def _stages(self, spans) -> dict:
        """Per lane, the stages of the pipeline actions it runs."""
        out: dict = {}
        for lane, label, _, _ in spans:
            stage = self._action(label)[2]
            if stage is not None:
                out.setdefault(lane, set()).add(stage)
        return out

    def _legend(self, ax, spans, n_lanes: int, annotate: bool) -> None:
        from matplotlib.patches import Patch

        handles = [Patch(color=self.PHASES[p], label=p) for p in self.PHASES if any(s[1] == p for s in spans)]
        if annotate:
            kinds = {"wait" if label == "wait" else self._action(label)[0] for _, label, _, _ in spans}
            handles += [Patch(color=self._colour(k), label=words) for k, words in self.KINDS.items() if k in kinds]
            if any(len(stages) > 1 for stages in self._stages(spans).values()):
                handles.append(Patch(color="tab:blue", alpha=0.5, label="lighter: the rank's later stage"))
            handles.append(Patch(color="white", label="numbers: micro-batch"))
            ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
        elif handles:
            ax.legend(handles=handles, ncol=len(handles), loc="upper center", fontsize=8,
                      bbox_to_anchor=(0.5, -0.35 if n_lanes < 3 else -0.2))


# -- GPipe's schedule, and a model of it fitted to a measurement ------------------------
@dataclass(frozen=True)
class GPipeFit:
    """A GPipe step described by a few numbers, measured from a timeline (see :func:`fit_gpipe`).

    Attributes:
        forward, backward: mean seconds of one micro-batch's forward and backward, per stage.
        transfer: mean seconds from the end of a span to the start of the span that waited for its result.
        overhead: mean seconds between two spans of one stage that waited for no message.
        n_micro: micro-batches per step.
        lanes: the stages' lane names.
    """

    forward: tuple
    backward: tuple
    transfer: float
    overhead: float
    n_micro: int
    lanes: tuple


def fit_gpipe(timeline: Timeline, rounds: int = 5) -> GPipeFit:
    """Fit :class:`GPipeFit` to a measured GPipe step (lanes in stage order, spans ``F{i}``/``B{i}``).

    The stage times are the means of the measured spans, so the model's busy
    time is the measured one. The gap before each span is either the wait for a
    message (when the sender's span plus ``transfer`` ends after this stage's
    previous span plus ``overhead``) or the stage's own host work; ``transfer``
    and ``overhead`` are the means of their gaps, found by re-sorting the gaps
    with the estimates of the previous round (the first round compares the span ends).

    Raises:
        ValueError: spans that are not GPipe's ``F{i}``/``B{i}`` on every stage.

    Example:
        >>> from mgpu_lab.pipelining.gpipe import gpipe_schedule
        >>> fit = fit_gpipe(gpipe_schedule([1.0, 2.0], [2.0, 3.0], 4, transfer=0.5, overhead=0.1))
        >>> fit.forward, round(fit.transfer, 6), round(fit.overhead, 6)
        ((1.0, 2.0), 0.5, 0.1)
    """
    lanes = timeline.lanes
    spans = {}
    for lane, label, start, end in timeline.spans:
        if label[:1] not in ("F", "B") or not label[1:].isdigit():
            raise ValueError(f"span {label!r} of {lane!r} is not GPipe's F<i> or B<i>")
        spans[lanes.index(lane), label[0], int(label[1:])] = (start, end)
    m = 1 + max(i for _, _, i in spans)
    if len(spans) != 2 * len(lanes) * m:
        raise ValueError(f"{len(spans)} spans for {len(lanes)} stages: expected F0..F{m - 1} and B0..B{m - 1} "
                         f"on every stage")
    mean = [tuple(sum(spans[s, ph, i][1] - spans[s, ph, i][0] for i in range(m)) / m for s in range(len(lanes)))
            for ph in ("F", "B")]
    gaps = []  # (start, end of this stage's previous span or None, end of the sender's span or None)
    for (s, ph, i), (start, _) in spans.items():
        prev = spans.get((s, ph, i - 1)) or (spans[s, "F", m - 1] if ph == "B" and i == 0 else None)
        sender = spans.get((s - 1 if ph == "F" else s + 1, ph, i))
        if prev or sender:
            gaps.append((start, prev and prev[1], sender and sender[1]))
    transfer = overhead = 0.0
    for _ in range(rounds):
        waits = [start - sent for start, own, sent in gaps
                 if sent is not None and (own is None or sent + transfer > own + overhead)]
        works = [start - own for start, own, sent in gaps
                 if own is not None and not (sent is not None and sent + transfer > own + overhead)]
        transfer, overhead = _mean(waits), _mean(works)
    return GPipeFit(mean[0], mean[1], transfer, overhead, m, tuple(lanes))


def _mean(values) -> float:
    return sum(values) / len(values) if values else 0.0

"""Live per-rank progress bars: ``for batch in progress(loader, desc="epoch 1"): ...``.

Inside a rank started by :func:`mgpu_lab.launch`, :func:`progress` sends its
count to the launcher, which shows one bar per rank: ipywidgets in JupyterLab,
a plain text line in a terminal. Anywhere else (torchrun, a plain script) it is
a tqdm bar on the main process and silent on the others.

Example:
    >>> from mgpu_lab import progress
    >>> total = sum(1 for _ in progress(range(3), desc="demo"))
"""
from __future__ import annotations

import sys
import time

MIN_INTERVAL = 0.1  # seconds between two updates a rank sends


def progress(iterable, total: int | None = None, desc: str = ""):
    """Yield from ``iterable`` while reporting how far this rank has got.

    Args:
        iterable: what to iterate (a DataLoader, a range, ...).
        total: number of items (default: ``len(iterable)`` when it has one).
        desc: a short label, e.g. ``"epoch 2"``.

    Yields:
        The items of ``iterable``.
    """
    from . import rank as _rank

    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)
    send = _rank.report
    if send is None:  # not in a launched rank
        from tqdm.auto import tqdm

        from mgpu_lab.dist import is_main_process

        yield from tqdm(iterable, total=total, desc=desc, disable=not is_main_process())
        return
    n, last = 0, 0.0
    send("progress", {"n": 0, "total": total, "desc": desc})
    for item in iterable:
        yield item
        n += 1
        now = time.monotonic()
        if now - last >= MIN_INTERVAL:
            send("progress", {"n": n, "total": total, "desc": desc})
            last = now
    send("progress", {"n": n, "total": total, "desc": desc})


def _in_notebook() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


class ProgressBoard:
    """The launcher's side: one bar per rank, created when its first update arrives."""

    def __init__(self, world_size: int, widgets: bool | None = None):
        self.world_size = world_size
        self.widgets = _in_notebook() if widgets is None else widgets
        self.state: dict[int, dict] = {}
        self._bars: dict[int, tuple] = {}
        self._box = None
        self._printed: dict[int, int] = {}

    def update(self, rank: int, info: dict) -> None:
        self.state[rank] = info
        if self.widgets:
            try:
                self._widget_update(rank, info)
                return
            except ImportError:
                self.widgets = False
        self._text_update(rank, info)

    def _widget_update(self, rank: int, info: dict) -> None:
        import ipywidgets as w
        from IPython.display import display

        if self._box is None:
            self._box = w.VBox([], layout=w.Layout(width="100%"))
            self._box.add_class("mgpu-progress")
            display(self._box)
        if rank not in self._bars:
            label = w.Label(f"[rank {rank}/{self.world_size}] {info['desc']}")
            bar = w.IntProgress(min=0, max=max(info["total"] or 1, 1), value=0)
            bar.add_class(f"mgpu-progress-rank{rank}")
            count = w.Label("")
            self._bars[rank] = (label, bar, count)
            self._box.children = tuple(w.HBox(self._bars[r]) for r in sorted(self._bars))
        label, bar, count = self._bars[rank]
        label.value = f"[rank {rank}/{self.world_size}] {info['desc']}"
        if info["total"]:
            bar.max = max(info["total"], 1)
        bar.value = min(info["n"], bar.max)
        count.value = f"{info['n']}/{info['total'] or '?'}"

    def _text_update(self, rank: int, info: dict) -> None:
        total, n = info["total"], info["n"]
        step = max(1, (total or 10) // 10)  # about ten lines per bar
        last = self._printed.get(rank)
        if last is not None and (n == last or (n - last < step and n != total)):
            return
        self._printed[rank] = n
        pct = f" {100 * n // total:3d}%" if total else ""
        sys.stdout.write(f"[rank {rank}/{self.world_size}] {info['desc']}{pct} {n}/{total or '?'}\n")
        sys.stdout.flush()

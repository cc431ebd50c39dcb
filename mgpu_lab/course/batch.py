"""Grading many submissions: N at a time, a progress line, and results kept so that a re-run resumes.

:func:`run_batch` grades every path with a function it is given (in practice
:func:`mgpu_lab.course.grade.grade_notebook`):

- ``jobs`` submissions at once, each in worker processes of their own (started
  with ``spawn``; a worker grades one submission after the other, in its own
  sandbox slot, so that no two sandboxes share a user and its process limit);
  :func:`default_jobs` fits the machine's cores and memory;
- a :class:`Progress` line on stderr: submissions done, how many did not
  complete, how many run, the time left, and which run long (a submission
  still running after :attr:`Progress.LONG` seconds, or twice the mean, is
  named, with how long it has run, and again each minute);
- a :class:`Store` of results, one JSON file per submission under a key made of
  its content, its lesson and what grades it (the grader's code, reference
  notebooks, timeout and limits): a re-run grades only what is new or changed,
  and an interrupted batch resumes where it stopped. ``force`` re-grades all.

A worker that dies (killed, out of memory) breaks its pool: the submissions
that were not done are graded again one at a time, and only one whose worker
dies again gets 0 points, with the reason.
"""
from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import multiprocessing
import os
import sys
import threading
import time
from pathlib import Path

__all__ = ["default_jobs", "fingerprint", "Store", "Progress", "run_batch"]

GiB = 1 << 30
MEMORY_PER_JOB = 3 * GiB  # a kernel, a runner and four ranks with torch imported, and their tensors


def default_jobs() -> int:
    """Submissions graded at once by default: one per usable core, as memory allows (3 GiB each)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        import psutil

        memory = psutil.virtual_memory().available
    except Exception:  # noqa: BLE001 - no psutil reading: the cores decide
        memory = cores * MEMORY_PER_JOB
    return max(1, min(cores, memory // MEMORY_PER_JOB))


def check_jobs(jobs) -> int:
    """``jobs`` as a positive int; ValueError naming the value and the fix otherwise."""
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs={jobs!r}: give how many submissions to grade at once, a whole number >= 1 "
                         f"(this machine's default is {default_jobs()})")
    return jobs


def fingerprint(*parts) -> str:
    """A digest of what grades: the ``mgpu_lab`` sources, the reference notebooks, Python's, torch's and
    Jupyter's versions, and ``parts`` (e.g. the timeout and limits)."""
    import mgpu_lab

    root = Path(mgpu_lab.__file__).resolve().parent
    h = hashlib.sha256()
    files = sorted(root.rglob("*.py"))
    for folder in ("solutions", "notebooks"):
        files += sorted((root.parent / folder).glob("*.ipynb"))
    for path in files:
        h.update(str(path.relative_to(root.parent)).encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    h.update(json.dumps([str(p) for p in parts] + [sys.version, *_versions()]).encode())
    return h.hexdigest()


def _versions() -> list[str]:
    from importlib import metadata

    out = []
    for name in ("torch", "nbclient", "ipykernel"):
        try:
            out.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            out.append(f"{name} missing")
    return out


class Store:
    """Results kept per submission: ``FOLDER/<key>.json``, written when a submission is done."""

    def __init__(self, folder: Path | str, salt: str):
        self.folder, self.salt = Path(folder), salt
        self.folder.mkdir(parents=True, exist_ok=True)

    def key(self, path: Path) -> str:
        h = hashlib.sha256(self.salt.encode())
        h.update(b"\0" + path.name[:3].encode() + b"\0")  # the lesson comes from the name's NN_ prefix
        h.update(path.read_bytes())
        return h.hexdigest()

    def get(self, key: str) -> dict | None:
        try:
            return json.loads((self.folder / f"{key}.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None

    def put(self, key: str, data: dict) -> None:
        tmp = self.folder / f".{key}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(data) + "\n", encoding="utf-8")
        os.replace(tmp, self.folder / f"{key}.json")


class Progress:
    """``grading: 3/10 done (1 incomplete), 2 running, 12 s each, about 1 min left`` on stderr.

    On a terminal the line is rewritten in place; elsewhere (CI logs, a pipe) a
    line is printed per submission done.
    """

    LONG = 120.0  # seconds after which a running submission is named (or twice the mean, if longer)
    TICK = 5.0  # seconds between two looks at what runs long

    def __init__(self, total: int, jobs: int, stream=None):
        self.total, self.jobs, self.stream = total, jobs, stream or sys.stderr
        self.done = self.incomplete = self.cached = self.running = 0
        self.seconds: list[float] = []
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.since: dict = {}  # key -> (name, when it started), of what runs now
        self._lock, self._long = threading.Lock(), ""

    def start(self, key, name: str) -> None:
        """``name`` (key ``key``) started now."""
        self.since[key] = (name, time.monotonic())

    def stop(self, key) -> None:
        self.since.pop(key, None)

    def long(self) -> str:
        """``running long: 03_x.ipynb (4 min)``: what has run longer than :attr:`LONG` s or twice the mean."""
        limit = max(self.LONG, 2 * sum(self.seconds) / len(self.seconds) if self.seconds else 0.0)
        now = time.monotonic()
        slow = sorted(((now - t, name) for name, t in list(self.since.values()) if now - t > limit), reverse=True)
        return ("running long: " + ", ".join(f"{name} ({_duration(s)})" for s, name in slow)) if slow else ""

    def tick(self) -> None:
        """Show the line again when what runs long has changed (names, or minutes)."""
        long = self.long()
        if long != self._long:
            self._long = long
            if long:
                self.show()

    def line(self) -> str:
        text = f"grading: {self.done}/{self.total} done"
        if self.cached:
            text += f" ({self.cached} kept from an earlier run)"
        if self.incomplete:
            text += f", {self.incomplete} incomplete"
        if self.running:
            text += f", {self.running} running"
        left = self.total - self.done
        if self.seconds and left:
            each = sum(self.seconds) / len(self.seconds)
            eta = each * left / max(1, min(self.jobs, left))
            text += f", {each:.0f} s each, about {_duration(eta)} left"
        long = self.long()
        return text + (f"; {long}" if long else "")

    def show(self, final: bool = False) -> None:
        with self._lock:
            if self.tty:
                self.stream.write("\r\x1b[2K" + self.line() + ("\n" if final else ""))
            else:
                self.stream.write(self.line() + "\n")
            self.stream.flush()

    def finished(self, seconds: float | None, complete: bool) -> None:
        self.done += 1
        self.incomplete += not complete
        if seconds is None:
            self.cached += 1
        else:
            self.seconds.append(seconds)
        self.show(final=self.done == self.total)


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


_SLOT = {"value": 0, "started": None}


def _init_worker(slots, started=None) -> None:
    _SLOT["value"], _SLOT["started"] = slots.get(), started


def _work(fn, path, key=None):
    if _SLOT["started"] is not None:
        _SLOT["started"].put(key)  # for the progress line: which submissions run, since when
    start = time.monotonic()
    return fn(path, slot=_SLOT["value"]), time.monotonic() - start


def _ticking(bar, stop: threading.Event) -> None:
    while not stop.wait(bar.TICK):
        bar.tick()


def run_batch(paths, fn, *, jobs: int = 1, store: Store | None = None, force: bool = False,
              to_dict=None, from_dict=None, failed=None, complete=None, progress: bool = True) -> list:
    """Grade every path with ``fn(path, slot=k)``; the results in the order of ``paths``.

    Args:
        paths: the submissions.
        fn: grades one; picklable (it runs in a worker process when ``jobs`` > 1).
        jobs: submissions at once.
        store: where results are kept between runs (None: nowhere).
        force: grade again what ``store`` holds.
        to_dict, from_dict: a result as JSON data and back (for ``store``).
        failed: ``failed(path, reason)`` the result of a submission whose worker died.
        complete: ``complete(result)``: whether it ran to the end (for the progress line).
        progress: show the progress line on stderr.
    """
    batch = _Batch([Path(p) for p in paths], fn, check_jobs(jobs), store, to_dict, failed, complete, progress)
    todo = batch.take_kept(force, from_dict)
    if batch.jobs == 1 or len(todo) <= 1:
        batch.one_by_one(todo)
        return batch.results
    # A pool breaks as a whole when one worker dies: the submissions it held are
    # graded again one by one, so that only the one that kills its worker loses.
    for i in batch.pool_round(todo, min(batch.jobs, len(todo))):
        if batch.pool_round([i], 1):
            batch.done(i, failed(batch.paths[i], "its grading worker died (killed, or out of memory), twice; "
                                                 "0 points for what could not be judged"), 0.0)
    return batch.results


class _Batch:
    """One :func:`run_batch`: its results, kept grades and progress line."""

    def __init__(self, paths, fn, jobs, store, to_dict, failed, complete, progress):
        self.paths, self.fn, self.jobs, self.store = paths, fn, jobs, store
        self.to_dict, self.failed, self.complete = to_dict, failed, complete
        self.results: list = [None] * len(paths)
        self.keys: list = [None] * len(paths)
        self.bar = Progress(len(paths), jobs) if progress else None

    def take_kept(self, force: bool, from_dict) -> list[int]:
        """Fill in the grades ``store`` holds; the indices left to grade."""
        todo = []
        for i, p in enumerate(self.paths):
            if self.store is not None and p.is_file():
                self.keys[i] = self.store.key(p)
                kept = None if force else self.store.get(self.keys[i])
                if kept is not None:
                    self.results[i] = from_dict(kept, p)
                    if self.bar:
                        self.bar.finished(None, self.complete(self.results[i]))
                    continue
            todo.append(i)
        return todo

    def done(self, i: int, result, seconds: float, running: int = 0) -> None:
        """Keep submission ``i``'s result; ``running``: how many still run now."""
        self.results[i] = result
        if self.store is not None and self.keys[i] is not None:
            self.store.put(self.keys[i], self.to_dict(result))
        if self.bar:
            self.bar.stop(i)
            self.bar.running = running
            self.bar.finished(seconds, self.complete(result))

    def one_by_one(self, indices: list[int]) -> None:
        stop = threading.Event()
        if self.bar:
            threading.Thread(target=_ticking, args=(self.bar, stop), daemon=True).start()
        try:
            for i in indices:
                if self.bar:
                    self.bar.running = 1
                    self.bar.start(i, self.paths[i].name)
                start = time.monotonic()
                self.done(i, self.fn(self.paths[i], slot=0), time.monotonic() - start)
        finally:
            stop.set()

    def pool_round(self, indices: list[int], workers: int) -> list[int]:
        """Grade ``indices`` in a pool of ``workers``; those whose worker pool broke."""
        context = multiprocessing.get_context("spawn")  # the grader's own start method is left as it is
        slots, started = context.Queue(), context.Queue()
        for k in range(workers):
            slots.put(k)
        broken, ended = [], set()
        with cf.ProcessPoolExecutor(workers, mp_context=context, initializer=_init_worker,
                                    initargs=(slots, started)) as pool:
            futures = {pool.submit(_work, self.fn, self.paths[i], i): i for i in indices}
            pending = set(futures)
            if self.bar:
                self.bar.running = min(workers, len(indices))
                self.bar.show()
            while pending:
                finished, pending = cf.wait(pending, timeout=self.bar.TICK if self.bar else None,
                                            return_when=cf.FIRST_COMPLETED)
                self._started(started, ended)
                for future in finished:
                    i = futures[future]
                    ended.add(i)
                    try:
                        result, seconds = future.result()
                    except cf.process.BrokenProcessPool:
                        broken.append(i)
                        continue
                    except Exception as exc:  # noqa: BLE001 - one submission must never stop the batch
                        result = self.failed(self.paths[i], f"the grader failed ({type(exc).__name__}: {exc})")
                        seconds = 0.0
                    self.done(i, result, seconds, running=min(workers, len(pending)))
                if self.bar:
                    self.bar.tick()
        return sorted(broken)

    def _started(self, started, ended: set) -> None:
        """Tell the progress line which submissions the workers have started (those not ended already)."""
        while True:
            try:
                i = started.get_nowait()
            except Exception:  # noqa: BLE001 - queue.Empty: nothing more for now
                return
            if self.bar and i not in ended:
                self.bar.start(i, self.paths[i].name)

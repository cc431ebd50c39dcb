"""One launch in flight: its rank processes, their pipes, and the wait loop.

The loop runs in the caller's main thread (so Ctrl-C / a kernel interrupt
reaches it), relays output as it arrives, and decides when the job is done,
has failed, or hangs. Whatever happens, :meth:`Job.__exit__` kills what is
still running and closes every pipe.
"""
from __future__ import annotations

import io
import os
import selectors
import signal
import time
from multiprocessing import Pipe
from multiprocessing.connection import Connection

import cloudpickle

from . import procs
from .errors import LaunchError, LaunchTimeout, exit_text, is_consequence, load_exception
from .progressbars import ProgressBoard
from .relay import LineRelay, format_stack_dump, format_traceback, prefix, stderr, stdout

GRACE_AFTER_FAILURE = 1.0  # seconds to collect the other ranks' own errors
STACK_WAIT = 1.5  # seconds to wait for stack dumps of hung ranks
DRAIN_WAIT = 2.0  # seconds to wait for output still in the pipes after the ranks exit


class _Rank:
    def __init__(self, rank, world_size, capture=None):
        self.rank, self.world_size = rank, world_size
        self.proc = None
        self.fds = {}  # stream name -> read fd
        self.chan = None
        out, err = (stdout, stderr) if capture is None else (lambda: capture, lambda: capture)
        self.relays = {"out": LineRelay(rank, world_size, out), "err": LineRelay(rank, world_size, err)}
        self.message = None  # ("ok", blob) or ("error", info)
        self.chan_open = True
        self.exitcode = None
        self.stack = b""
        self.killed = False  # stopped by the launcher, not a failure of its own
        self.died_at = None

    @property
    def done(self) -> bool:
        return self.exitcode is not None and not self.chan_open


class Job:
    """Starts the ranks of one launch and waits for them; a context manager."""

    def __init__(self, world_size: int, timeout: float, echo: bool = True):
        self.world_size, self.timeout = world_size, timeout
        # echo=False keeps the ranks' output out of the caller's streams (checks):
        # it is kept here and attached to a LaunchError as `output`.
        self.captured = None if echo else io.StringIO()
        self.ranks: list[_Rank] = []
        self.sel = selectors.DefaultSelector()
        self.board = None  # per-rank progress bars, made on the first update

    def start_rank(self, r: int, target, payload: bytes, spec: dict) -> None:
        info = _Rank(r, self.world_size, self.captured)
        self.ranks.append(info)
        ends = {}
        for name in ("out", "err", "stack"):
            read, write = os.pipe()
            os.set_blocking(read, False)
            info.fds[name] = read
            ends[name] = Connection(write, readable=False)
        info.chan, chan_w = Pipe(duplex=False)
        try:
            info.proc = procs.start(
                target, (payload, spec, ends["out"], ends["err"], ends["stack"], chan_w),
                name=f"mgpu-lab rank {r}/{self.world_size}",
            )
        finally:
            for end in (*ends.values(), chan_w):
                end.close()  # the rank holds its own copies now
        for name in ("out", "err"):
            self.sel.register(info.fds[name], selectors.EVENT_READ, (info, name))
        self.sel.register(info.chan.fileno(), selectors.EVENT_READ, (info, "chan"))
        self.sel.register(info.proc.sentinel, selectors.EVENT_READ, (info, "exit"))

    # -- the loop ---------------------------------------------------------
    def _pump(self, wait: float) -> None:
        for key, _ in self.sel.select(timeout=max(wait, 0)):
            info, what = key.data
            if what in ("out", "err"):
                data = os.read(key.fd, 65536)
                if data:
                    info.relays[what].feed(data)
                else:
                    self.sel.unregister(key.fd)
                    info.relays[what].close()
            elif what == "chan":
                self._read_chan(info)
            elif what == "stack":
                data = os.read(key.fd, 65536)
                info.stack += data
                if not data:
                    self.sel.unregister(key.fd)
            else:
                self.sel.unregister(key.fd)
                info.exitcode = info.proc.exitcode
                if info.chan_open and not info.chan.poll(0):
                    self._close_chan(info)  # exited without a word: it died
                if info.message is None:
                    info.died_at = time.time()

    def _read_chan(self, info: _Rank) -> None:
        try:
            msg = info.chan.recv()
        except (EOFError, OSError):
            self._close_chan(info)
            return
        if msg[0] == "progress":
            if self.board is None:
                self.board = ProgressBoard(self.world_size)
            self.board.update(info.rank, msg[1])
        else:
            info.message = msg

    def _close_chan(self, info: _Rank) -> None:
        if info.chan_open:
            info.chan_open = False
            self.sel.unregister(info.chan.fileno())

    def _failures(self) -> list[_Rank]:
        bad = [i for i in self.ranks if (i.message and i.message[0] == "error")
               or (i.done and i.message is None and not i.killed)]

        def when(i):
            return i.message[1]["time"] if i.message else (i.died_at or float("inf"))

        # A rank whose peer died sees "connection closed by peer" in its collective;
        # report the rank that caused it first, even if its death was noticed later.
        return sorted(bad, key=lambda i: (is_consequence(i.message), when(i), i.rank))

    def wait(self) -> list:
        """Relay output until every rank is done; return results or raise."""
        deadline = time.monotonic() + self.timeout
        failed_at = None
        while not all(i.done for i in self.ranks):
            now = time.monotonic()
            if self._failures():
                failed_at = failed_at or now
                if now - failed_at > GRACE_AFTER_FAILURE:
                    break
            if now > deadline:
                self._raise_timeout()
            self._pump(min(0.1, deadline - now))
        if not all(i.done for i in self.ranks):
            self._kill_all()
        self._drain()
        failures = self._failures()
        if failures:
            self._raise_failure(failures)
        return [self._result(i) for i in self.ranks]

    def _result(self, info: _Rank):
        try:
            return cloudpickle.loads(info.message[1])
        except Exception as exc:  # noqa: BLE001
            raise LaunchError(
                f"the return value of rank {info.rank}/{self.world_size} could not be unpickled "
                f"here: {type(exc).__name__}: {exc}; return plain data (numbers, tensors, dicts)",
                rank=info.rank, world_size=self.world_size, exitcode=info.exitcode,
            ) from exc

    def _drain(self) -> None:
        end = time.monotonic() + DRAIN_WAIT
        while self.sel.get_map() and time.monotonic() < end:
            self._pump(0.05)
        for info in self.ranks:
            for relay in info.relays.values():
                relay.close()

    # -- failure paths ----------------------------------------------------
    def _summary(self, info: _Rank) -> str:
        if info.message:
            err = info.message[1]
            return f"raised {err['type']}: {err['message']}"
        return f"died without raising ({exit_text(info.exitcode)})"

    def _raise_failure(self, failures: list[_Rank]) -> None:
        first = failures[0]
        n = self.world_size
        lines = [f"rank {first.rank}/{n} {self._summary(first)}"]
        others = [f"rank {i.rank}/{n} {self._summary(i)}" for i in failures[1:]]
        if others:
            lines.append("after it: " + "; ".join(others))
        stopped = [i.rank for i in self.ranks if i.killed and i.message is None]
        if stopped:
            lines.append(f"stopped by the launcher: ranks {', '.join(map(str, stopped))}")
        tb, exc, exc_type, phase = "", None, None, None
        if first.message:
            err = first.message[1]
            phase = err.get("phase")
            tb, exc_type = format_traceback(err), err["type"]
            exc = load_exception(err)
            lines += ["", f"Traceback of rank {first.rank}/{n}:", tb.rstrip()]
        else:
            lines.append("(a segfault, os._exit, or a kill from outside, e.g. the out-of-memory killer, "
                         "ends a process without a Python exception; its stderr is above)")
        raise LaunchError("\n".join(lines), rank=first.rank, world_size=n, exitcode=first.exitcode,
                          output=self.captured.getvalue() if self.captured else "",
                          exc_type=exc_type, exception=exc, traceback=tb, phase=phase,
                          failures={i.rank: self._summary(i) for i in failures})

    def _raise_timeout(self) -> None:
        hung = [i for i in self.ranks if i.exitcode is None]
        for info in hung:
            self.sel.register(info.fds["stack"], selectors.EVENT_READ, (info, "stack"))
            try:
                os.kill(info.proc.pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        end = time.monotonic() + STACK_WAIT
        while time.monotonic() < end:
            for key, _ in self.sel.select(timeout=0.05):
                info, what = key.data
                if what == "stack":
                    info.stack += os.read(key.fd, 65536)
            if all(i.stack.endswith(b"\n") for i in hung):
                time.sleep(0.05)
                break
        self._kill_all()
        self._drain()
        n = self.world_size
        stacks = {i.rank: format_stack_dump(i.stack.decode(errors="replace")) for i in hung}
        finished = [str(i.rank) for i in self.ranks if i not in hung]
        lines = [
            f"launch timed out after {self.timeout:g} s: rank(s) {', '.join(str(i.rank) for i in hung)} "
            f"of {n} still running" + (f" (rank(s) {', '.join(finished)} had finished)" if finished else ""),
            "A hang usually means mismatched collectives: one rank waits in all_reduce/barrier/... "
            "that another rank never calls (e.g. different numbers of batches per rank, or a "
            "collective inside `if rank == 0`). Raise timeout= if the work is simply slow.",
            "Python stack of every rank still running (most recent call first):",
        ]
        for r, text in stacks.items():
            body = "\n".join(prefix(r, n) + line for line in (text or "(no stack received)").splitlines())
            lines.append(body)
        raise LaunchTimeout("\n".join(lines), rank=hung[0].rank if hung else None, world_size=n,
                            output=self.captured.getvalue() if self.captured else "",
                            stacks=stacks)

    def _kill_all(self) -> None:
        for info in self.ranks:
            if info.proc is not None and info.exitcode is None:
                info.killed = True
                procs.kill_tree(info.proc)
        for info in self.ranks:
            if info.proc is not None and info.exitcode is None:
                info.proc.join(5)
                info.exitcode = info.proc.exitcode

    # -- context manager: always clean up ----------------------------------
    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is KeyboardInterrupt:
            self._kill_all()
            self._drain()
            print(f"launch interrupted: stopped all {self.world_size} ranks", flush=True)
        self._kill_all()
        self.sel.close()
        for info in self.ranks:
            if info.proc is not None:
                info.proc.join(5)
                try:
                    info.proc.close()
                except ValueError:
                    pass
            for fd in info.fds.values():
                os.close(fd)
            info.chan.close()
        return False

"""One launch in flight: its rank processes, their pipes, and the wait loop.

The loop runs in the caller's main thread (so Ctrl-C / a kernel interrupt
reaches it), relays output as it arrives, and decides when the job is done,
has failed, or hangs. Whatever happens, :meth:`Job.__exit__` kills what is
still running and closes every pipe; the lifeline (see :mod:`.lifetime`) takes
the ranks down with the launching process if that dies first. The job's
resources are made only in :meth:`Job.start_rank`, which the launcher calls
with Ctrl-C held back, so that an interrupt never finds half a rank.
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
from .errors import LaunchError, failure_error, is_consequence, timeout_error
from .lifetime import Lifeline, interrupts_deferred
from .progressbars import ProgressBoard
from .relay import LineRelay, format_stack_dump, stderr, stdout

GRACE_AFTER_FAILURE = 1.0  # seconds to collect the other ranks' own errors
STACK_WAIT = 1.5  # seconds to wait for stack dumps of hung ranks
DRAIN_WAIT = 2.0  # seconds to wait for output still in the pipes after the ranks exit


class _Rank:
    def __init__(self, rank, world_size, capture=None):
        self.rank, self.world_size = rank, world_size
        self.proc = None
        self.fds = {}  # stream name -> read fd
        self.chan = None
        self.killed = False  # stopped by the launcher, not a failure of its own
        out, err = (stdout, stderr) if capture is None else (lambda: capture, lambda: capture)
        self.relays = {"out": LineRelay(rank, world_size, out), "err": LineRelay(rank, world_size, err)}
        self.message = None  # ("ok", blob) or ("error", info)
        self.chan_open = True
        self.exitcode = None
        self.stack = b""
        self.died_at = None

    @property
    def done(self) -> bool:
        return self.exitcode is not None and not self.chan_open


class Job:
    """Starts the ranks of one launch and waits for them; a context manager."""

    def __init__(self, world_size: int, timeout: float, echo: bool = True, init: bool = True):
        self.world_size, self.timeout, self.init = world_size, timeout, init
        # echo=False keeps the ranks' output out of the caller's streams (checks):
        # it is kept here and attached to a LaunchError as `output`.
        self.captured = None if echo else io.StringIO()
        self.ranks: list[_Rank] = []
        self.sel = None  # made with the first rank, like every resource of the job
        self.lifeline = None
        self.store = None  # the rendezvous store, released when the job ends
        self.board = None  # per-rank progress bars, made on the first update

    def keep_store(self, store) -> int:
        """Hold the rendezvous store until the job ends; return its port."""
        self.store = store
        return store.port

    def start_rank(self, r: int, target, payload: bytes, spec: dict) -> None:
        """Start rank ``r``: ``target(payload, spec, out, err, stack, chan, lifeline)`` in a new process."""
        if self.sel is None:
            self.sel, self.lifeline = selectors.DefaultSelector(), Lifeline()
        info = _Rank(r, self.world_size, self.captured)
        ends = {}
        try:
            for name in ("out", "err", "stack"):
                read, write = os.pipe()
                os.set_blocking(read, False)
                info.fds[name] = read
                ends[name] = Connection(write, readable=False)
            info.chan, ends["chan"] = Pipe(duplex=False)
            info.proc = procs.start(
                target, (payload, spec, ends["out"], ends["err"], ends["stack"], ends["chan"],
                         self.lifeline.reader),
                name=f"mgpu-lab rank {r}/{self.world_size}",
            )
        except BaseException:
            self._close_rank(info)
            raise
        finally:
            for end in ends.values():
                end.close()  # the rank holds its own copies now
        self.ranks.append(info)
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
        # exit code 0 without a word (os._exit(0)) is a rank that finished, as under torchrun
        bad = [i for i in self.ranks if (i.message and i.message[0] == "error")
               or (i.done and i.message is None and not i.killed and i.exitcode != 0)]

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
        if info.message is None:  # ended with exit code 0 without returning
            return None
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
    def _output(self) -> str:
        return self.captured.getvalue() if self.captured else ""

    def _raise_failure(self, failures: list[_Rank]) -> None:
        raise failure_error(self.ranks, failures, self.world_size, self.init, self._output())

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
        stacks = {i.rank: format_stack_dump(i.stack.decode(errors="replace")) for i in hung}
        raise timeout_error(self.ranks, hung, stacks, self.timeout, self.world_size, self._output())

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
        with interrupts_deferred():  # a second Ctrl-C must not cut the clean-up short
            if exc_type is KeyboardInterrupt:
                self._kill_all()
                if self.sel is not None:
                    self._drain()
                print(self._interrupted(), flush=True)
            self._kill_all()
            if self.sel is not None:
                self.sel.close()
            for info in self.ranks:
                self._close_rank(info)
            if self.lifeline is not None:
                self.lifeline.close()  # any guard still waiting kills what is left of its rank
            self.store = None
        return False

    def _interrupted(self) -> str:
        """What an interrupt stopped, as it is: only ranks seen to exit count as stopped."""
        n = len(self.ranks)
        running = [i for i in self.ranks if i.exitcode is None]
        if not n:
            return "launch interrupted before any rank started"
        if running:
            pids = ", ".join(f"rank {i.rank} (pid {i.proc.pid})" for i in running)
            return f"launch interrupted: {n - len(running)} of {n} ranks stopped; still running: {pids}"
        if n == self.world_size:
            return f"launch interrupted: stopped all {n} ranks"
        return f"launch interrupted during start-up: stopped the {n} rank(s) started so far, of {self.world_size}"

    @staticmethod
    def _close_rank(info: _Rank) -> None:
        if info.proc is not None:
            info.proc.join(5)
            try:
                info.proc.close()
            except ValueError:  # still running: its guard ends it when the lifeline is cut
                pass
        for fd in info.fds.values():
            os.close(fd)
        info.fds = {}
        if info.chan is not None:
            info.chan.close()

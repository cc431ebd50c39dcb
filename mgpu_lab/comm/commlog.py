"""Record the communication a function does in a rank: every send/recv and every collective.

Inside ``with commlog.record() as log:`` each point-to-point call (``send``,
``recv``, ``isend``, ``irecv``, and so ``batch_isend_irecv``) and each collective
made through ``torch.distributed`` lands in ``log.events`` as plain data: the
operation, the peer rank, the bytes, the dtype and the device. Lesson 09 counts
a ring all-reduce's traffic with it, and its checks judge from it that a learner's
ring talks only to its neighbours and uses no collective.

Blocking calls are the trap of hand-written rings: gloo's ``send`` returns only
once the peer has posted the matching ``recv``, so a ring in which every rank
sends first never finishes. While recording, a rank that has waited a while
publishes what it waits for in the process group's store; when every rank waits
and no waiting call can match another, every rank raises a RuntimeError naming
the cycle, at once instead of at a timeout.

Example:
    >>> with record() as log:                      # in a rank: launch(fn, 2)
    ...     dist.send(torch.ones(4), dst=1)       # doctest: +SKIP
    >>> log.events                                 # doctest: +SKIP
    [{'op': 'send', 'peer': 1, 'bytes': 16, 'dtype': 'torch.float32', 'device': 'cpu'}]
"""
from __future__ import annotations

import functools
import inspect
import itertools
import json
import threading
from contextlib import contextmanager

import torch
import torch.distributed as tdist
from torch.distributed import distributed_c10d as c10d

__all__ = ["record", "CommLog", "find_deadlock", "P2P", "COLLECTIVES"]

P2P = ("send", "recv", "isend", "irecv")
COLLECTIVES = (
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
    "gather", "scatter", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all",
    "all_to_all_single", "barrier", "all_gather_object", "broadcast_object_list", "gather_object",
    "scatter_object_list", "send_object_list", "recv_object_list", "all_reduce_coalesced",
    "all_gather_coalesced", "monitored_barrier",
)
PUBLISH_AFTER = 0.3  # seconds a call waits before its rank says so in the store
CHECK_EVERY = 0.25   # then how often it reads every rank's state
_SESSIONS = itertools.count()  # every rank records the same number of times (SPMD), so ids agree


class Deadlock(RuntimeError):
    """Every rank waits in a point-to-point call that no other rank's call can match."""


def _bytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _tensors(args, kwargs) -> list:
    found = []
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found += [v for v in value if isinstance(v, torch.Tensor)]
    return found


def find_deadlock(states: list[dict | None]) -> str | None:
    """Whether the ranks' published states are a deadlock; if so, the waits, in words.

    Args:
        states: per rank ``{"blocked": [kind, peer] or None, "pending": [[kind, peer], ...],
            "done": bool}``; ``None`` for a rank whose state is unknown.

    Returns:
        ``"rank 0 waits in send to 1, ..."`` when every rank waits (or has finished)
        and no waiting call can be matched by another rank's waiting or posted call;
        else ``None``.

    Example:
        >>> ring = [{"blocked": ["send", (r + 1) % 3], "pending": [], "done": False} for r in range(3)]
        >>> find_deadlock(ring)
        'rank 0 waits in send to 1, rank 1 waits in send to 2, rank 2 waits in send to 0'
    """
    if any(s is None or (s["blocked"] is None and not s["done"]) for s in states):
        return None
    waits = [(r, s["blocked"]) for r, s in enumerate(states) if s["blocked"] is not None]
    if not waits:
        return None
    for r, (kind, peer) in waits:
        other = "recv" if kind == "send" else "send"
        candidates = range(len(states)) if peer is None else [peer]
        for q in candidates:
            if q == r or not 0 <= q < len(states) or states[q]["done"]:
                continue
            offers = ([states[q]["blocked"]] if states[q]["blocked"] else []) + states[q]["pending"]
            if any(k == other and p in (r, None) for k, p in offers):
                return None  # this call can complete: progress is possible
    return ", ".join(f"rank {r} waits in {kind} {'to' if kind == 'send' else 'from'} "
                     f"{'any rank' if peer is None else peer}" for r, (kind, peer) in waits)


class CommLog:
    """The calls recorded in one rank (``events``), and its view of the other ranks."""

    def __init__(self, expect_device=None):
        self.events: list[dict] = []
        self.expect_device = None if expect_device is None else str(torch.device(expect_device))
        self.rank, self.world = tdist.get_rank(), tdist.get_world_size()
        self._sid = next(_SESSIONS)
        self._store = c10d._get_default_store()
        self._pending: list = []  # [kind, peer, work] posted without waiting yet
        self._seq = 0
        self._depth = 0

    # -- what every rank can see in the store -------------------------------------
    def _key(self, rank: int) -> str:
        return f"mgpu_lab_commlog/{self._sid}/{rank}"

    def publish(self, blocked=None, done: bool = False) -> None:
        self._pending = [p for p in self._pending if not p[2].is_completed()]
        self._seq += 1
        state = {"seq": self._seq, "blocked": blocked, "done": done,
                 "pending": [[k, p] for k, p, _ in self._pending]}
        self._store.set(self._key(self.rank), json.dumps(state))

    def leave(self) -> None:
        """Say for good that this rank stopped communicating (it raised)."""
        self._store.set(f"mgpu_lab_commlog/left/{self.rank}", "1")

    def _states(self) -> list:
        out = []
        for q in range(self.world):
            if self._store.check([self._key(q)]):
                out.append(json.loads(self._store.get(self._key(q))))
            elif self._store.check([f"mgpu_lab_commlog/left/{q}"]):
                out.append({"seq": -1, "blocked": None, "pending": [], "done": True})
            else:
                out.append(None)
        return out

    def wait(self, work, kind: str, peer) -> None:
        """Wait for ``work``; raise :class:`Deadlock` when no rank can make progress.

        gloo's works report completion only from ``wait()`` (and ``wait(timeout)``
        closes the connection), so a helper thread waits while this one watches.
        """
        done, failed = threading.Event(), []

        def waiter():
            try:
                work.wait()
            except BaseException as exc:  # noqa: BLE001 - raised again in the caller's thread
                failed.append(exc)
            finally:
                done.set()

        threading.Thread(target=waiter, daemon=True, name="commlog-wait").start()
        published, seen = False, None
        if not done.wait(PUBLISH_AFTER):
            self.publish([kind, peer])
            published = True
            while not done.wait(CHECK_EVERY):
                states = self._states()
                verdict = find_deadlock(states)
                snapshot = [None if s is None else s["seq"] for s in states]
                if verdict and seen == (verdict, snapshot):  # the same waits, twice: nobody moved
                    raise Deadlock(
                        f"deadlock: every rank waits and none can proceed ({verdict}). A blocking send "
                        "returns only once its peer has posted the matching recv, so a ring where every "
                        "rank sends first (or receives first) never finishes: post the receive with "
                        "irecv (or isend) before waiting, or let even ranks send first and odd ranks "
                        "receive first")
                seen = (verdict, snapshot) if verdict else None
        if failed:
            raise failed[0]
        if published:
            self.publish(None)

    # -- the recording wrappers ---------------------------------------------------
    def _note(self, op: str, peer, tensor) -> None:
        device = str(tensor.device) if isinstance(tensor, torch.Tensor) else ""
        if self.expect_device and op in P2P and device != self.expect_device:
            raise RuntimeError(
                f"rank {self.rank}: {op} of a tensor on {device} while the input is on {self.expect_device}: "
                "create the buffers on the input's device (torch.empty_like(chunk), tensor.new_empty(n) "
                "or device=tensor.device); on GPUs NCCL sends and receives CUDA tensors only")
        self.events.append({"op": op, "peer": peer, "bytes": _bytes(tensor), "device": device,
                            "dtype": str(tensor.dtype) if isinstance(tensor, torch.Tensor) else ""})

    def p2p(self, name: str, originals: dict):
        """The recording stand-in for ``send``/``recv``/``isend``/``irecv``."""
        orig = originals[name]
        sig = inspect.signature(orig)
        nonblocking = originals["isend" if "send" in name else "irecv"]
        kind = "send" if "send" in name else "recv"

        @functools.wraps(orig)
        def wrapper(*args, **kwargs):
            bound = sig.bind(*args, **kwargs)
            a = bound.arguments
            peer = a.get("dst", a.get("src"))
            group_peer = a.get("group_dst", a.get("group_src"))
            if peer is None and group_peer is not None:
                peer = tdist.get_global_rank(a["group"], group_peer) if a.get("group") else group_peer
            self._note(name, peer, a.get("tensor"))
            call = {k: v for k, v in a.items() if k != "tensor"}
            work = nonblocking(a["tensor"], **call)
            if name.startswith("i"):
                self._pending.append([kind, peer, work])
                return _Work(work, self, kind, peer)
            self.wait(work, kind, peer)
            if kind == "recv":
                return peer if peer is not None else work._source_rank()
            return None

        return wrapper

    def collective(self, name: str, orig):
        """The recording stand-in for a collective (calls inside it are not recorded twice)."""

        @functools.wraps(orig)
        def wrapper(*args, **kwargs):
            if self._depth == 0:
                tensors = _tensors(args, kwargs)
                self.events.append({"op": name, "peer": None, "bytes": sum(map(_bytes, tensors)),
                                    "dtype": str(tensors[0].dtype) if tensors else "",
                                    "device": str(tensors[0].device) if tensors else ""})
            self._depth += 1
            try:
                return orig(*args, **kwargs)
            finally:
                self._depth -= 1

        return wrapper


class _Work:
    """A Work whose ``wait()`` watches for deadlocks; everything else is the Work's."""

    def __init__(self, work, log: CommLog, kind: str, peer):
        self._work, self._log, self._kind, self._peer = work, log, kind, peer

    def wait(self, timeout=None):
        self._log.wait(self._work, self._kind, self._peer)
        self._log._pending = [p for p in self._log._pending if p[2] is not self._work]
        return True

    def __getattr__(self, name):
        return getattr(self._work, name)


@contextmanager
def record(*functions, expect_device=None):
    """Record this rank's point-to-point calls and collectives while the block runs.

    Args:
        *functions: functions whose globals may hold ``send``, ``isend``, ... imported
            by name (``from torch.distributed import isend``); those are recorded too.
        expect_device: when given, a send or receive of a tensor on another device
            raises a RuntimeError that says so (how a check sees a GPU-only bug on a CPU).

    Yields:
        A :class:`CommLog`; ``log.events`` is a list of dicts with ``op``, ``peer``,
        ``bytes``, ``dtype`` and ``device``.

    Raises:
        Deadlock: (a RuntimeError) when every rank waits in a call no other rank can match.
    """
    log = CommLog(expect_device)
    originals = {name: getattr(tdist, name) for name in P2P + COLLECTIVES if hasattr(tdist, name)}
    stand_ins = {name: log.p2p(name, originals) if name in P2P else log.collective(name, orig)
                 for name, orig in originals.items()}
    by_id = {id(orig): stand_ins[name] for name, orig in originals.items()}
    patched_globals = []
    for fn in functions:
        g = getattr(fn, "__globals__", {})
        for key, value in list(g.items()):
            if id(value) in by_id and value is originals.get(getattr(value, "__name__", ""), None):
                patched_globals.append((g, key, value))
                g[key] = by_id[id(value)]
    for name, wrapper in stand_ins.items():
        setattr(tdist, name, wrapper)
        if hasattr(c10d, name):
            setattr(c10d, name, wrapper)
    log.publish(None)
    try:
        yield log
        log.publish(None, done=True)
    except BaseException:
        log.leave()
        raise
    finally:
        for name, orig in originals.items():
            setattr(tdist, name, orig)
            if hasattr(c10d, name):
                setattr(c10d, name, orig)
        for g, key, value in patched_globals:
            g[key] = value

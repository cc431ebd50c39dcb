"""Record what a rank communicates: every collective and every send/recv, from either API, in order.

The course's one recorder: lessons 08 and 09 show and judge communication with it. Inside
``with record() as log:`` each call lands in ``log.events`` as a plain dict::

    {"op": "all_gather", "call": "all_gather_single", "api": "c10d", "peer": None,
     "numel": 12, "bytes": 48, "dtype": "torch.float32", "device": "cpu", "ranks": [0, 1, 2]}

- ``op``: the kind of communication: ``all_reduce``, ``all_gather``, ``reduce_scatter``,
  ``broadcast``, ``reduce``, ``all_to_all``, ``gather``, ``scatter``, ``barrier``,
  ``send``, ``recv``, ``wait``, or the name of an object collective (``all_gather_object``, ...);
- ``call``: the function called (``isend``, ``reduce_scatter_tensor``, ``wait_tensor``, ...);
- ``api``: ``"c10d"`` for the functions of ``torch.distributed`` (your code, DDP's
  communication hooks, ``fully_shard``), ``"functional"`` for the functional collectives
  ``torch.ops._c10d_functional.*`` that DTensor, tensor parallelism and
  ``torch.distributed._functional_collectives`` issue;
- ``peer``: the other rank of a send or receive (``None`` for a receive from any
  rank, and for collectives);
- ``numel``: the elements of the *whole* tensor the call works on: the tensor of an
  all-reduce, a broadcast, a send or a receive, the input of a reduce-scatter, the output of an
  all-gather; for gather and scatter this rank's piece times the group's size;
  0 for barriers and object collectives; ``bytes`` is ``numel`` times the element size;
- ``dtype`` and ``device`` of that tensor;
- ``ranks``: the global ranks of the group the call used (the default group's for calls
  without one): on a 2D mesh it tells which dimension a collective ran over, e.g.
  ``[0, 1]`` for a "tp" group and ``[0, 2]`` for a "dp" group of a (2, 2) mesh; ``None``
  for a ``wait`` (which belongs to the collective before it).

A functional collective returns at once; the wait for its result (``wait_tensor``,
when the result is first used or ``.wait()`` is called) is an event of its own, with
op ``"wait"``. A call made inside a recorded call is not recorded again: a deprecated
name calling its new one (``all_gather_into_tensor`` -> ``all_gather_single``),
``all_gather_object`` calling ``all_gather``, or the c10d operation a functional
collective runs. DDP's own gradient all-reduce (no hook registered) runs in C++ and
is not seen: register a communication hook, as :func:`mgpu_lab.parallel.ddp.fit` does.
To see the functional collectives, every tensor operation of the recording thread passes
through a ``TorchDispatchMode`` while the block runs: time code outside the block.

Blocking calls are the trap of hand-written rings: gloo's ``send`` returns only once
the peer has posted the matching ``recv``, so a ring in which every rank sends
first never finishes. While recording, a rank that has waited a while in a send or
receive publishes what it waits for in the process group's store; when every rank
waits and no waiting call can match another, every rank raises :class:`Deadlock`
naming the cycle, at once instead of at a timeout.

Example:
    >>> from mgpu_lab import launch
    >>> def in_a_rank():
    ...     import torch.distributed._functional_collectives as funcol
    ...     with record() as log:
    ...         tdist.all_reduce(torch.ones(4))                                    # torch.distributed
    ...         funcol.all_reduce(torch.ones(2), "sum", tdist.group.WORLD).wait()  # what DTensor calls
    ...     return [(e["op"], e["call"], e["api"], e["numel"]) for e in log]
    >>> launch(in_a_rank, 2)[0]
    launch: 2 ranks · ...
    [('all_reduce', 'all_reduce', 'c10d', 4), ('all_reduce', 'all_reduce', 'functional', 2),
     ('wait', 'wait_tensor', 'functional', 2)]
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
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["record", "Recording", "summarize", "find_deadlock", "Deadlock", "P2P"]

#: The point-to-point functions of ``torch.distributed`` (each recorded with its peer).
P2P = ("send", "recv", "isend", "irecv")
# torch.distributed's collectives: name -> (op, the argument holding the whole tensor(s), the input argument,
# whether that argument is this rank's piece only, to be counted once per rank of the group)
_C10D = {
    "all_reduce": ("all_reduce", "tensor", "tensor", False),
    "all_reduce_coalesced": ("all_reduce", "tensors", "tensors", False),
    "reduce": ("reduce", "tensor", "tensor", False),
    "broadcast": ("broadcast", "tensor", "tensor", False),
    "all_gather": ("all_gather", "tensor_list", "tensor", False),
    "all_gather_single": ("all_gather", "output_tensor", "input_tensor", False),
    "all_gather_into_tensor": ("all_gather", "output_tensor", "input_tensor", False),
    "all_gather_coalesced": ("all_gather", "output_tensor_lists", "input_tensor_list", False),
    "reduce_scatter": ("reduce_scatter", "input_list", "input_list", False),
    "reduce_scatter_single": ("reduce_scatter", "input", "input", False),
    "reduce_scatter_tensor": ("reduce_scatter", "input", "input", False),
    "all_to_all": ("all_to_all", "input_tensor_list", "input_tensor_list", False),
    "all_to_all_single": ("all_to_all", "input", "input", False),
    "gather": ("gather", "tensor", "tensor", True),
    "gather_single": ("gather", "tensor", "tensor", True),
    "gather_into_tensor": ("gather", "tensor", "tensor", True),
    "scatter": ("scatter", "tensor", "scatter_list", True),
    "barrier": ("barrier", None, None, False),
    "monitored_barrier": ("barrier", None, None, False),
    **{name: (name, None, None, False) for name in (
        "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
        "send_object_list", "recv_object_list")},
}
# functional collectives (torch.ops namespaces below): op name -> (op, whether the input is one rank's piece)
_FUNCTIONAL = {
    "all_reduce": ("all_reduce", False), "all_reduce_": ("all_reduce", False),
    "all_reduce_coalesced": ("all_reduce", False), "all_reduce_coalesced_": ("all_reduce", False),
    "all_gather_into_tensor": ("all_gather", True), "all_gather_into_tensor_out": ("all_gather", True),
    "all_gather_into_tensor_coalesced": ("all_gather", True),
    "reduce_scatter_tensor": ("reduce_scatter", False), "reduce_scatter_tensor_coalesced": ("reduce_scatter", False),
    "all_to_all_single": ("all_to_all", False), "broadcast": ("broadcast", False), "broadcast_": ("broadcast", False),
    "wait_tensor": ("wait", False),
}
_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd", "c10d_functional")
PUBLISH_AFTER = 0.3  # seconds a send or receive waits before its rank says so in the store
CHECK_EVERY = 0.25   # then how often it reads every rank's state
_SESSIONS = itertools.count()  # every rank records the same number of times (SPMD), so ids agree
_ACTIVE: list = []  # the recordings open in this process, outermost first: each event goes to all
_PATCHED: list = []  # (module, name, original) while torch.distributed's functions are replaced
_INSTALLED: dict = {}  # name -> (original, stand-in) meanwhile
_LOCK = threading.RLock()
_local = threading.local()  # .busy: inside a recorded call (the re-entrancy guard); .mode: this thread's spy


class Deadlock(RuntimeError):
    """Every rank waits in a point-to-point call that no other rank's call can match."""


# -- what an event says ------------------------------------------------------------------------
def _tensors(value) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


@contextmanager
def _inside():
    """While a recorded call runs: the calls it makes are its own business, not recorded again."""
    _local.busy = getattr(_local, "busy", 0) + 1
    try:
        yield
    finally:
        _local.busy -= 1


def _recording() -> bool:
    return bool(_ACTIVE) and not getattr(_local, "busy", 0)


def _group_ranks(group) -> list | None:
    """The global ranks of a process group (a ProcessGroup, a functional collective's group name, or None for
    the default group); None when it cannot be told."""
    try:
        if isinstance(group, str):
            group = c10d._resolve_process_group(group)
        return [int(r) for r in tdist.get_process_group_ranks(group if group is not None else tdist.group.WORLD)]
    except Exception:  # noqa: BLE001 - a group torch cannot resolve: the event says so with None
        return None


def _note(op: str, call: str, api: str, peer, whole, times: int = 1, source=None, group=None) -> None:
    """Append one event to every open recording (and check the device of a send or receive)."""
    tensors = _tensors(whole)
    sample = tensors[0] if tensors else None
    numel = sum(t.numel() for t in tensors) * times
    event = {"op": op, "call": call, "api": api, "peer": peer, "numel": int(numel),
             "bytes": int(numel * sample.element_size()) if sample is not None else 0,
             "dtype": str(sample.dtype) if sample is not None else "",
             "device": str(sample.device) if sample is not None else "",
             "ranks": None if op == "wait" else _group_ranks(group)}
    for rec in list(_ACTIVE):
        if rec.expect_device and op in ("send", "recv") and event["device"] != rec.expect_device:
            raise RuntimeError(
                f"rank {rec.rank}: {call} of a tensor on {event['device']} while the input is on "
                f"{rec.expect_device}: create the buffers on the input's device (torch.empty_like(chunk), "
                "tensor.new_empty(n) or device=tensor.device); on GPUs NCCL sends and receives CUDA tensors only")
    for rec in list(_ACTIVE):
        kept = dict(event)
        if rec.keep_inputs and isinstance(source, torch.Tensor):
            kept["input"] = source.detach().to("cpu", copy=True)
        rec.events.append(kept)


# -- deadlocks ---------------------------------------------------------------------------------
def _peer_key(kind: str, peer, tag) -> str:
    """The key under which a rank counts its posted sends or receives of one kind, peer and tag."""
    return f"{kind}/{'any' if peer is None else peer}/{tag}"


def _can_complete(states: list[dict], r: int, wait: list) -> bool:
    """Whether rank ``r``'s blocked send or receive can be matched by another rank's call.

    Where the ranks published how many calls they posted (``"posted"``), that count decides: the k-th
    receive from q with a tag is matched by q's k-th send to r with that tag (messages between two ranks
    are matched in order), so it can complete once q has posted k of them, whether or not q has waited for
    them. gloo reports a posted send as completed only once it is waited for, so the pending list alone
    would count a send that an earlier receive already took. A receive from any rank, and states without
    counts, fall back to the calls other ranks wait in or have posted and not waited for.
    """
    kind, peer, *rest = wait
    ordinal, tag = (rest + [None, 0])[:2]
    other = "recv" if kind == "send" else "send"
    if peer is not None and ordinal is not None and 0 <= peer < len(states) and peer != r \
            and "posted" in states[peer]:
        posted = states[peer]["posted"]
        offered = posted.get(_peer_key(other, r, tag), 0)
        if other == "recv":  # a receive from any rank may take this send too
            offered += posted.get(_peer_key("recv", None, tag), 0)
        return offered >= ordinal
    candidates = range(len(states)) if peer is None else [peer]
    for q in candidates:
        if q == r or not 0 <= q < len(states) or states[q]["done"]:
            continue
        offers = ([states[q]["blocked"]] if states[q]["blocked"] else []) + states[q]["pending"]
        if any(o[0] == other and o[1] in (r, None) for o in offers):
            return True
    return False


def find_deadlock(states: list[dict | None]) -> str | None:
    """Whether the ranks' published states are a deadlock; if so, the waits, in words.

    Args:
        states: per rank ``{"blocked": [kind, peer, ordinal, tag] or None, "pending": [[kind, peer], ...],
            "posted": {"send/1/0": n, ...}, "done": bool}``; ``None`` for a rank whose state is unknown.
            ``ordinal`` counts the rank's calls of that kind, peer and tag (1 for the first); ``posted``
            counts every send and receive the rank has posted, waited for or not (both may be left out:
            then a call posted and not waited for is taken as unmatched).

    Returns:
        ``"rank 0 waits in send to 1, ..."`` when every rank waits (or has finished)
        and no waiting call can be matched by another rank's waiting or posted call;
        else ``None``.

    Example:
        >>> ring = [{"blocked": ["send", (r + 1) % 3], "pending": [], "done": False} for r in range(3)]
        >>> find_deadlock(ring)
        'rank 0 waits in send to 1, rank 1 waits in send to 2, rank 2 waits in send to 0'

        Rank 0 posted 3 sends to rank 1 and waits for rank 1's gradient; rank 1 waits for a 4th activation.
        gloo still lists the 3 sends as pending (none was waited for), yet all were received:

        >>> states = [{"blocked": ["recv", 1, 1, 0], "pending": [["send", 1]] * 3, "done": False,
        ...            "posted": {"send/1/0": 3, "recv/1/0": 1}},
        ...           {"blocked": ["recv", 0, 4, 0], "pending": [], "done": False, "posted": {"recv/0/0": 4}}]
        >>> find_deadlock(states)
        'rank 0 waits in recv from 1, rank 1 waits in recv from 0'
    """
    if any(s is None or (s["blocked"] is None and not s["done"]) for s in states):
        return None
    waits = [(r, s["blocked"]) for r, s in enumerate(states) if s["blocked"] is not None]
    if not waits:
        return None
    if any(_can_complete(states, r, wait) for r, wait in waits):
        return None  # a call can complete: progress is possible
    return ", ".join(f"rank {r} waits in {wait[0]} {'to' if wait[0] == 'send' else 'from'} "
                     f"{'any rank' if wait[1] is None else wait[1]}" for r, wait in waits)


class Recording:
    """What one ``with record()`` block saw in this rank.

    Attributes:
        events: the recorded calls in order, one dict each (see the module docstring):
            plain data, so a rank can return it.
        rank, world_size: this rank and the default group's size.

    Iterating over a Recording iterates over its events; ``len()`` counts them.
    """

    def __init__(self, keep_inputs: bool = False, expect_device=None):
        if not tdist.is_initialized():
            raise RuntimeError("record() needs the default process group, and it is not initialised: record "
                               "inside a rank (mgpu_lab.launch(fn, nprocs) initialises it) or after "
                               "torch.distributed.init_process_group(...)")
        self.events: list[dict] = []
        self.keep_inputs = keep_inputs
        self.expect_device = None if expect_device is None else str(torch.device(expect_device))
        self.rank, self.world_size = tdist.get_rank(), tdist.get_world_size()
        self._sid = next(_SESSIONS)
        self._store = c10d._get_default_store()
        self._pending: list = []  # [kind, peer, work] posted without waiting yet
        self._posted: dict[str, int] = {}  # _peer_key(kind, peer, tag) -> how many were posted
        self._seq = 0

    def __iter__(self):
        return iter(self.events)

    def __len__(self) -> int:
        return len(self.events)

    def __repr__(self) -> str:
        return f"Recording(rank={self.rank}, {len(self.events)} events: {summarize(self.events)})"

    # -- what every rank can see in the store ----------------------------------------------------
    def _key(self, rank: int) -> str:
        return f"mgpu_lab_record/{self._sid}/{rank}"

    def _publish(self, blocked=None, done: bool = False) -> None:
        self._pending = [p for p in self._pending if not p[2].is_completed()]
        self._seq += 1
        state = {"seq": self._seq, "blocked": blocked, "done": done,
                 "pending": [[k, p] for k, p, _ in self._pending], "posted": self._posted}
        self._store.set(self._key(self.rank), json.dumps(state))

    def _open(self) -> None:
        self._store.set(f"mgpu_lab_record/left/{self.rank}", "0")  # it communicates again
        self._publish(None)

    def _leave(self) -> None:
        """Say that this rank stopped communicating (it raised), until it records again."""
        self._store.set(f"mgpu_lab_record/left/{self.rank}", "1")

    def _left(self, rank: int) -> bool:
        key = f"mgpu_lab_record/left/{rank}"
        return self._store.check([key]) and self._store.get(key) == b"1"

    def _states(self) -> list:
        out = []
        for q in range(self.world_size):
            if self._store.check([self._key(q)]):
                out.append(json.loads(self._store.get(self._key(q))))
            elif self._left(q):
                out.append({"seq": -1, "blocked": None, "pending": [], "done": True})
            else:
                out.append(None)
        return out

    def _post(self, kind: str, peer, tag) -> int:
        """Count a send or receive posted now, in every open recording; its ordinal in this one."""
        key = _peer_key(kind, peer, tag)
        for rec in _ACTIVE:
            rec._posted[key] = rec._posted.get(key, 0) + 1
        return self._posted[key]

    def _wait(self, work, kind: str, peer, ordinal: int, tag: str) -> None:
        """Wait for a send's or receive's ``work``; raise :class:`Deadlock` when no rank can make progress.

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

        threading.Thread(target=waiter, daemon=True, name="record-wait").start()
        published, seen = False, None
        if not done.wait(PUBLISH_AFTER):
            self._publish([kind, peer, ordinal, tag])
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
            self._publish(None)


class _Work:
    """A send's or receive's Work whose ``wait()`` watches for deadlocks; everything else is the Work's."""

    def __init__(self, work, rec: Recording, kind: str, peer, ordinal: int, tag):
        self._work, self._rec, self._kind, self._peer = work, rec, kind, peer
        self._ordinal, self._tag = ordinal, tag

    def wait(self, timeout=None):
        self._rec._wait(self._work, self._kind, self._peer, self._ordinal, self._tag)
        self._rec._pending = [p for p in self._rec._pending if p[2] is not self._work]
        return True

    def __getattr__(self, name):
        return getattr(self._work, name)


# -- the stand-ins for torch.distributed's functions ---------------------------------------------
def _match_tag(arguments: dict) -> str:
    """What a send and a receive must share to be matched, besides their two ranks: the process group and,
    on gloo, the tag (NCCL matches a pair's messages in order whatever their tags)."""
    group = arguments.get("group")
    if group is None or group is c10d._get_default_group():
        name = ""
    else:  # every member names it the same way
        name = ",".join(map(str, tdist.get_process_group_ranks(group)))
    tensor = arguments.get("tensor")
    if isinstance(tensor, torch.Tensor) and tensor.is_cuda and "nccl" in str(tdist.get_backend(group)):
        return f"{name}:*"
    return f"{name}:{arguments.get('tag') or 0}"


def _p2p(name: str, original, nonblocking):
    """The recording stand-in for ``send``/``recv``/``isend``/``irecv``."""
    signature = inspect.signature(original)
    kind = "send" if "send" in name else "recv"

    @functools.wraps(original)
    def stand_in(*args, **kwargs):
        if not _recording():
            return original(*args, **kwargs)
        a = signature.bind(*args, **kwargs).arguments
        peer = a.get("dst", a.get("src"))
        group_peer = a.get("group_dst", a.get("group_src"))
        if peer is None and group_peer is not None:
            peer = tdist.get_global_rank(a["group"], group_peer) if a.get("group") else group_peer
        _note(kind, name, "c10d", peer, a.get("tensor"), source=a.get("tensor") if kind == "send" else None,
              group=a.get("group"))
        rec = _ACTIVE[-1]  # the innermost recording watches for deadlocks
        tag = _match_tag(a)
        with _inside():
            work = nonblocking(a["tensor"], **{k: v for k, v in a.items() if k != "tensor"})
            ordinal = rec._post(kind, peer, tag)
            if name.startswith("i"):
                rec._pending.append([kind, peer, work])
                return _Work(work, rec, kind, peer, ordinal, tag)
            rec._wait(work, kind, peer, ordinal, tag)
        if kind == "recv":
            return peer if peer is not None else work._source_rank()
        return None

    return stand_in


def _collective(name: str, original):
    """The recording stand-in for one of torch.distributed's collectives."""
    op, whole, source, per_rank = _C10D[name]
    signature = inspect.signature(original)

    @functools.wraps(original)
    def stand_in(*args, **kwargs):
        if not _recording():
            return original(*args, **kwargs)
        try:
            bound = signature.bind(*args, **kwargs).arguments
        except TypeError:  # wrong arguments: let the real function say so
            return original(*args, **kwargs)
        times = tdist.get_world_size(bound.get("group")) if per_rank else 1
        _note(op, name, "c10d", None, bound.get(whole) if whole else None, times, bound.get(source),
              bound.get("group"))
        with _inside():
            return original(*args, **kwargs)

    return stand_in


class _FunctionalSpy(TorchDispatchMode):
    """Sees the functional collectives (``torch.ops._c10d_functional.*``) as they are dispatched."""

    def __init__(self):
        super().__init__()
        from torch.distributed._functional_collectives import AsyncCollectiveTensor
        from torch.distributed.tensor import DTensor

        self.desugar = (DTensor, AsyncCollectiveTensor)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(issubclass(t, self.desugar) for t in types):
            return NotImplemented  # let DTensor (or the async result) turn this into collectives we then see
        spec = None
        if isinstance(func, torch._ops.OpOverload) and func.namespace in _NAMESPACES:
            spec = _FUNCTIONAL.get(func._opname)
        if spec is None or not _recording():
            return func(*args, **kwargs)
        op, per_rank = spec
        tensor = args[0] if args else next(iter(kwargs.values()), None)  # input, inputs or tensor
        times = int(args[1] if len(args) > 1 else kwargs["group_size"]) if per_rank else 1
        group = kwargs.get("group_name", next((a for a in reversed(args) if isinstance(a, str)), None))
        _note(op, func._opname, "functional", None, tensor, times, tensor, group)
        with _inside():
            return func(*args, **kwargs)


def _install() -> None:
    """Replace torch.distributed's functions by their stand-ins (in both modules that hold them)."""
    originals = {name: getattr(tdist, name) for name in (*P2P, *_C10D) if hasattr(tdist, name)}
    stand_ins = {}
    for name, original in originals.items():
        if name in P2P:
            nonblocking = originals["isend" if "send" in name else "irecv"]
            stand_ins[name] = _p2p(name, original, nonblocking)
        else:
            stand_ins[name] = _collective(name, original)
    for module in (tdist, c10d):
        for name, stand_in in stand_ins.items():
            if getattr(module, name, None) is originals[name]:
                _PATCHED.append((module, name, originals[name]))
                setattr(module, name, stand_in)
    _INSTALLED.update({name: (originals[name], stand_ins[name]) for name in originals})


def _uninstall() -> None:
    while _PATCHED:
        module, name, original = _PATCHED.pop()
        setattr(module, name, original)
    _INSTALLED.clear()


def _patch_globals(functions) -> list:
    """Functions that imported ``isend`` (or any recorded function) by name call the stand-in too."""
    patched = []
    for fn in functions:
        g = getattr(fn, "__globals__", {})
        for key, value in list(g.items()):
            pair = _INSTALLED.get(getattr(value, "__name__", None))
            if pair is not None and value is pair[0]:
                patched.append((g, key, value))
                g[key] = pair[1]
    return patched


@contextmanager
def record(*functions, keep_inputs: bool = False, expect_device=None):
    """Record this rank's sends, receives and collectives, c10d and functional, while the block runs.

    Recordings nest: an inner ``with record()`` sees what it encloses, and the outer one sees it too.

    Args:
        *functions: functions whose globals may hold ``send``, ``isend``, ... imported
            by name (``from torch.distributed import isend``); those are recorded too.
        keep_inputs: also keep a CPU copy of each call's input tensor under ``"input"``
            (e.g. to see which shard a rank contributed to an all-gather).
        expect_device: when given, a send or receive of a tensor on another device
            raises a RuntimeError that says so (how a check sees a GPU-only bug on a CPU).

    Yields:
        A :class:`Recording`; ``log.events`` is the list of event dicts.

    Raises:
        Deadlock: (a RuntimeError) when every rank waits in a send or receive no other rank can match.
        RuntimeError: when the default process group is not initialised.

    Example:
        >>> from mgpu_lab import launch
        >>> def ring():
        ...     other = 1 - tdist.get_rank()
        ...     with record() as log:
        ...         request = tdist.isend(torch.ones(4), other)   # posted: the recv below can meet it
        ...         tdist.recv(torch.empty(4), other)
        ...         request.wait()
        ...     return [(e["op"], e["call"], e["peer"], e["bytes"]) for e in log]
        >>> launch(ring, 2)
        launch: 2 ranks · ...
        [[('send', 'isend', 1, 16), ('recv', 'recv', 1, 16)], [('send', 'isend', 0, 16), ('recv', 'recv', 0, 16)]]

        FSDP2 calls ``torch.distributed``'s collectives: an all-gather per group of parameters
        before it is used, a reduce-scatter of its gradients in backward:

        >>> from mgpu_lab.sharding.fsdp import BlockNet, make_mesh
        >>> from mgpu_lab.sharding.wrap import shard_model
        >>> def fsdp_step():
        ...     model = shard_model(BlockNet(), make_mesh())   # an FSDP2 model
        ...     with record() as log:
        ...         model(torch.ones(2, 8)).sum().backward()
        ...     return summarize(log)
        >>> launch(fsdp_step, 2)[0]   # 4 blocks + the root: 5 gathers forward, the blocks' 4 again backward
        launch: 2 ranks · ...
        {'all_gather': 9, 'reduce_scatter': 5}
    """
    rec = Recording(keep_inputs, expect_device)
    with _LOCK:
        if not _ACTIVE:
            _install()
        _ACTIVE.append(rec)
    patched = _patch_globals(functions)
    spy = None
    if getattr(_local, "mode", None) is None:  # one spy per thread, however deep the nesting
        spy = _local.mode = _FunctionalSpy()
        spy.__enter__()
    try:
        rec._open()
        yield rec
        rec._publish(None, done=True)
    except BaseException:
        rec._leave()
        raise
    finally:
        if spy is not None:
            spy.__exit__(None, None, None)
            _local.mode = None
        for g, key, value in reversed(patched):
            g[key] = value
        with _LOCK:
            _ACTIVE.remove(rec)
            if not _ACTIVE:
                _uninstall()


def summarize(events, what: str = "calls") -> dict:
    """Per op: the number of calls (``what="calls"``), or the elements (``"numel"``) or bytes moved.

    Args:
        events: a :class:`Recording` or a list of its event dicts.
        what: ``"calls"``, ``"numel"`` or ``"bytes"``.

    Raises:
        ValueError: for any other ``what``.

    Example:
        >>> summarize([{"op": "all_gather", "numel": 8}, {"op": "all_gather", "numel": 8}], "numel")
        {'all_gather': 16}
    """
    if what not in ("calls", "numel", "bytes"):
        raise ValueError(f"what={what!r}: use 'calls', 'numel' or 'bytes'")
    out: dict = {}
    for event in events:
        out[event["op"]] = out.get(event["op"], 0) + (1 if what == "calls" else event[what])
    return out

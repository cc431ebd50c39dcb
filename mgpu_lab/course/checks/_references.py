"""Reference implementations an answer must not call, caught where the learner's code runs.

An exercise names its references (``@exercise(..., references=("mgpu_lab.x:f",
"torch.nn.parallel:replicate"))``): the library's or torch's own version of what
the learner builds. While a check runs the learner's code, :func:`armed` swaps
the code of each reference function (a class: its ``__init__``) for a tripwire,
so a call raises :class:`ReferenceCalled` naming it, however the answer reached
the function: imported under another name, through another module, or from a
thread. The swap is of the function's code object, so every alias is caught;
an answer that *copies* a reference's source is not (that is why references
stay out of the lessons' imports). :func:`allowed` lifts the tripwires for the
checker's own uses of a reference inside the same process.

Example:
    >>> import json
    >>> with armed(["json:dumps"]):
    ...     json.dumps([1])
    Traceback (most recent call last):
    ...
    mgpu_lab.course.checks._references.ReferenceCalled: your code calls json.dumps, ...
    >>> json.dumps([1])   # disarmed again
    '[1]'
"""
from __future__ import annotations

import importlib
import threading
import types
from contextlib import contextmanager

__all__ = ["ReferenceCalled", "armed", "allowed", "resolve", "called", "calls"]

_LOCK = threading.Lock()
_ARMED: dict[types.FunctionType, tuple[types.CodeType, types.CodeType]] = {}  # function -> (own code, tripwire)
_CALLS: list[str] = []


class ReferenceCalled(RuntimeError):
    """The learner's code called a reference implementation of the exercise."""


def resolve(name: str) -> types.FunctionType:
    """The Python function ``"module:qualified.name"`` names (a class: its ``__init__``).

    Raises:
        ValueError: the name is malformed or names no Python function.
    """
    module, sep, qualname = name.partition(":")
    if not sep or not module or not qualname:
        raise ValueError(f"reference {name!r} must look like 'package.module:function' or 'module:Class.method'")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if isinstance(obj, type):
        obj = obj.__dict__.get("__init__")
    obj = getattr(obj, "__func__", obj)  # a classmethod or bound method: its function
    if not isinstance(obj, types.FunctionType):
        raise ValueError(f"reference {name!r} is no Python function (a class needs its own __init__)")
    return obj


def called(name: str) -> None:
    """What a tripwire does: note the call and raise :class:`ReferenceCalled`."""
    _CALLS.append(name)
    raise ReferenceCalled(f"your code calls {name.replace(':', '.')}, the library's own version of what this "
                          "exercise asks you to build: write it yourself")


def calls() -> list[str]:
    """The references called since the process started (an answer may catch the error; this list stays)."""
    return list(_CALLS)


def _tripwire(fn: types.FunctionType, name: str) -> types.CodeType:
    """A code object with ``fn``'s free variables (a function's code may only be swapped for such) that calls
    :func:`called`."""
    free = [f"_free{i}" for i in range(len(fn.__code__.co_freevars))]
    src = ("def _outer():\n" + "".join(f"    {v} = None\n" for v in free)
           + "    def _trip(*args, **kwargs):\n"
           + (f"        lambda: ({', '.join(free)},)\n" if free else "")
           + "        from mgpu_lab.course.checks import _references\n"
           + f"        _references.called({name!r})\n"
           + "    return _trip\n")
    namespace: dict = {}
    exec(compile(src, f"<reference {name}>", "exec"), namespace)  # noqa: S102 - our own fixed source
    return namespace["_outer"]().__code__


@contextmanager
def armed(names):
    """Inside the block, calling any reference in ``names`` raises :class:`ReferenceCalled`.

    A reference that this torch release does not have (its module or name is missing) is skipped:
    an answer cannot call it.
    """
    mine = []
    with _LOCK:
        for name in names:
            try:
                fn = resolve(name)
            except (ImportError, AttributeError):  # not in this torch release: nothing there to call
                continue
            if fn not in _ARMED:
                _ARMED[fn] = (fn.__code__, _tripwire(fn, name))
                fn.__code__ = _ARMED[fn][1]
                mine.append(fn)
    try:
        yield
    finally:
        with _LOCK:
            for fn in mine:
                fn.__code__ = _ARMED.pop(fn)[0]


@contextmanager
def allowed():
    """Inside the block, the references work again (the checker's own use of one, in the learner's process)."""
    with _LOCK:
        lifted = dict(_ARMED)
        for fn, (own, _) in lifted.items():
            fn.__code__ = own
    try:
        yield
    finally:
        with _LOCK:
            for fn, (_, trip) in lifted.items():
                if fn in _ARMED:
                    fn.__code__ = trip

"""Functions and classes of a notebook cell, by value, with their file names kept.

A function defined in a notebook cell cannot be pickled by reference (the rank
has no ``__main__`` module holding it), so it travels by value with
cloudpickle. Since cloudpickle 3.1.3 every code object pickled by value has its
``co_filename`` replaced by ``"<dynamic-code>"`` (for deterministic payloads).
A rank's traceback then names ``<dynamic-code>`` instead of the cell
(``/tmp/ipykernel_1/123.py``), and the kernel's linecache can no longer supply
the learner's line. :class:`Pickler` restores the real file name; with older
cloudpickle releases, which keep it, it changes nothing.

Example:
    >>> import pickle
    >>> ns = {"__name__": "__main__"}
    >>> exec(compile("def f():\\n    return 1\\n", "/tmp/ipykernel_1/abc.py", "exec"), ns)
    >>> pickle.loads(dumps(ns["f"])).__code__.co_filename
    '/tmp/ipykernel_1/abc.py'
"""
from __future__ import annotations

import io
import types
from collections import ChainMap

import cloudpickle

__all__ = ["Pickler", "dumps", "dump"]

_DYNAMIC = "<dynamic-code>"
_code_reduce = cloudpickle.Pickler.dispatch_table.get(types.CodeType)


def _reduce_code(code: types.CodeType):
    """cloudpickle's reduction of ``code``, with the real ``co_filename`` put back."""
    ctor, args = _code_reduce(code)
    if code.co_filename != _DYNAMIC:
        args = tuple(code.co_filename if isinstance(a, str) and a == _DYNAMIC else a for a in args)
    return ctor, args


class Pickler(cloudpickle.Pickler):
    """``cloudpickle.Pickler`` that keeps the file name of code pickled by value."""

    if _code_reduce is not None:
        dispatch_table = ChainMap({types.CodeType: _reduce_code}, cloudpickle.Pickler.dispatch_table)


def dump(obj, file, protocol: int | None = None) -> None:
    """Write ``obj`` to the binary ``file`` as :func:`cloudpickle.dump` does, file names kept."""
    Pickler(file, protocol=protocol).dump(obj)


def dumps(obj, protocol: int | None = None) -> bytes:
    """``obj`` as bytes, as :func:`cloudpickle.dumps` gives them, file names kept.

    Raises:
        pickle.PicklingError, TypeError: ``obj`` (or something it holds) cannot be pickled.
    """
    with io.BytesIO() as buf:
        dump(obj, buf, protocol)
        return buf.getvalue()


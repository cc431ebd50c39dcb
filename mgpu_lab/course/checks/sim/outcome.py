"""What a check process makes of one call of the learner's code: its outcome as plain data, and in words.

An outcome is ``("ok", value)`` or ``("raised", type name, message)``, the message
cut at :data:`CUT` characters. NotImplementedError is never an outcome: it goes
through, and the check says "not attempted".

Example:
    >>> outcome(int, "7"), in_words(outcome(int, "7"))
    (('ok', 7), 'returned 7')
    >>> said = outcome(int, "x")
    >>> said
    ('raised', 'ValueError', "invalid literal for int() with base 10: 'x'")
    >>> in_words(said)
    "raised ValueError: invalid literal for int() with base 10: 'x'"
    >>> in_words(said, raised="your code raised ")
    "your code raised ValueError: invalid literal for int() with base 10: 'x'"
"""
from __future__ import annotations


CUT = 300  # characters of an exception's message kept in an outcome


def outcome(fn, *args, **kwargs) -> tuple:
    """``("ok", fn(*args, **kwargs))`` or ``("raised", type name, message)``; NotImplementedError goes through."""
    try:
        return ("ok", fn(*args, **kwargs))
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001 - the check judges the exception
        return raised_outcome(exc)


def raised_outcome(exc: BaseException) -> tuple:
    """``("raised", type name, message)`` of an exception that was caught (the message cut at :data:`CUT`)."""
    return ("raised", type(exc).__name__, str(exc)[:CUT])


def outcomes(fn, calls, keep=None) -> list:
    """The outcome of ``keep(fn(*args))`` (``fn(*args)`` without ``keep``) for every args tuple in ``calls``.

    ``keep`` turns a value into what travels back to the check (plain data); what it
    raises on a strange value is that call's outcome too.

    Example:
        >>> outcomes(int, [("7",), ("x",)], keep=float)
        [('ok', 7.0), ('raised', 'ValueError', "invalid literal for int() with base 10: 'x'")]
    """
    call = fn if keep is None else (lambda *args: keep(fn(*args)))
    return [outcome(call, *args) for args in calls]


def in_words(result, raised: str = "raised ") -> str:
    """An outcome in words: ``returned 7``, or ``raised`` (or the given prefix) ``ValueError: message``."""
    if result[0] == "raised":
        return f"{raised}{result[1]}: {result[2]}"
    return f"returned {result[1]!r}"


def one_thread() -> None:
    """Tiny tensors gain nothing from intra-op threads, and on a loaded machine the threads cost
    several times the work (measured: 0.6 s against 0.12 s for train_step's runs on 2 busy cores)."""
    import torch  # here: the kernel imports outcomes through the checks' framework without needing torch

    torch.set_num_threads(1)

"""What a check process makes of one call of the learner's code: its outcome as plain data.
"""
from __future__ import annotations

import torch


def outcome(fn, *args):
    """``("ok", value)`` or ``("raised", type name, message)``; NotImplementedError goes through."""
    try:
        return ("ok", fn(*args))
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001 - the check judges the exception
        return ("raised", type(exc).__name__, str(exc)[:300])


def one_thread() -> None:
    """Tiny tensors gain nothing from intra-op threads, and on a loaded machine the threads cost
    several times the work (measured: 0.6 s against 0.12 s for train_step's runs on 2 busy cores)."""
    torch.set_num_threads(1)

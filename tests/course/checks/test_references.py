"""Tripwires on reference implementations (mgpu_lab.course.checks._references), in this process."""
from __future__ import annotations

import sys
import threading
import types

import pytest

from mgpu_lab.course.checks import _references as refs
from mgpu_lab.course.checks._references import ReferenceCalled, allowed, armed, resolve


@pytest.fixture
def module(monkeypatch):
    """A module with a plain function, a closure, a class and a method, importable as `refmod`."""
    mod = types.ModuleType("refmod")
    exec(
        "def plain(x):\n    return x + 1\n"
        "def make():\n    k = 10\n    def inner(x):\n        return x + k\n    return inner\n"
        "closure = make()\n"
        "class Opt:\n    def __init__(self, lr):\n        self.lr = lr\n    def step(self):\n        return self.lr\n",
        mod.__dict__)
    monkeypatch.setitem(sys.modules, "refmod", mod)
    return mod


def test_every_alias_of_an_armed_function_raises_and_all_comes_back_after(module):
    alias = module.plain  # as `from refmod import plain as alias` would bind it
    with armed(["refmod:plain", "refmod:closure", "refmod:Opt", "refmod:Opt.step"]):
        for call in (lambda: alias(1), lambda: module.closure(1), lambda: module.Opt(0.1)):
            with pytest.raises(ReferenceCalled, match="your code calls refmod"):
                call()
        opt = object.__new__(module.Opt)
        with pytest.raises(ReferenceCalled, match="refmod.Opt.step"):
            opt.step()
    assert alias(1) == 2 and module.closure(1) == 11 and module.Opt(0.5).step() == 0.5


def test_a_caught_call_is_still_on_record_and_a_thread_cannot_slip_through(module):
    before = len(refs.calls())
    seen = []

    def in_a_thread():
        try:
            module.plain(1)
        except ReferenceCalled as exc:
            seen.append(str(exc))

    with armed(["refmod:plain"]):
        try:
            module.plain(1)
        except ReferenceCalled:
            pass  # an answer that swallows the error is still caught: calls() keeps it
        thread = threading.Thread(target=in_a_thread)
        thread.start()
        thread.join()
    assert refs.calls()[before:] == ["refmod:plain", "refmod:plain"] and len(seen) == 1


def test_allowed_lifts_the_tripwires_for_the_checker_s_own_use(module):
    with armed(["refmod:plain"]):
        with allowed():
            assert module.plain(1) == 2
        with pytest.raises(ReferenceCalled):
            module.plain(1)
    assert module.plain(1) == 2


def test_names_that_are_no_python_function_are_refused_with_the_form_to_use(module):
    with pytest.raises(ValueError, match="must look like 'package.module:function'"):
        resolve("refmod.plain")
    with pytest.raises(ValueError, match="no Python function"):
        resolve("builtins:len")
    with pytest.raises(AttributeError):
        resolve("refmod:missing")

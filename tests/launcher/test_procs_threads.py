"""Ranks started and closed from several threads at once (checks that judge answers in threads do).

Debian 12's Python 3.11.2 walks multiprocessing's list of children in ``Process.start()`` with
``p._popen.poll()``, while ``Process.close()`` in another thread sets ``_popen`` to None: the start then
fails with "'NoneType' object has no attribute 'poll'" (a CI run's lesson 12 mutant stopped with it). The
walk is replaced here by that old one, slowed so the race is met every time; rank processes must not meet it.
"""
import multiprocessing.process as mp_process
from multiprocessing.connection import wait
import threading
import time

from mgpu_lab.launcher import procs


def _racy_cleanup():  # Python 3.11.2's multiprocessing.process._cleanup, with time for another thread to close
    for p in list(mp_process._children):
        time.sleep(0.02)
        if p._popen.poll() is not None:
            mp_process._children.discard(p)


def _noop():
    pass


def test_ranks_started_in_one_thread_and_closed_in_another_do_not_race(monkeypatch):
    monkeypatch.setattr(mp_process, "_cleanup", _racy_cleanup)
    finished = [procs.start(_noop, (), name=f"done {i}") for i in range(3)]
    wait([p.sentinel for p in finished], 30)  # ended, and (not joined) still in multiprocessing's list of children
    while not all(p._popen.poll() is not None for p in finished):
        time.sleep(0.05)
    errors, started = [], []

    def closer():
        try:
            for p in finished:
                time.sleep(0.01)
                p.close()
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    def starter():
        try:
            for i in range(3):
                started.append(procs.start(_noop, (), name=f"new {i}"))
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=closer), threading.Thread(target=starter)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for p in started:
        p.join(30)
    assert not errors, errors
    assert [p.exitcode for p in started] == [0, 0, 0]

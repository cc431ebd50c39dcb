"""mgpu_lab.failures.hangs and .desync: first_desync, the flight recorder's logs of a real hang, DETAIL, py-spy."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from mgpu_lab import launch
from mgpu_lab.failures import hangs
from mgpu_lab.failures.desync import first_desync

pytestmark = pytest.mark.timeout(120)
AR3, AR4, BAR = ("all_reduce", (3,)), ("all_reduce", (4,)), ("barrier", ())


@pytest.mark.parametrize("logs,expected", [
    ([], None),
    ([[AR3, BAR], [AR3, BAR]], None),
    ([[AR3], [AR4], [AR3]], (0, [1])),
    ([[AR3], [AR4]], (0, [1])),                          # a tie: rank 0's call
    ([[AR4], [AR3], [AR3], [AR4]], (0, [1, 2])),         # 2 against 2: rank 0's side wins
    ([[AR3, AR3], [AR3], [AR3, AR3]], (1, [1])),         # an ended log differs
    ([[AR3], [AR3, BAR]], (1, [0])),                     # the only remaining call is the majority
])
def test_first_desync(logs, expected):
    assert first_desync(logs) == expected


def _skip_second_all_reduce():
    hangs.init(timeout=1, flight_recorder=32)
    try:
        dist.all_reduce(torch.ones(3))
        if dist.get_rank() == 0:
            dist.all_reduce(torch.ones(1))
        dist.barrier()
    except RuntimeError as err:
        return hangs.collective_log(), str(err)
    return hangs.collective_log(), ""


def test_the_flight_recorder_logs_a_real_hang_and_first_desync_finds_it():
    (log0, err0), (log1, err1) = launch(_skip_second_all_reduce, 2, init=False, timeout=60)
    assert log0 == [("all_reduce", (3,)), ("all_reduce", (1,))]
    assert log1 == [("all_reduce", (3,)), ("barrier", ())]
    # the first rank to time out leaves; the other may see that ("Connection closed by peer") before its own timeout
    assert err0 and err1 and "Timed out" in err0 + err1, (err0, err1)
    assert first_desync([log0, log1]) == (1, [1])


def _mismatch():
    hangs.init(timeout=5, debug="DETAIL")
    try:
        dist.all_reduce(torch.ones(3 + dist.get_rank()))
    except RuntimeError as err:
        return str(err)
    return "no error"


def test_detail_turns_a_shape_mismatch_into_an_error_naming_both_shapes():
    text = launch(_mismatch, 2, init=False, timeout=60)[0]
    assert "Detected mismatch between collectives" in text
    assert "TensorShape=[3]" in text and "TensorShape=[4]" in text


def test_init_refuses_an_unknown_debug_level():
    with pytest.raises(ValueError, match="'OFF', 'INFO' or 'DETAIL'"):
        hangs.init(debug="VERBOSE")


def test_py_spy_dumps_a_live_process_or_says_how_to_install_it(monkeypatch):
    if hangs.py_spy_path() is not None:
        proc = subprocess.Popen([sys.executable, "-c", "import time\ndef stuck_here():\n    time.sleep(60)\nstuck_here()"])
        try:
            import time

            time.sleep(0.5)
            assert "stuck_here" in hangs.py_spy(proc.pid)
        finally:
            proc.kill()
            proc.wait()
    monkeypatch.setattr(hangs, "py_spy_path", lambda: None)
    with pytest.raises(RuntimeError, match="pip install py-spy"):
        hangs.py_spy(1)

"""Careless uses of launch: each gets a clear error (what, the values, the fix) or the right result.

How a rank's ``sys.exit`` is read, numbers of any integral type, absurd timeouts,
a bad ``init``, ``init_process_group`` called twice, a bad ``MGPU_LAB_TIMEOUT``, a
deleted working directory, and the start method that importing must leave alone.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch.distributed as dist

from mgpu_lab import launch
from mgpu_lab.launcher.launch import MAX_TIMEOUT, LaunchError

pytestmark = pytest.mark.timeout(180)


def _returns_rank():
    return dist.get_rank()


# -- sys.exit in a rank -----------------------------------------------------------------
def _rank1_exits(code):
    if dist.get_rank() == 1:
        sys.exit(code)
    return dist.get_rank()


@pytest.mark.parametrize("code", [3, 255])
def test_sys_exit_with_a_code_is_reported_with_that_exit_code(code):
    with pytest.raises(LaunchError) as info:
        launch(_rank1_exits, 2, code, timeout=60)
    err = info.value
    assert err.rank == 1 and err.exitcode == code
    assert str(err).startswith(f"rank 1/2 called sys.exit({code}) (exit code {code})"), str(err)
    assert err.exc_type == "SystemExit"


def test_sys_exit_with_a_message_is_exit_code_1_and_shows_the_message():
    with pytest.raises(LaunchError) as info:
        launch(_rank1_exits, 2, "no data for this rank", timeout=60)
    assert info.value.exitcode == 1
    assert str(info.value).startswith("rank 1/2 called sys.exit('no data for this rank') (exit code 1)")


@pytest.mark.parametrize("code", [0, None])
def test_sys_exit_0_is_a_rank_that_finished_and_its_result_is_none(code):
    assert launch(_rank1_exits, 2, code, timeout=60) == [0, None]


def _all_leave_with_os_exit_0():
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # as scripts/ddp_train.py ends under torchrun


def test_ranks_that_end_with_exit_code_0_without_returning_finished():
    assert launch(_all_leave_with_os_exit_0, 2, timeout=60) == [None, None]


# -- numbers ---------------------------------------------------------------------------
def test_numpy_integers_are_accepted_for_nprocs_and_timeout():
    assert launch(_returns_rank, np.int64(2), timeout=np.int64(60)) == [0, 1]
    assert launch(_returns_rank, np.int32(1), timeout=np.float32(30.5)) == [0]


@pytest.mark.parametrize("timeout", [float("inf"), 1e17, MAX_TIMEOUT + 1, float("nan"), -5, 0])
def test_timeouts_that_are_not_a_usable_number_of_seconds_name_the_value_and_the_limit(timeout):
    with pytest.raises(ValueError) as info:
        launch(_returns_rank, 1, timeout=timeout)
    msg = str(info.value)
    assert f"timeout={timeout!r}" in msg and f"{MAX_TIMEOUT:g}" in msg and "e.g. timeout=" in msg, msg


def test_the_longest_timeout_allowed_works():
    assert launch(_returns_rank, 1, timeout=MAX_TIMEOUT) == [0]


@pytest.mark.parametrize("timeout", ["60", True, None])
def test_a_timeout_that_is_not_a_number_is_a_type_error(timeout):
    with pytest.raises(TypeError, match=rf"timeout={timeout!r}.*number of seconds"):
        launch(_returns_rank, 1, timeout=timeout)


@pytest.mark.parametrize("init", ["no", 1, None])
def test_init_must_be_true_or_false(init):
    with pytest.raises(TypeError) as info:
        launch(_returns_rank, 1, init=init)
    msg = str(info.value)
    assert f"init={init!r}" in msg and "init=True" in msg and "init=False" in msg, msg


# -- init_process_group inside fn ----------------------------------------------------------
def _initialises_again():
    dist.init_process_group("gloo")
    return dist.get_rank()


def test_init_process_group_in_fn_without_init_false_says_what_to_change():
    with pytest.raises(LaunchError) as info:
        launch(_initialises_again, 2, timeout=60)
    msg = str(info.value)
    assert "initialize the default process group twice" in msg  # torch's own words stay
    assert "launch already initialised the process group" in msg and "init=False" in msg, msg
    assert launch(_initialises_again, 2, init=False, timeout=60) == [0, 1]  # the fix works


# -- the environment -------------------------------------------------------------------
@pytest.mark.parametrize("value", ["abc", "-5", "inf"])
def test_a_bad_mgpu_lab_timeout_names_the_variable_its_value_and_the_fix(value):
    env = {**os.environ, "MGPU_LAB_TIMEOUT": value, "MGPU_LAB_PREWARM": "0"}
    proc = subprocess.run([sys.executable, "-c", "from mgpu_lab import launch; launch"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError: MGPU_LAB_TIMEOUT=") and repr(value) in last, proc.stderr
    assert "unset it" in last, last


def test_a_deleted_working_directory_is_named_with_the_fix(tmp_path, monkeypatch):
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    with pytest.raises(RuntimeError) as info:
        launch(_returns_rank, 2)
    msg = str(info.value)
    assert str(gone) in msg and "no longer exists" in msg and "os.chdir(" in msg, msg


START_METHOD = textwrap.dedent("""
    import multiprocessing as mp
    from mgpu_lab import launch
    assert mp.get_start_method(allow_none=True) is None, "importing launch fixed the start method"
    assert launch(lambda: 1, 1) == [1]
    assert mp.get_start_method(allow_none=True) is None, "a launch fixed the start method"
    mp.set_start_method("spawn")
    print(launch(lambda: mp.get_start_method(), 1))
""")


def test_importing_and_launching_leave_the_start_method_to_the_learner():
    proc = subprocess.run([sys.executable, "-c", START_METHOD], capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "['spawn']"  # the ranks' workers follow the caller

"""The one process environment (mgpu_lab.core.procenv): rank variables in, and out for children."""
from __future__ import annotations

import doctest
import os
import subprocess
import sys

from mgpu_lab import launch
from mgpu_lab.core import procenv

INSIDE_RANK = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
               "ROLE_RANK": "1", "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29500", "MGPU_LAB_IN_RANK": "1",
               "MGPU_LAB_BACKEND": "gloo", "MGPU_LAB_DEVICE": "cpu", "TORCHELASTIC_RUN_ID": "abc",
               "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_ERROR_FILE": "/tmp/err.json",
               "PATH": "/usr/bin", "HOME": "/home/x", "OMP_NUM_THREADS": "4", "PYTHONPATH": "/elsewhere"}


def test_a_child_of_a_rank_does_not_look_like_one():
    env = procenv.child_env(base=INSIDE_RANK)
    assert not set(env) & (set(procenv.RANK_VARS) | set(procenv.LAUNCHER_VARS))
    assert not [k for k in env if k.startswith("TORCHELASTIC_")]
    assert env["PATH"] == "/usr/bin" and env["HOME"] == "/home/x" and env["PYTHONUNBUFFERED"] == "1"
    assert env["OMP_NUM_THREADS"] == "4"  # the caller's choice stays
    assert env["PYTHONPATH"].split(os.pathsep) == [procenv.package_root(), "/elsewhere"]


def test_extra_sets_last_and_none_removes():
    env = procenv.child_env({"OMP_NUM_THREADS": 1, "HOME": None, "LOGLEVEL": "INFO"}, base=INSIDE_RANK,
                            python_first=True)
    assert env["OMP_NUM_THREADS"] == "1" and "HOME" not in env and env["LOGLEVEL"] == "INFO"
    assert env["PATH"].split(os.pathsep)[0] == os.path.dirname(sys.executable)
    assert procenv.child_env(base={})["OMP_NUM_THREADS"] == "1"


def test_the_package_is_importable_in_a_child_started_anywhere(tmp_path):
    code = "import mgpu_lab, os; print(mgpu_lab.__file__, os.environ.get('RANK'))"
    out = subprocess.run([sys.executable, "-c", code],
                         env=procenv.child_env({"RANK": None}), cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [os.path.join(procenv.package_root(), "mgpu_lab", "__init__.py"), "None"]


def _env_in_rank():
    return {k: os.environ.get(k) for k in procenv.RANK_VARS}


def test_launch_gives_its_ranks_torchruns_variables_from_rank_env():
    got = launch(_env_in_rank, 2)
    for rank, env in enumerate(got):
        expected = procenv.rank_env(rank, 2, "127.0.0.1", int(env["MASTER_PORT"]))
        assert {k: v for k, v in env.items() if v is not None} == expected


def test_rank_env_on_a_second_node():
    env = procenv.rank_env(5, 8, "node0", 29400, local_rank=1, local_world_size=4, node_rank=1)
    assert (env["RANK"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"], env["GROUP_RANK"]) == ("5", "1", "4", "1")


def test_a_private_tmpdir_is_gone_afterwards_with_what_it_held():
    with procenv.private_tmpdir("t-") as tmp:
        open(os.path.join(tmp, "torchelastic_x"), "w").close()
        assert os.path.basename(tmp).startswith("t-")
    assert not os.path.exists(tmp)


def test_the_docstring_examples_are_true():
    failed, tried = doctest.testmod(procenv)
    assert tried >= 3 and failed == 0

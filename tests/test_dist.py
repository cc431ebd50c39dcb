"""mgpu_lab.dist: one source of rank information, under launch and under torchrun."""
from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mgpu_lab import dist as mdist
from mgpu_lab import launch
from mgpu_lab.core import procenv

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
VARS = procenv.RANK_VARS + procenv.LAUNCHER_VARS  # what says "you are a rank", cleared for these tests


@pytest.fixture
def clean_env(monkeypatch):
    for name in VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_outside_any_launcher_this_process_is_rank_0_of_1(clean_env):
    assert mdist.info() == mdist.RankInfo(0, 0, 1, 1, 0)
    assert mdist.is_main_process()


def test_reads_the_torchrun_variables(clean_env):
    for k, v in dict(RANK="5", LOCAL_RANK="1", WORLD_SIZE="8", LOCAL_WORLD_SIZE="4", GROUP_RANK="1").items():
        clean_env.setenv(k, v)
    assert mdist.info() == mdist.RankInfo(5, 1, 8, 4, 1)
    assert (mdist.rank(), mdist.local_rank(), mdist.world_size(), mdist.local_world_size()) == (5, 1, 8, 4)
    assert not mdist.is_main_process()


@pytest.mark.parametrize("env,match", [
    ({"RANK": "x"}, r"RANK='x' is not an integer"),
    ({"RANK": "4", "WORLD_SIZE": "4"}, r"RANK=4 with WORLD_SIZE=4"),
    ({"WORLD_SIZE": "2", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, r"LOCAL_RANK=2 with LOCAL_WORLD_SIZE=2"),
    ({"WORLD_SIZE": "-1"}, r"WORLD_SIZE=-1 must be >= 0"),
])
def test_malformed_variables_name_the_variable(clean_env, env, match):
    for k, v in env.items():
        clean_env.setenv(k, v)
    with pytest.raises(ValueError, match=match):
        mdist.info()


def test_choose_backend_and_devices():
    assert mdist.choose(4, gpus=0) == ("gloo", ["cpu"] * 4)
    assert mdist.choose(2, gpus=1) == ("gloo", ["cuda:0", "cuda:0"])
    assert mdist.choose(3, gpus=2) == ("gloo", ["cuda:0", "cuda:1", "cuda:0"])
    assert mdist.choose(2, "gloo", gpus=4) == ("gloo", ["cuda:0", "cuda:1"])
    if mdist._nccl_available():
        assert mdist.choose(2, gpus=4) == ("nccl", ["cuda:0", "cuda:1"])


def test_nccl_without_a_gpu_per_rank_is_an_error_with_the_fix():
    with pytest.raises(ValueError, match=r"nprocs=3 but 2 CUDA GPU\(s\) are visible; use backend='gloo' or nprocs<=2"):
        mdist.choose(3, "nccl", gpus=2)
    with pytest.raises(ValueError, match=r"nprocs=2 but 0 CUDA GPU.*run on a machine with 2 GPUs"):
        mdist.choose(2, "nccl", gpus=0)


def test_setup_without_master_variables_says_how_to_start(clean_env):
    clean_env.delenv("MASTER_ADDR", raising=False)
    clean_env.delenv("MASTER_PORT", raising=False)
    with pytest.raises(ValueError, match="MASTER_ADDR is not set; start this script with torchrun"):
        mdist.setup()


def _info_in_rank():
    return mdist.info(), str(mdist.device()), mdist.is_main_process()


def test_the_same_helpers_inside_launched_ranks():
    results = launch(_info_in_rank, 2)
    assert results == [
        (mdist.RankInfo(0, 0, 2, 2, 0), "cpu", True),
        (mdist.RankInfo(1, 1, 2, 2, 0), "cpu", False),
    ]


def test_the_same_helpers_under_real_torchrun(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import torch, torch.distributed as dist
        from mgpu_lab import dist as mdist
        dev = mdist.setup()
        t = torch.ones(1, device=dev)
        dist.all_reduce(t)
        i = mdist.info()
        print(f"RESULT {i.rank} {i.local_rank} {i.world_size} {i.local_world_size} {dev} {t.item()}", flush=True)
        mdist.print0("only once")
        mdist.teardown()
        import os, sys
        sys.stdout.flush()
        os._exit(0)  # as scripts/ddp_train.py: skip the C++ teardown that can abort at exit
    """))
    proc = subprocess.run([TORCHRUN, "--standalone", "--nproc-per-node=2", str(script)], capture_output=True,
                          text=True, timeout=180,
                          env=procenv.child_env({"TMPDIR": str(tmp_path)}))  # TMPDIR: torchrun's log folder
    assert proc.returncode == 0, proc.stderr
    # The two ranks share one pipe: a line of one can land inside a line of the other.
    results = sorted(re.findall(r"RESULT \d \d \d \d \S+ [\d.]+", proc.stdout))
    dev = "cpu" if mdist._cuda_count() == 0 else None
    if dev:
        assert results == ["RESULT 0 0 2 2 cpu 2.0", "RESULT 1 1 2 2 cpu 2.0"]
    assert proc.stdout.count("only once") == 1


def test_leave_flushes_what_was_written_and_exits_with_the_code_skipping_exit_handlers():
    code = textwrap.dedent("""
        import atexit, sys
        from mgpu_lab import dist
        atexit.register(lambda: print("atexit ran"))
        print("trained", end="")
        sys.stderr.write("warned")
        dist.leave(3)
        print("after leave")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout, proc.stderr) == (3, "trained", "warned")

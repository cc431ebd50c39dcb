"""mgpu_lab.launch for real: every test starts real rank processes (gloo on the CPU)."""
from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest
import torch
import torch.distributed as dist
from leftovers import open_fds, opened_since

from mgpu_lab import launch
from mgpu_lab.launcher.launch import LaunchError, LaunchTimeout, banner

pytestmark = pytest.mark.timeout(120)


def _descendants() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


# -- functions the ranks run (module level: shipped by reference) ----------
def _env_and_sum(offset):
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return {
        "env": {k: os.environ.get(k) for k in keys},
        "backend": dist.get_backend(),
        "world": dist.get_world_size(),
        "sum": t.item() + offset,
        "pid": os.getpid(),
    }


def _not_initialised():
    from mgpu_lab import dist as mdist

    before = dist.is_initialized()
    dev = mdist.setup()  # the torchrun code path: env:// from the variables launch set
    t = torch.ones(1)
    dist.all_reduce(t)
    mdist.teardown()
    return before, str(dev), t.item()


def _talk():
    print(f"out from {dist.get_rank()}")
    import sys

    print(f"err from {dist.get_rank()}", file=sys.stderr)
    print("no newline at the end", end="")
    return None


def _rank1_raises():
    if dist.get_rank() == 1:
        raise ValueError("boom in rank one")
    dist.barrier()  # the others wait for rank 1 forever: the launcher must stop them


def _rank1_dies(how):
    if dist.get_rank() == 1:
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif how == "exit":
            os._exit(3)
        elif how == "segfault":
            import ctypes

            ctypes.string_at(0)
    dist.barrier()


def _mismatched_collectives():
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins this all_reduce
    else:
        time.sleep(1000)


def _sleep_and_record(path):
    with open(f"{path}.{dist.get_rank()}", "w") as f:
        f.write(str(os.getpid()))
    time.sleep(1000)


def _unpicklable_return():
    return threading.Lock()


def _not_implemented():
    raise NotImplementedError("write shard_indices")


def _returns_rank():
    return dist.get_rank()


# -- the happy path --------------------------------------------------------
def test_results_in_rank_order_with_torchrun_variables_and_process_group():
    results = launch(_env_and_sum, 3, 10)
    assert [r["env"]["RANK"] for r in results] == ["0", "1", "2"]
    assert {r["env"]["WORLD_SIZE"] for r in results} == {"3"}
    assert {r["env"]["LOCAL_WORLD_SIZE"] for r in results} == {"3"}
    assert [r["env"]["LOCAL_RANK"] for r in results] == ["0", "1", "2"]
    assert {r["env"]["MASTER_ADDR"] for r in results} == {"127.0.0.1"}
    ports = {r["env"]["MASTER_PORT"] for r in results}
    assert len(ports) == 1 and 0 < int(ports.pop()) < 65536
    assert {r["backend"] for r in results} == {"gloo"}
    assert {r["world"] for r in results} == {3}
    assert [r["sum"] for r in results] == [13.0, 13.0, 13.0]  # 0+1+2 all-reduced, plus 10
    assert len({r["pid"] for r in results}) == 3 and os.getpid() not in {r["pid"] for r in results}


def test_kwargs_go_to_fn_and_lambdas_travel_by_value():
    scale = 7
    assert launch(lambda a, b=0: dist.get_rank() * scale + a + b, 2, 1, b=100) == [101, 108]


def test_init_false_leaves_the_process_group_to_the_rank_code():
    results = launch(_not_initialised, 2, init=False)
    assert results == [(False, "cpu", 2.0), (False, "cpu", 2.0)]


def test_output_of_every_rank_is_relayed_with_a_prefix(capsys):
    launch(_talk, 2)
    out, err = capsys.readouterr()
    assert out.splitlines()[0].startswith("launch: 2 ranks · gloo · cpu")
    for r in (0, 1):
        assert f"[rank {r}/2] out from {r}" in out.splitlines()
        assert f"[rank {r}/2] err from {r}" in err.splitlines()
        assert f"[rank {r}/2] no newline at the end" in out.splitlines()


def test_banner_says_what_runs_where():
    assert banner(4, "gloo", ["cpu"] * 4).startswith("launch: 4 ranks · gloo · cpu (no CUDA GPU visible")
    assert banner(2, "nccl", ["cuda:0", "cuda:1"]) == "launch: 2 ranks · nccl · cuda:0..1, one GPU per rank"
    shared = banner(3, "gloo", ["cuda:0"] * 3)
    assert "cuda:0 shared by 3 ranks" in shared
    assert "init=False" in banner(1, "gloo", ["cpu"], init=False)


def _numpy_draw():
    import numpy as np

    return float(np.random.rand())


def test_numpy_is_seeded_afresh_in_every_rank_as_in_a_new_process():
    first, second = launch(_numpy_draw, 2), launch(_numpy_draw, 2)
    assert len(set(first + second)) == 4  # no two ranks, and no two launches, draw alike


# -- failures --------------------------------------------------------------
def test_a_rank_that_raises_stops_the_others_and_reports_its_traceback():
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(_rank1_raises, 3, timeout=60)
    # stopped, not left to the 60 s timeout (a tighter wall-clock bound fails by chance under load)
    assert time.monotonic() - start < 60
    err = info.value
    assert err.rank == 1 and err.exc_type == "ValueError"
    assert isinstance(err.exception, ValueError)
    msg = str(err)
    assert msg.startswith("rank 1/3 raised ValueError: boom in rank one")
    assert "Traceback of rank 1/3" in msg and "_rank1_raises" in msg
    assert 'raise ValueError("boom in rank one")' in msg  # source line rendered


@pytest.mark.parametrize("how,code", [("kill", -9), ("exit", 3), ("segfault", -11)])
def test_a_rank_that_dies_without_raising_is_reported_with_its_exit_code(how, code, capsys):
    with pytest.raises(LaunchError) as info:
        launch(_rank1_dies, 2, how, timeout=60)
    assert info.value.rank == 1 and info.value.exitcode == code
    assert str(info.value).startswith(f"rank 1/2 died without raising (exit code {code}")
    if how == "segfault":
        assert "Fatal Python error: Segmentation fault" in capsys.readouterr().err


def test_a_hang_is_stopped_after_the_timeout_with_every_ranks_stack():
    start = time.monotonic()
    with pytest.raises(LaunchTimeout) as info:
        launch(_mismatched_collectives, 2, timeout=3)
    assert time.monotonic() - start >= 3  # not before the timeout (the test's own timeout bounds the rest)
    msg = str(info.value)
    assert "timed out after 3 s" in msg and "mismatched collectives" in msg
    assert set(info.value.stacks) == {0, 1}
    assert "_mismatched_collectives" in info.value.stacks[0]
    assert "all_reduce" in info.value.stacks[0]
    assert "time.sleep(1000)" in info.value.stacks[1] or "_mismatched_collectives" in info.value.stacks[1]
    assert "[rank 1/2]" in msg
    assert "rank_main" not in msg and "multiprocessing" not in msg  # only the learner's frames


def test_keyboard_interrupt_stops_every_rank(tmp_path, python_sigint):
    base = str(tmp_path / "pid")
    files = [f"{base}.{r}" for r in (0, 1)]
    stop = threading.Event()

    def interrupt_once_both_run():  # not after a fixed delay: on a loaded machine start-up takes longer
        while not all(os.path.exists(f) and os.path.getsize(f) for f in files):
            if stop.wait(0.05):
                return
        os.kill(os.getpid(), signal.SIGINT)

    thread = threading.Thread(target=interrupt_once_both_run, daemon=True)
    thread.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            launch(_sleep_and_record, 2, base, timeout=100)
    finally:
        stop.set()
    pids = [int(open(f).read()) for f in files]
    for pid in pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_not_implemented_in_a_rank_keeps_its_type():
    with pytest.raises(LaunchError) as info:
        launch(_not_implemented, 1)
    assert info.value.exc_type == "NotImplementedError"
    assert isinstance(info.value.exception, NotImplementedError)


# -- bad input ---------------------------------------------------------------
@pytest.mark.parametrize("nprocs", [0, -2])
def test_nprocs_must_be_positive(nprocs):
    with pytest.raises(ValueError, match=f"nprocs={nprocs}.*e.g. nprocs=2"):
        launch(_returns_rank, nprocs)


@pytest.mark.parametrize("nprocs", ["2", 2.0, True])
def test_nprocs_must_be_an_int(nprocs):
    with pytest.raises(TypeError, match="nprocs must be an int"):
        launch(_returns_rank, nprocs)


def test_timeout_must_be_positive():
    with pytest.raises(ValueError, match="timeout=0"):
        launch(_returns_rank, 1, timeout=0)


def test_fn_must_be_callable():
    with pytest.raises(TypeError, match="needs a function"):
        launch("not a function", 1)


@pytest.mark.skipif(torch.cuda.device_count() >= 4, reason="needs fewer than 4 visible GPUs")
def test_nccl_without_enough_gpus_names_the_counts_and_the_fix():
    gpus = torch.cuda.device_count()
    with pytest.raises(ValueError) as info:
        launch(_returns_rank, 4, backend="nccl")
    msg = str(info.value)
    assert f"nprocs=4 but {gpus} CUDA GPU(s) are visible" in msg and "backend='gloo'" in msg


def test_unknown_backend_lists_the_choices():
    with pytest.raises(ValueError, match="backend='mpi' is not supported.*'nccl'.*'gloo'"):
        launch(_returns_rank, 1, backend="mpi")


def test_unpicklable_argument_is_a_clear_error_before_any_process_starts():
    before = _descendants()
    with pytest.raises(TypeError, match="could not send .* pickled with cloudpickle"):
        launch(_returns_rank, 2, (x for x in range(3)))
    assert _descendants() == before


def test_unpicklable_return_value_names_the_rank_and_the_type():
    with pytest.raises(LaunchError, match="rank 0/1 raised TypeError: rank 0 returned a value of type lock"):
        launch(_unpicklable_return, 1)


# -- nothing left behind -------------------------------------------------------
def test_the_fd_comparison_sees_a_leaked_pipe_and_not_one_closed_meanwhile():
    earlier = os.pipe()
    fds = open_fds()
    os.close(earlier[0])  # closed meanwhile by something else: no leak of this test's
    os.close(earlier[1])
    leaked = os.pipe()
    try:
        assert set(opened_since(fds)) == set(leaked)
    finally:
        os.close(leaked[0])
        os.close(leaked[1])
    assert opened_since(fds) == {}


def test_no_process_or_fd_left_behind_after_success_and_failures():
    listening_before = _listening()  # another test's socket is not this test's business
    launch(_returns_rank, 2)  # the forkserver is running from here on
    procs, fds = _descendants(), open_fds()
    for _ in range(5):
        assert launch(_returns_rank, 2) == [0, 1]
        with pytest.raises(LaunchError):
            launch(_rank1_raises, 2)
        with pytest.raises(LaunchError):
            launch(_rank1_dies, 2, "kill")
    with pytest.raises(LaunchTimeout):
        launch(_mismatched_collectives, 2, timeout=2)
    assert _descendants() == procs
    assert opened_since(fds) == {}, "a launch left a file descriptor open"
    assert _listening() == listening_before, "a launch left a socket listening (the rendezvous store?)"


def _listening() -> list:
    return sorted((c.fd, c.laddr) for c in psutil.Process().net_connections("tcp") if c.status == psutil.CONN_LISTEN)


# -- GPUs ----------------------------------------------------------------------
def _gpu_rank():
    from mgpu_lab import dist as mdist

    t = torch.ones(1, device=mdist.device())
    dist.all_reduce(t)
    return dist.get_backend(), str(t.device), t.item()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs for one NCCL rank per GPU")
def test_nccl_one_rank_per_gpu():
    n = torch.cuda.device_count()
    results = launch(_gpu_rank, n)
    assert results == [("nccl", f"cuda:{r}", float(n)) for r in range(n)]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a CUDA GPU")
def test_gloo_ranks_share_one_gpu_and_a_kernel_that_touched_cuda_can_launch():
    torch.zeros(1, device="cuda")  # the caller has initialised CUDA: no fork of it may follow
    n = torch.cuda.device_count() + 1
    results = launch(_gpu_rank, n, backend="gloo")
    assert [r[0] for r in results] == ["gloo"] * n
    assert all(r[1].startswith("cuda:") for r in results)


def test_gloo_connection_race_during_init_is_retried_but_other_failures_are_not(monkeypatch, capsys):
    import sys

    L = sys.modules["mgpu_lab.launcher.launch"]  # `import mgpu_lab.launcher.launch as L` gives the function
    calls = []

    def flaky(*args):
        calls.append(1)
        if len(calls) == 1:
            raise LaunchError("rank 1/2 raised RuntimeError: Gloo connectFullMesh failed with ... "
                              "Connection closed by peer", phase="init", exc_type="RuntimeError")
        return [0, 1]

    monkeypatch.setattr(L, "_run", flaky)
    assert launch(_returns_rank, 2) == [0, 1] and len(calls) == 2
    assert "retrying (1/2)" in capsys.readouterr().out

    def user_bug(*args):
        calls.append(1)
        raise LaunchError("rank 0/2 raised RuntimeError: connectFullMesh in user code", phase="fn")

    calls.clear()
    monkeypatch.setattr(L, "_run", user_bug)
    with pytest.raises(LaunchError):
        launch(_returns_rank, 2)
    assert len(calls) == 1


def _start_method():
    import multiprocessing

    return multiprocessing.get_start_method()


def test_ranks_start_their_own_workers_the_way_the_caller_would():
    import multiprocessing

    assert launch(_start_method, 1) == [multiprocessing.get_start_method()]


def _print_then_fail():
    print("about to fail")
    raise RuntimeError("bad")


def test_echo_false_keeps_rank_output_out_of_the_caller_and_on_the_error(capsys):
    from mgpu_lab.launcher.launch import run

    with pytest.raises(LaunchError) as info:
        run(_print_then_fail, 1, quiet=True, echo=False)
    out, err = capsys.readouterr()
    assert "about to fail" not in out + err
    assert "[rank 0/1] about to fail" in info.value.output


def _leave_workers_running():
    from torch.utils.data import DataLoader

    loader = DataLoader(list(range(64)), batch_size=4, num_workers=2, persistent_workers=True)
    it = iter(loader)
    next(it)
    return [w.pid for w in it._workers]


def test_a_ranks_own_children_do_not_outlive_it():
    pids = launch(_leave_workers_running, 1)[0]
    assert len(pids) == 2
    gone = psutil.wait_procs([psutil.Process(p) for p in pids if psutil.pid_exists(p)], timeout=5)[1]
    assert gone == []


FORKED_SERVER = r'''
import json, os, sys
import torch  # what the server should not import again
import psutil
from multiprocessing import forkserver
from mgpu_lab.launcher import procs
r, w = os.pipe()  # a descriptor of this process that the server must not keep
procs.prewarm(fork=True)
server = psutil.Process(forkserver._forkserver._forkserver_pid)
from mgpu_lab import launch
import torch.distributed as dist
ranks = launch(lambda: (dist.get_rank(), dist.all_reduce(t := torch.ones(1)) or t.item(), os.getppid()), 2)
mine = os.readlink(f"/proc/self/fd/{r}")
held = [os.readlink(f"/proc/{server.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{server.pid}/fd")]
print(json.dumps({"me": os.getpid(), "server": server.pid, "parent": server.ppid(), "same_exe": server.cmdline() ==
                  psutil.Process().cmdline(), "ranks": ranks, "holds_pipe": mine in held}))
'''


def test_prewarm_fork_makes_the_server_a_fork_of_this_process_that_keeps_nothing_else_and_ends_with_it():
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", FORKED_SERVER], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["parent"] == got["me"] and got["same_exe"]  # forked from the caller, not a new Python
    assert got["ranks"] == [[0, 2.0, got["server"]], [1, 2.0, got["server"]]]  # ranks forked from it, collectives work
    assert not got["holds_pipe"]  # only the listener and the alive pipe, as a started server
    deadline = time.monotonic() + 10
    while psutil.pid_exists(got["server"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not psutil.pid_exists(got["server"])  # its caller gone, it is gone

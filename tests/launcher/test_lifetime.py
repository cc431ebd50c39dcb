"""What a launch leaves behind: nothing, whatever ends it, and nothing it exposes.

Real ranks on the CPU: the rendezvous store is reachable from this machine only;
the ranks and everything they start die with a SIGKILLed launcher; Ctrl-C at any
point of start-up stops every rank that started and says so truthfully; a rank's
double-forked child (``sleep 100 &`` in a shell) does not escape clean-up.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
import torch.distributed as dist
from leftovers import open_fds, opened_since

from mgpu_lab import launch
from mgpu_lab.launcher.launch import LaunchError

pytestmark = pytest.mark.timeout(240)

SHELL_BACKGROUND = "sleep 100 >/dev/null 2>&1 & echo $!"  # the shell exits; sleep is orphaned


def _alive(pids) -> list[int]:
    """The pids still running (a zombie has ended: only its exit status is left)."""
    left = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                left.append(pid)
        except psutil.NoSuchProcess:
            pass
    return left


def _wait_gone(pids, seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while (left := _alive(pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def _kill(pids) -> None:
    """The test's own clean-up, so that a failing test leaves no process either."""
    for pid in _alive(pids):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _descendants() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


# -- the rendezvous store ------------------------------------------------------------
def _external_addresses() -> list[tuple[int, str]]:
    found = []
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                found.append((socket.AF_INET, a.address))
            elif a.family == socket.AF_INET6 and a.address != "::1" and not a.address.startswith("fe80"):
                found.append((socket.AF_INET6, a.address.split("%")[0]))
    return found


def _probe_store(launcher_pid, addresses):
    port = int(os.environ["MASTER_PORT"])
    listening = [c.laddr.ip for c in psutil.Process(launcher_pid).net_connections("tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
    answers = {}
    for family, address in [(socket.AF_INET, "127.0.0.1"), *addresses]:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            try:
                s.connect((address, port))
                answers[address] = "connected"
            except OSError as exc:
                answers[address] = type(exc).__name__
    return listening, answers


def test_the_rendezvous_store_listens_on_loopback_only():
    addresses = _external_addresses()
    listening, answers = launch(_probe_store, 1, os.getpid(), addresses)[0]
    assert answers.pop("127.0.0.1") == "connected"  # the probe itself works
    assert answers == {a: "ConnectionRefusedError" for _, a in addresses}, f"reached from outside: {answers}"
    assert listening == ["127.0.0.1"], f"the store listens on {listening}, not only on 127.0.0.1"
    if not addresses:
        pytest.skip("this machine has no non-loopback address to try the store from")


# -- a launcher killed with SIGKILL ---------------------------------------------------
KILLED_LAUNCHER = textwrap.dedent("""
    import json, os, subprocess, sys, time
    from mgpu_lab import launch

    def rank(out):
        from torch.utils.data import DataLoader
        import torch.distributed as dist
        loader = DataLoader(list(range(64)), batch_size=4, num_workers=1, persistent_workers=True)
        it = iter(loader)
        next(it)
        sleeper = int(subprocess.run({shell!r}, shell=True, capture_output=True, text=True).stdout)
        child = subprocess.Popen(["sleep", "100"])
        pids = {{"rank": os.getpid(), "worker": it._workers[0].pid, "sleep &": sleeper,
                 "child": child.pid}}
        with open(f"{{out}}/{{dist.get_rank()}}.json", "w") as f:
            json.dump(pids, f)
        time.sleep(1000)

    launch(rank, 2, sys.argv[1], timeout=600)
""").format(shell=SHELL_BACKGROUND)


def test_ranks_and_everything_they_started_die_within_seconds_of_a_sigkilled_launcher(tmp_path):
    launcher = subprocess.Popen([sys.executable, "-c", KILLED_LAUNCHER, str(tmp_path)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pids = set()
    try:
        files = [tmp_path / f"{r}.json" for r in (0, 1)]
        deadline = time.monotonic() + 180
        while not all(f.exists() and f.read_text().endswith("}") for f in files):
            assert launcher.poll() is None, "the launching script died before its ranks were up"
            assert time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.2)
        recorded = [json.loads(f.read_text()) for f in files]
        tree = {p.pid for p in psutil.Process(launcher.pid).children(recursive=True)}
        pids = tree | {pid for r in recorded for pid in r.values()}
        assert len(tree) >= 4  # the forkserver and 2 ranks at least, all below the launcher
        launcher.send_signal(signal.SIGKILL)  # as the out-of-memory killer ends a kernel
        launcher.wait()
        left = _wait_gone(pids, 10)
        described = {pid: " ".join(psutil.Process(pid).cmdline()) for pid in _alive(left)}
        assert not left, f"still running 10 s after the launcher was killed: {described}; recorded {recorded}"
    finally:
        launcher.kill()
        _kill(pids)


# -- a rank's double-forked child -------------------------------------------------------
def _orphan_then(how, out):
    pid = int(subprocess.run(SHELL_BACKGROUND, shell=True, capture_output=True, text=True).stdout)
    with open(f"{out}.{dist.get_rank()}", "w") as f:
        f.write(str(pid))
    if how == "returns":
        return pid
    if how == "dies":
        os._exit(1)
    if dist.get_rank() == 1:  # "stopped": rank 0 waits in a barrier until the launcher stops it
        time.sleep(0.5)
        raise ValueError("rank 1 fails; the launcher stops rank 0")
    dist.barrier()


@pytest.mark.parametrize("how", ["returns", "dies", "stopped"])
def test_a_ranks_double_forked_child_does_not_outlive_the_launch(how, tmp_path):
    out = str(tmp_path / "pid")
    if how == "returns":
        launch(_orphan_then, 2, how, out)
    else:
        with pytest.raises(LaunchError):
            launch(_orphan_then, 2, how, out, timeout=60)
    pids = [int(open(f"{out}.{r}").read()) for r in (0, 1)]
    try:
        assert _wait_gone(pids, 5) == [], f"`{SHELL_BACKGROUND}` in a rank outlived the launch ({how})"
    finally:
        _kill(pids)


# -- Ctrl-C during start-up -------------------------------------------------------------
def _sleep_forever():
    time.sleep(1000)


def _start_up_tracer(interrupt_at, counted):
    """A trace function that sends SIGINT at the ``interrupt_at``-th line run by the launcher's
    start-up (launcher and multiprocessing code, from ``_run`` until the job starts waiting)."""
    state = {"on": False, "n": 0}
    watched = (os.sep + "mgpu_lab" + os.sep + "launcher" + os.sep, os.sep + "multiprocessing" + os.sep)

    def tracer(frame, event, arg):
        code = frame.f_code
        if event == "call":
            if code.co_name == "_run" and code.co_filename.endswith("launch.py"):
                state["on"] = True
            elif code.co_name == "wait" and code.co_filename.endswith("job.py"):
                state["on"] = False
                sys.settrace(None)
                return None
        if not state["on"] or not any(w in code.co_filename for w in watched):
            return tracer
        if event == "line":
            state["n"] += 1
            counted[0] = state["n"]
            if state["n"] == interrupt_at:
                signal.raise_signal(signal.SIGINT)
        return tracer

    return tracer


def _launch_traced(interrupt_at, fn=None) -> int:
    """Launch 2 ranks with SIGINT sent at the given line of start-up; return the lines counted."""
    counted = [0]
    sys.settrace(_start_up_tracer(interrupt_at, counted))
    try:
        launch(fn or _sleep_forever, 2, init=False, timeout=120)
    finally:
        sys.settrace(None)
    return counted[0]


def _stopped_count(text: str) -> int | None:
    """How many ranks the interrupt message says were stopped (None: no message)."""
    if "launch interrupted before any rank started" in text:
        return 0
    m = re.search(r"launch interrupted.*stopped (?:all|the) (\d+) rank", text)
    return int(m.group(1)) if m else None


def test_ctrl_c_at_any_point_of_start_up_stops_every_started_rank_and_says_so(monkeypatch, capsys, python_sigint):
    from mgpu_lab.launcher import procs

    launch(lambda: 0, 1)  # the forkserver and the resource tracker stay; ranks must not
    total = _launch_traced(0, lambda: 0)  # a dry run counts the lines that start-up runs
    assert total > 50, total
    started = []
    original = procs.start

    def recording_start(*args, **kwargs):
        proc = original(*args, **kwargs)
        started.append(proc.pid)
        return proc

    monkeypatch.setattr(procs, "start", recording_start)
    before, fds = _descendants(), open_fds()
    capsys.readouterr()
    leftovers, lies, wrong = {}, {}, {}
    for point in sorted({1, 2, 3, *range(1, total + 1, max(1, total // 40)), total}):
        started.clear()
        try:
            _launch_traced(point)
            wrong[point] = "launch returned"
        except KeyboardInterrupt:
            pass
        except Exception as exc:  # noqa: BLE001 - every point is judged, then all are reported
            wrong[point] = f"{type(exc).__name__}: {exc}"
        text = capsys.readouterr().out
        survivors = _alive(_descendants() - before)
        if survivors:
            leftovers[point] = survivors
            _kill(survivors)
        said = _stopped_count(text)
        if said != len(started) and not (said is None and not started):  # nothing started, nothing to say
            lies[point] = f"{len(started)} rank(s) had started; the launcher said {text.strip()!r}"
    assert not wrong, f"SIGINT at line N of {total} of start-up -> not a KeyboardInterrupt: {wrong}"
    assert not leftovers, f"SIGINT at line N of {total} of start-up -> ranks left running: {leftovers}"
    assert not lies, lies
    assert opened_since(fds) == {}, "a launch left a file descriptor open"

"""The grading sandbox and the grader's distrust: what a process inside gets, and what the grader believes.

The hostile submissions, graded in one batch beside an honest one, are in
tests/course/test_grade_hostile.py; these are the parts, each on its own.
"""
from __future__ import annotations

import io
import json
import os
import shutil
import socket
import subprocess
import sys
import time

import psutil
import pytest
import torch

from mgpu_lab.course.checks import CaseFailed, exercises
from mgpu_lab.course.session import Session, read_manifest
from mgpu_lab.course.runner import unjudgeable
from mgpu_lab.course.sandbox import ENV_KEEP, Limits, Sandbox, _python_paths, protections

pytestmark = pytest.mark.timeout(180)
ROOT = os.geteuid() == 0

INSIDE = r"""
import json, os, resource, socket, sys
out = {"uid": os.getuid(), "cwd": os.getcwd(), "env": sorted(os.environ), "tmp": sorted(os.listdir("/tmp")),
       "as": resource.getrlimit(resource.RLIMIT_AS)[0], "nproc": resource.getrlimit(resource.RLIMIT_NPROC)[0],
       "fsize": resource.getrlimit(resource.RLIMIT_FSIZE)[0], "cpu": resource.getrlimit(resource.RLIMIT_CPU)[0],
       "pid": os.getpid(), "python": sys.version_info[:3]}
s = socket.socket()
s.settimeout(3)
try:
    s.connect((sys.argv[1], int(sys.argv[2])))
    out["net"] = "connected"
except OSError as exc:
    out["net"] = type(exc).__name__
lo = socket.socket()
lo.bind(("127.0.0.1", 0))
lo.listen()
out["loopback"] = socket.create_connection(lo.getsockname(), timeout=3) is not None
try:
    open(sys.argv[3], "a").write("x")
    out["wrote_outside"] = True
except OSError:
    out["wrote_outside"] = False
print(json.dumps(out))
"""


def outside_address() -> str | None:
    """An IPv4 address of this machine that is not loopback (what a submission must not reach)."""
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    return None


@pytest.mark.root
@pytest.mark.skipif(not ROOT, reason="the full sandbox (own user, namespaces) needs root; CI runs as root")
def test_a_process_in_the_sandbox_gets_its_user_directory_environment_limits_and_no_network(
        tmp_path, monkeypatch):
    monkeypatch.setenv("MGPU_LAB_TEST_SECRET", "s3cr3t-value")
    addr = outside_address()
    listener = socket.socket()
    listener.bind((addr or "0.0.0.0", 0))
    listener.listen()
    listener.settimeout(0.5)
    target = tmp_path / "outside.txt"
    target.write_text("")
    os.chmod(tmp_path, 0o777)  # even a folder anyone may write is out of reach: it is not in the sandbox
    limits = Limits(memory=3 << 30, processes=300, file_size=1 << 20, cpu_time=77)
    with Sandbox(limits) as box:
        port = str(listener.getsockname()[1])
        proc = box.start([sys.executable, "-c", INSIDE, addr or "10.255.255.1", port, str(target)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err.decode()
    got = json.loads(out)
    assert got["uid"] == protections().uid != 0
    # /tmp is the submission's own (empty) folder; a Python or project that lived under /tmp is bound back there
    bound = sorted({p.split("/")[2] for p in _python_paths() if p.startswith("/tmp/")})
    assert got["cwd"] == "/tmp" and got["tmp"] == bound and got["pid"] < 10  # its own PID namespace
    assert "MGPU_LAB_TEST_SECRET" not in got["env"]
    assert set(got["env"]) <= set(ENV_KEEP) | {"HOME", "TMPDIR", "USER", "PYTHONNOUSERSITE", "PYTHONDONTWRITEBYTECODE",
                                               "MPLBACKEND", "JUPYTER_PLATFORM_DIRS"}
    assert (got["as"], got["nproc"], got["fsize"], got["cpu"]) == (3 << 30, 300, 1 << 20, 77)
    assert got["net"] in ("OSError", "TimeoutError", "ConnectionRefusedError") and got["loopback"]
    with pytest.raises(socket.timeout):
        listener.accept()
    assert not got["wrote_outside"] and target.read_text() == ""
    assert tuple(got["python"]) == sys.version_info[:3]  # the grader's own Python, though under /root here


HIDDEN = r"""
import json, os, sys
import probe_mod
out = {"value": probe_mod.VALUE, "file": probe_mod.__file__, "secret": os.path.exists(sys.argv[1])}
try:
    open(probe_mod.__file__, "a").write("# changed")
    out["wrote"] = True
except OSError as exc:
    out["wrote"] = type(exc).__name__
print(json.dumps(out))
"""


def _places():
    home = "/home" if os.path.isdir("/home") and os.access("/home", os.W_OK) else "/var/tmp"
    return ["/tmp", "/var/tmp", "/dev/shm", home]


@pytest.mark.skipif(not protections().namespaces,
                    reason="no namespaces here: the sandbox's file system is the grader's")
@pytest.mark.parametrize("place", _places())
def test_what_the_kernel_needs_stays_reachable_and_read_only_wherever_it_lies(place, monkeypatch):
    # A project (here a module on PYTHONPATH, as the sandbox finds the package) in a folder that the
    # sandbox hides: /tmp, /var/tmp and /dev/shm are its own, and a 0700 home folder is closed to others.
    import tempfile

    top = tempfile.mkdtemp(prefix="mgpu-sandbox-test-", dir=place)
    try:
        os.chmod(top, 0o700)  # as a home folder others cannot enter
        project = os.path.join(top, "clone", "src")
        os.makedirs(project)
        with open(os.path.join(project, "probe_mod.py"), "w") as f:
            f.write("VALUE = 42\n")
        secret = os.path.join(top, "secret.txt")
        with open(secret, "w") as f:
            f.write("not for submissions")
        monkeypatch.setenv("PYTHONPATH", project)
        with Sandbox() as box:
            proc = box.start([sys.executable, "-c", HIDDEN, secret], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"the sandbox could not import what lies under {place}: {err.decode()}"
        got = json.loads(out)
        assert got["value"] == 42 and got["file"] == os.path.join(project, "probe_mod.py")
        assert got["wrote"] in ("OSError", "PermissionError"), got  # read-only inside, whoever grades
        assert got["secret"] is False  # the rest of the closed folder stays hidden
        assert open(os.path.join(project, "probe_mod.py")).read() == "VALUE = 42\n"
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_a_needed_path_that_is_a_private_place_itself_is_refused_with_the_fix(monkeypatch):
    from mgpu_lab.course import sandbox_init

    with pytest.raises(OSError, match=r"/dev/shm is needed in the sandbox.*folder of their own"):
        sandbox_init._needed(["/dev/shm"])
    package = os.path.dirname(os.path.dirname(sandbox_init.__file__))
    # the system is in every sandbox's root already; of the package, its own folder, once
    assert sandbox_init._needed(["/", "/var", "/usr", "/usr/lib", "/etc", "/tmp/x/../nope", package,
                                 os.path.join(package, "course")]) == [package]


TORCHRUN = r"""
import json, socket, torch.distributed as dist
from mgpu_lab.launcher import elastic
results, run = elastic.call(lambda: dist.get_rank(), 2, timeout=120)
print(json.dumps({"host": socket.gethostname(), "address": socket.gethostbyname(socket.gethostname()),
                  "results": results, "tail": run.output[-800:]}))
"""
START_SANDBOX = """
import subprocess, sys
from mgpu_lab.course.sandbox import Sandbox
with Sandbox() as box:
    proc = box.start([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.communicate(timeout=280)
print(out.decode().strip().splitlines()[-1] if out.strip() else "no output: " + err.decode()[-800:])
"""


@pytest.mark.root
@pytest.mark.skipif(not ROOT or not protections().namespaces, reason="taking another host name needs root")
def test_torchrun_in_the_sandbox_uses_its_loopback_whatever_the_machine_is_called(tmp_path):
    # As on a cluster node: the machine's name resolves to an address of its own, which the sandbox
    # (loopback only) does not have; torchrun hands that name to its workers.
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n10.77.0.1 mgpu-far-node\n")
    os.chmod(tmp_path, 0o755)
    script = (f"mount --bind {hosts} /etc/hosts && hostname mgpu-far-node && "
              f"exec {sys.executable} -c \"$0\" \"$1\"")
    proc = subprocess.run(["unshare", "--uts", "--mount", "sh", "-c", script, START_SANDBOX, TORCHRUN],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["address"].startswith("127.") and got["results"] == [0, 1], got


def test_the_grader_reads_only_regular_files_of_the_sandbox_never_links_or_pipes(tmp_path):
    with Sandbox() as box:
        box.put("ok.txt", b"fine")
        (box.work / "answers").mkdir()
        (box.work / "answers" / "big").write_bytes(b"x" * 100)
        secret = tmp_path / "secret"
        secret.write_text("the grader's own file")
        os.symlink(secret, box.work / "link")
        os.symlink(tmp_path, box.work / "dirlink")
        os.mkfifo(box.work / "fifo")  # opening it for reading would block a naive grader forever
        assert box.read("ok.txt", 10) == b"fine"
        assert box.read("link", 100) is None and box.read("dirlink/secret", 100) is None
        assert box.read("fifo", 10) is None and box.read("answers", 10) is None and box.read("nope", 10) is None
        with pytest.raises(ValueError, match="larger than 10 bytes"):
            box.read("answers/big", 10)
        base = box.base
    assert not base.exists() and secret.read_text() == "the grader's own file"


def test_the_manifest_is_believed_only_for_known_exercises_each_once_the_last_check_counting():
    expected = exercises("01")
    lines = [json.dumps(e) for e in (
        {"exercise": "01.pick_device", "file": "0.pkl"},
        {"exercise": "99.bonus", "file": "1.pkl", "points": 2000},
        {"exercise": "04.shard_indices", "file": "2.pkl"},
        {"exercise": "01.pick_device", "file": "3.pkl", "points": 1000, "status": "passed"},
        {"exercise": "01.train_step", "file": "../../etc/passwd"},
        {"exercise": "01.visible_devices_env", "error": "TypeError: cannot pickle '_thread.lock' object"},
        {"points": 5}, ["01.pick_device"],
    )] + ["not json", '{"exercise": "01.pick_device", "points": 99']
    found, notes = read_manifest("\n".join(lines).encode(), expected)
    assert found == {"01.pick_device": {"file": "3.pkl"},
                     "01.visible_devices_env": {"error": "TypeError: cannot pickle '_thread.lock' object"}}
    assert len(notes) == 1 and "ignored 7 recorded check(s)" in notes[0] and "'99.bonus'" in notes[0]
    assert read_manifest(None, expected) == ({}, [])


class Boom:
    def __reduce__(self):
        return (os.system, ("touch /tmp/mgpu-grade-test-pwned",))


def test_replies_are_read_as_plain_data_only_and_a_pickle_that_runs_code_is_refused(tmp_path):
    session = Session.__new__(Session)
    buf = io.BytesIO()
    torch.save({"value": {"loss": 0.5, "state": torch.ones(2), "device": torch.device("cpu"), "ok": (1, "a")}}, buf)
    got = session._reply({"kind": "ok"}, buf.getvalue())
    assert got["device"] == torch.device("cpu") and torch.equal(got["state"], torch.ones(2))
    forged = io.BytesIO()
    torch.save({"value": Boom()}, forged)
    with pytest.raises(CaseFailed) as info:
        session._reply({"kind": "ok"}, forged.getvalue())
    assert "cannot judge" in info.value.hint and "could not be read as plain data" in info.value.got
    assert not os.path.exists("/tmp/mgpu-grade-test-pwned")
    with pytest.raises(CaseFailed, match="cannot judge"):
        session._reply({"kind": "unjudgeable", "message": "the value is a numpy.ndarray"}, b"")
    with pytest.raises(RuntimeError, match="not"):
        session._reply(["not", "a", "dict"], b"odd")  # nonsense from the sandbox is an error, not a crash


def test_the_runner_names_what_is_not_plain_data():
    import numpy as np

    assert unjudgeable({"a": [1, 2.5, "x", None, torch.zeros(1), torch.device("cpu"), {3}]}) == ""
    assert unjudgeable([1, np.float32(2)]) == "the result[1] is a numpy.float32"
    assert unjudgeable({"k": object()}) == "the result['k'] is a builtins.object"


def test_protections_are_said_once_in_words():
    text = protections().describe(Limits())
    assert text.startswith("sandbox: ")
    if ROOT and protections().namespaces:
        assert "user nobody" in text and "network (loopback only)" in text and "not had here" not in text
    else:
        assert "not had here" in text


@pytest.mark.skipif(not protections().namespaces, reason="without a PID namespace a setsid child can outlive it")
def test_a_sandbox_dies_with_its_grader_even_when_the_grader_is_killed():

    grader = subprocess.Popen([sys.executable, "-c", f"""
import subprocess, sys, time
from mgpu_lab.course.sandbox import Sandbox
box = Sandbox()
box.start(["/bin/sh", "-c", "setsid sleep 601.25 & sleep 601.25"])
print(box.base, flush=True)
time.sleep(600)
"""], stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    base = grader.stdout.readline().strip()

    def sleepers():  # the sleeps themselves: they run as the sandbox user, after it dropped root
        return [p for p in psutil.process_iter(["name", "cmdline"])
                if p.info["name"] == "sleep" and "601.25" in " ".join(p.info["cmdline"] or [])]

    for _ in range(100):  # until both sleeps run
        if len(sleepers()) >= 2:
            break
        time.sleep(0.1)
    assert len(sleepers()) == 2
    time.sleep(0.5)  # the submission runs on for a while before its grader dies
    grader.kill()  # as the out-of-memory killer would: no clean-up code runs
    grader.wait()
    gone, alive = psutil.wait_procs(sleepers(), timeout=10)
    assert alive == []
    shutil.rmtree(base, ignore_errors=True)


def test_lesson_07_runs_outside_the_sandbox_only_the_command_its_cases_judged_when_grading():
    from types import SimpleNamespace

    from mgpu_lab.course.checks.l07.judges import parse_torchrun, runnable

    argv = ["/proc/1/root/tmp/work/torchrun", "--nnodes=2", "--nproc-per-node=2", "--node-rank=1",
            "--master-addr=10.213.7.1", "--master-port=29500", "--log-dir=/etc/cron.d", "--no-python", "probe.py"]
    args, why = parse_torchrun(argv)
    assert why == "" and args.log_dir == "/etc/cron.d"
    assert runnable(SimpleNamespace(grading=False), argv, args) is argv  # in the learner's own kernel: as written
    assert runnable(SimpleNamespace(grading=True), argv, args) == [
        "torchrun", "--nnodes=2", "--nproc-per-node=2", "--node-rank=1", "--master-addr=10.213.7.1",
        "--master-port=29500", "probe.py"]


def test_a_reply_cut_by_a_signal_is_written_to_its_end():
    """A blocking write to a pipe that a signal interrupts returns what it wrote; the runner's replies
    loop until every byte is out (an unbuffered file's write() would have dropped the rest)."""
    import signal
    import threading
    import time

    from mgpu_lab.course.runner import write_all

    data = os.urandom(4 << 20)
    read, write = os.pipe()
    got = bytearray()

    def reader():
        while chunk := os.read(read, 65536):
            got.extend(chunk)
            time.sleep(0.0005)  # slower than the writer: the pipe fills, the write blocks

    thread = threading.Thread(target=reader)
    thread.start()
    previous = signal.signal(signal.SIGALRM, lambda *_: None)
    signal.setitimer(signal.ITIMER_REAL, 0.002, 0.002)  # interrupt the blocked write, again and again
    try:
        with open(write, "wb", buffering=0, closefd=False) as raw:
            first = raw.write(data)  # what the runner did before: one write() call
        write_all(write, data[first:])
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        os.close(write)
    thread.join(30)
    os.close(read)
    assert first < len(data), "the signal did not cut the single write(): the test shows nothing"
    assert bytes(got) == data

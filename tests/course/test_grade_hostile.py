"""Hostile submissions, graded in one batch beside an honest one: each is contained, the honest one graded right.

Each hostile notebook answers ``01.pick_device`` correctly only if its attacks
were contained (so its score is one line of evidence), and the test checks the
other line from outside: the listener saw no connection, no file outside the
sandbox changed, nothing it started is still running, the grader's secret is
in no output, the batch wrote every report. The class lies in a folder anyone
may read, outside ``/tmp``: what keeps a submission from reading another, a
sibling section's, the kept grades, the instructor's notes or the project's
solutions and ``.git`` is the sandbox's own root, not a folder's permissions.

The kill request names a process the test started, not pid 1: a grader that
obeyed it again must fail this test, not take the machine down with it.
"""
from __future__ import annotations

import contextlib
import csv
import hashlib
import json
import os
import socket
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from submissions import (CHECK_PICK_DEVICE, HEADER, LESSON_01_POINTS, PICK_DEVICE, PICK_DEVICE_BODY, PICK_POINTS,
                         instructor_folder, notebook, readable_by_anyone)

import mgpu_lab.course.grade as grade_module
from mgpu_lab.course.grade import grade, report, write_csv, write_json
from mgpu_lab.course.gradescope import write_gradescope
from mgpu_lab.course.sandbox import Limits, protections

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow, pytest.mark.root,
              pytest.mark.skipif(os.geteuid() != 0 or not protections().namespaces,
                                 reason="containment needs the full sandbox: root and unshare (CI runs as root)")]

SECRET = "mgpu-test-secret-7f3a9c"
MARK = "313.0173"  # the sleep of every process a submission tries to leave behind
RIGHT_BODY = PICK_DEVICE_BODY
HONEST = PICK_DEVICE
# Right only if the cell of attacks ran to its end (`attempted`) and nothing escaped.
CONTAINED = (HEADER + "def pick_device(index=None):\n"
             "    if escaped or not attempted:\n        return 'escaped: ' + ', '.join(escaped)" + RIGHT_BODY)
CHECK = CHECK_PICK_DEVICE

ESCAPE = """
import json, os, socket, subprocess
escaped = []
ENV = dict(os.environ)  # the kernel's environment, pickled with the answer below
if {secret!r} in json.dumps(ENV):
    escaped.append("the grader's environment")
s = socket.socket()
s.settimeout(3)
try:
    s.connect(({addr!r}, {port}))
    escaped.append("the network")
except OSError:
    pass
for path in {targets!r}:
    try:
        with open(path, "a") as f:
            f.write("pwned")
        if not path.startswith(("/var/tmp", "/dev/shm", "/run/lock")):  # private ones are no escape
            escaped.append("wrote " + path)
    except OSError:
        pass
for path in {reads!r}:  # another submission (this folder, a sibling one), kept grades, solutions, .git, home
    try:
        open(path, "rb").read(1)
        escaped.append("read " + path)
    except OSError:
        pass
subprocess.Popen(["setsid", "sleep", {mark!r}], start_new_session=True)
subprocess.run("(setsid sleep {mark} &) &", shell=True)
kill = json.dumps({{"kernel_pid": {sentinel}}}) + "\\n"
for name in ("progress.jsonl", "checks.jsonl"):
    open(name, "a").write(kill)
for fd in os.listdir(f"/proc/{{os.getppid()}}/fd"):  # the runner's pipes, progress included
    try:
        w = os.open(f"/proc/{{os.getppid()}}/fd/{{fd}}", os.O_WRONLY | os.O_NONBLOCK)
        os.write(w, kill.encode())
        os.close(w)
    except OSError:
        pass
attempted = True
"""
# Its visible_devices_env says everything it sees in its error, which lands in the grades' outputs.
LEAK = """
def visible_devices_env(ids):
    def seen(env):  # short enough that the case's message keeps it whole
        return sorted((k, v) for k, v in env.items() if k in ("HOME", "MGPU_LAB_TEST_SECRET") or {secret!r} in v)
    raise ValueError("kernel " + repr(seen(ENV)) + " ranks " + repr(seen(os.environ)))
check('01.visible_devices_env', visible_devices_env)
"""
FORGE = """
import json, os
def pick_device(index=None):
    return None  # wrong in every case: whatever it earns, it earns from the forged records
check('01.pick_device', pick_device)
folder = os.environ.get("MGPU_LAB_GRADE_ANSWERS", "answers")
os.makedirs(folder, exist_ok=True)
forged = [{"exercise": "99.bonus", "points": 2000, "max_points": 1, "status": "passed", "file": "0.pkl"},
          {"exercise": "01.pick_device", "points": 1000, "max_points": 6, "status": "passed"},
          {"exercise": "01.train_step", "file": "0.pkl"},
          {"exercise": "01.visible_devices_env", "file": "../../../../etc/passwd"}]
with open(os.path.join(folder, "manifest.jsonl"), "a") as f:
    f.write("\\n".join(json.dumps(e) for e in forged) + "\\nthis line is not json\\n")
with open(os.environ.get("MGPU_LAB_GRADE_LOG") or "checks.jsonl", "a") as f:  # the old grading log
    f.write(json.dumps({"exercise": "01.pick_device", "points": 1000, "max_points": 6, "status": "passed"}))
"""
BOMB = """
import os, signal, time
pids, error = [], None
while len(pids) < 5000:
    try:
        pid = os.fork()
    except OSError as exc:
        error = type(exc).__name__
        break
    if pid == 0:
        time.sleep(float({mark!r}))
        os._exit(0)
    pids.append(pid)
for pid in pids[20:]:  # room for the cells below; 20 stay behind for the grader to clean up
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
try:
    hog = bytearray({hog})  # more address space than the limit (untouched: no memory is used)
    held = True
    del hog
except MemoryError:
    held = False
escaped = (["the process limit"] if error is None else []) + (["the memory limit"] if held else [])
attempted = len(pids) > 20
"""


_nb = notebook


def _outside_address() -> str | None:
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    return None


def _left_behind() -> list:
    """The processes a submission of this test may have left: those naming MARK or run by the sandbox user,
    less those another pytest-xdist worker started (a test beside this one grades as the same user at the
    same moment: its live ranks are its own, not a leak of this test's)."""
    others = _other_workers()
    return [p for p in psutil.process_iter(["cmdline", "uids"])
            if (MARK in " ".join(p.info["cmdline"] or []) or (p.info["uids"] and p.info["uids"].real == 65534))
            and not _started_by(p, others)]


def _other_workers() -> set[int]:
    """The pids of this test's sibling xdist workers (the controller's other children); none without xdist."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return set()
    with contextlib.suppress(psutil.Error):
        return {c.pid for c in psutil.Process(os.getppid()).children() if c.pid != os.getpid()}
    return set()


def _started_by(proc: psutil.Process, pids: set[int]) -> bool:
    with contextlib.suppress(psutil.Error):
        return any(a.pid in pids for a in proc.parents())
    return False


def _still_running(before: set, wait: float = 10.0) -> list:
    """The submissions' processes (not in ``before``) that still run. A zombie, dead and waiting for its parent to
    reap it, runs nothing and holds nothing; it is given ``wait`` seconds to be reaped (on a loaded machine one
    was still there the moment the batch ended), and a live one is never waited for."""
    deadline = time.monotonic() + wait
    while True:
        left = [p for p in _left_behind() if p.pid not in before]
        alive = []
        for p in left:
            with contextlib.suppress(psutil.NoSuchProcess):
                if p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
        if alive or not left or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def _describe(proc: psutil.Process) -> str:
    """A leftover process as the failure shows it: pid, command line and the chain of its parents."""
    with contextlib.suppress(psutil.Error):
        chain = " <- ".join(f"{a.pid} {' '.join(a.cmdline())[:60]}" for a in proc.parents()[:6])
        return f"{proc.pid} {' '.join(proc.cmdline())[:120]} (parents: {chain})"
    return f"{proc.pid} (gone)"


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def instructor():
    """The instructor's home-like folder, readable by anyone: the class, a sibling section, kept grades."""
    with instructor_folder() as top:
        yield top


def _what_not_to_read(home: Path, subs: Path, honest: Path) -> list:
    """Files a submission must not read, each readable by anyone here (else the test would prove nothing)."""
    sibling = notebook(home / "section-b", "01_devices.ipynb", PICK_DEVICE, CHECK_PICK_DEVICE)
    kept = home / ".mgpu-lab-grades" / "0123.json"
    kept.parent.mkdir()
    kept.write_text('{"exercises": []}')
    mine = [honest, sibling, kept, home / "notes.txt"]
    project = [ROOT / "solutions" / "01_devices.ipynb", ROOT / ".git", ROOT / "tests" / "submissions.py"]
    reads = mine + [p for p in project if readable_by_anyone(p)]  # a clone in a 0700 folder hides itself
    assert all(readable_by_anyone(p) for p in mine) and honest.parent == subs
    return reads


@pytest.fixture
def listener():
    """A socket listening on the machine's outside address, closed after the test
    (left open, a later test that counts listening sockets saw it)."""
    with socket.socket() as sock:
        sock.bind((_outside_address() or "0.0.0.0", 0))
        sock.listen(8)
        sock.settimeout(0.2)
        yield sock


def test_hostile_submissions_are_contained_and_the_honest_one_is_graded_right(tmp_path, monkeypatch, listener,
                                                                              instructor):
    monkeypatch.setenv("MGPU_LAB_TEST_SECRET", SECRET)
    limits = Limits(memory=8 << 30, processes=400, file_size=1 << 30, cpu_time=600)
    addr = _outside_address()
    sentinel = subprocess.Popen(["sleep", "600"])
    drop = tmp_path / "drop"
    drop.mkdir(mode=0o777)
    os.chmod(drop, 0o777)
    subs = instructor / "subs"  # outside /tmp, readable by anyone: only the sandbox keeps it from the others
    subs.mkdir()
    honest = _nb(subs, "01_honest.ipynb", HONEST, CHECK)
    reads = _what_not_to_read(instructor, subs, honest)
    code = Path(grade_module.__file__)
    digests = {p: _digest(p) for p in (honest, code)}
    targets = [str(honest), str(code), str(drop / "x"), f"/var/tmp/{MARK}", f"/dev/shm/{MARK}", f"/run/lock/{MARK}"]
    escape = _nb(subs, "01_escape.ipynb", ESCAPE.format(secret=SECRET, addr=addr or "10.255.255.1",
                                                        port=listener.getsockname()[1], targets=targets,
                                                        mark=MARK, sentinel=sentinel.pid,
                                                        reads=[str(p) for p in reads]),
                 CONTAINED, CHECK, LEAK.format(secret=SECRET))
    forge = _nb(subs, "01_forge.ipynb", "from mgpu_lab import check", FORGE)
    bomb = _nb(subs, "01_bomb.ipynb", BOMB.format(mark=MARK, hog=12 << 30), CONTAINED, CHECK)
    before = {p.pid for p in _left_behind()}
    out = tmp_path / "out"
    out.mkdir()
    try:
        batch = grade([escape, forge, bomb, honest], timeout=300, limits=limits, store=instructor / ".mgpu-lab-grades")
        assert sentinel.poll() is None, "the grader killed the process the submission named"
    finally:
        sentinel.kill()
    report_text = report(batch, limits)
    write_json(batch, out / "g.json")
    write_csv(batch, out / "g.csv")
    write_gradescope(batch, out / "gs")
    grades = {Path(g["path"]).stem: g for g in json.loads((out / "g.json").read_text())}
    points = {name: {e["exercise"]: e["points"] for e in g["exercises"]} for name, g in grades.items()}

    # The honest submission is graded as if it were alone.
    assert points["01_honest"] == {"01.pick_device": PICK_POINTS, "01.train_step": 0, "01.visible_devices_env": 0}
    assert grades["01_honest"]["completed"], grades["01_honest"]["reason"]
    # Each hostile one answers pick_device right only if everything it tried was contained.
    assert points["01_escape"]["01.pick_device"] == PICK_POINTS, grades["01_escape"]
    assert points["01_bomb"]["01.pick_device"] == PICK_POINTS, grades["01_bomb"]
    # Forged records count for nothing: known ids only, each once, points from the grader's own judging.
    assert points["01_forge"] == {"01.pick_device": 0, "01.train_step": 0, "01.visible_devices_env": 0}
    assert grades["01_forge"]["max_points"] == LESSON_01_POINTS
    assert "'99.bonus'" in " ".join(grades["01_forge"]["notes"])
    assert f"{forge}: 0/{LESSON_01_POINTS}" in report_text

    # From outside: no connection, no file changed or left, nothing running, no secret in any output.
    with pytest.raises(socket.timeout):
        listener.accept()
    assert {p: _digest(p) for p in digests} == digests
    assert list(drop.iterdir()) == [] and not any(Path(d, MARK).exists() for d in ("/var/tmp", "/dev/shm", "/run/lock"))
    left = _still_running(before)
    assert left == [], [_describe(p) for p in left]
    outputs = report_text + "".join(p.read_text() for p in out.rglob("*") if p.is_file())
    assert SECRET not in outputs
    leak = next(c for e in grades["01_escape"]["exercises"] if e["exercise"] == "01.visible_devices_env"
                for c in e["cases"] if "kernel [" in c["got"])
    assert "'HOME'" in leak["got"] and "ranks [" in leak["got"]  # the leak reached the outputs: the secret would have
    rows = list(csv.DictReader((out / "g.csv").open()))
    assert [r["points"] for r in rows if r["exercise"] == "TOTAL"] == [str(g.points) for g in batch]
    assert len(list((out / "gs").glob("*/results.json"))) == 4

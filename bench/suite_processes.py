"""Benchmark: where a command's CPU goes, process by process: fresh Pythons against the ranks forked from them.

The suite is CPU-bound on a 2-core machine, and most of its processes are Pythons that
import torch (about 4 core-seconds each here, a quarter of it at exit) to do a few seconds
of work: Jupyter kernels, their fork servers, the grader's judges, torchrun's agents and
ranks. This runs a command (by default the README's ``make test``) under the kernel's
process accounting (``accton``, Debian's ``acct``: every process that ends, its CPU time,
parent and whether it exec'd), notes every process's command line twice a second, and
prints, per kind of process: how many started fresh (exec'd) and their core-seconds, and
how many were forked from them without exec (ranks, DataLoader workers) and theirs, beside
the machine's busy core-seconds over the run (``/proc/stat``).

A process that lives less than half a second may be missed by the command lines (its CPU
is still counted, under "unknown" or its parent's kind); a command line seen before an
``exec`` names the process by what it started as (``sandbox_init`` is read past its ``--``).

Run (root, Linux, ``apt-get install acct``): ``.venv/bin/python bench/suite_processes.py [-- COMMAND ...]``.
Results also go to ``bench/results/suite_processes.json``.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (kind, a piece of the command line), first match wins
KINDS = [("Jupyter kernel", "ipykernel"), ("fork server (fresh)", "forkserver import main"),
         ("grader's judge", "runner serve"), ("grader's notebook runner", "runner notebook"),
         ("torchrun", "torchrun"), ("torchrun", "torch.distributed.run"), ("pytest worker", "execnet"),
         ("pytest worker", "exec(eval("), ("pip", " pip "), ("pip", "-m pip"), ("pytest", "pytest"),
         ("Jupyter server", "jupyterlab"), ("simulated nodes' agents", "cluster.agents"),
         ("a course script", "/scripts/"), ("python -m mgpu_lab ...", "-m mgpu_lab"), ("mgpu-lab command", "bin/mgpu-lab")]


def kind_of(cmdline: str, comm: str) -> str:
    """The kind of a process that started fresh, from its command line (``comm`` when there is none).

    Example:
        >>> kind_of("/v/bin/python -m ipykernel_launcher -f /tmp/k.json", "python")
        'Jupyter kernel'
        >>> kind_of("/v/bin/python -P -s -m mgpu_lab.course.sandbox_init {} -- /v/bin/python -m mgpu_lab.course.runner serve a 3", "python")
        "grader's judge"
        >>> kind_of("", "chromium")
        'chromium'
    """
    if "sandbox_init" in cmdline and " -- " in cmdline:
        cmdline = cmdline.split(" -- ", 1)[1]
    for kind, piece in KINDS:
        if piece in cmdline:
            return kind
    if "python" in comm or "python" in cmdline:
        return "other Python"
    return comm or "unknown"


def parse_acct(text: str) -> list[dict]:
    """``dump-acct``'s lines (version 3) as dicts: comm, cpu (core-seconds), pid, ppid, forked, start and end
    (epoch seconds; ``start`` to the second).

    Example:
        >>> line = ("python          |v3|   449.00|    78.00|   579.00| 65534| 65534|4000768.00|5345280.00|   17309|"
        ...         "   17307|    X|       0|__      |Sun Nov 29 15:17:20 2026")
        >>> p = parse_acct(line)[0]
        >>> (p["comm"], p["cpu"], p["pid"], p["ppid"], p["forked"], round(p["end"] - p["start"], 2))
        ('python', 5.27, 17309, 17307, False, 5.79)
    """
    rows = []
    for line in text.splitlines():
        f = [x.strip() for x in line.split("|")]
        if len(f) < 15 or f[1] != "v3":
            continue
        start = time.mktime(time.strptime(f[14], "%a %b %d %H:%M:%S %Y"))
        rows.append({"comm": f[0], "cpu": round((float(f[2]) + float(f[3])) / 100, 2), "pid": int(f[9]),
                     "ppid": int(f[10]), "forked": "F" in f[11], "start": start, "end": start + float(f[4]) / 100})
    return rows


def inventory(rows: list[dict], seen: dict[int, list[tuple[float, str]]]) -> dict[str, dict]:
    """Per kind: fresh processes and their core-seconds, forked ones (counted under their nearest fresh
    ancestor) and theirs. ``seen[pid]`` is ``[(time seen, command line), ...]``, one entry per change (an exec, a
    reused pid).

    Example:
        >>> rows = [dict(comm="python", cpu=4.0, pid=10, ppid=1, forked=False, start=100.0, end=130.0),
        ...         dict(comm="python", cpu=1.5, pid=11, ppid=10, forked=True, start=101.0, end=103.0),
        ...         dict(comm="python", cpu=1.0, pid=12, ppid=11, forked=True, start=102.0, end=103.0)]
        >>> inventory(rows, {10: [(100.2, "python -c from multiprocessing.forkserver import main; main()")]})
        {'fork server (fresh)': {'fresh': 1, 'fresh_cpu': 4.0, 'forked': 2, 'forked_cpu': 2.5}}
    """
    by_pid: dict[int, list[dict]] = collections.defaultdict(list)
    for r in rows:
        by_pid[r["pid"]].append(r)

    def cmdline(r):  # the last one seen while it ran: after an exec, what it became
        during = [(t, c) for t, c in seen.get(r["pid"], []) if r["start"] - 1.5 <= t <= r["end"] + 1]
        return max(during)[1] if during else ""

    def parent(r):
        earlier = [p for p in by_pid.get(r["ppid"], []) if p["start"] <= r["start"] + 1]
        return max(earlier, key=lambda p: p["start"]) if earlier else None

    def root_kind(r):
        for _ in range(64):
            if r is None:
                return "unknown"
            if not r["forked"]:
                return kind_of(cmdline(r), r["comm"])
            r = parent(r)
        return "unknown"

    out: dict[str, dict] = {}
    for r in rows:
        entry = out.setdefault(root_kind(r), {"fresh": 0, "fresh_cpu": 0.0, "forked": 0, "forked_cpu": 0.0})
        key = "forked" if r["forked"] else "fresh"
        entry[key] += 1
        entry[key + "_cpu"] = round(entry[key + "_cpu"] + r["cpu"], 2)
    return out


def table(found: dict[str, dict], busy: float, wall: float) -> str:
    """The inventory as text, largest first, with the machine's busy core-seconds and the wall time.

    Example:
        >>> print(table({"Jupyter kernel": {"fresh": 2, "fresh_cpu": 9.0, "forked": 1, "forked_cpu": 1.0}}, 12.0, 8.0))
        kind                              fresh   core-s  each   forked   core-s
        Jupyter kernel                        2      9.0   4.5        1      1.0
        accounted 10 core-s of 12 busy (machine), 8 s wall
    """
    lines = [f"{'kind':32s} {'fresh':>6s} {'core-s':>8s} {'each':>5s} {'forked':>8s} {'core-s':>8s}"]
    order = sorted(found.items(), key=lambda kv: -(kv[1]["fresh_cpu"] + kv[1]["forked_cpu"]))
    for kind, e in order:
        if e["fresh_cpu"] + e["forked_cpu"] < 0.5 and len(order) > 20:
            continue
        lines.append(f"{kind[:32]:32s} {e['fresh']:6d} {e['fresh_cpu']:8.1f} {e['fresh_cpu'] / max(e['fresh'], 1):5.1f}"
                     f" {e['forked']:8d} {e['forked_cpu']:8.1f}")
    total = sum(e["fresh_cpu"] + e["forked_cpu"] for e in found.values())
    lines.append(f"accounted {total:.0f} core-s of {busy:.0f} busy (machine), {wall:.0f} s wall")
    return "\n".join(lines)


def _busy() -> float:
    with open("/proc/stat") as f:
        cpu = f.readline().split()[1:]
    return (int(cpu[0]) + int(cpu[1]) + int(cpu[2])) / os.sysconf("SC_CLK_TCK")


def _watch(seen: dict, stop: threading.Event) -> None:
    """Twice a second, every process's command line, noted again when it changes (an exec, a reused pid)."""
    while not stop.is_set():
        now = time.time()
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:300]
            except OSError:
                continue
            pid = int(name)
            if cmd and (not seen.get(pid) or seen[pid][-1][1] != cmd):  # a process that is ending shows none
                seen.setdefault(pid, []).append((now, cmd))
        stop.wait(0.5)


def _let_stragglers_end(before: set[int], limit: float = 15.0) -> None:
    """Wait (at most ``limit`` seconds) until no process that started during the run is left."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline and {int(n) for n in os.listdir("/proc") if n.isdigit()} - before - {os.getpid()}:
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("command", nargs="*", help="the command to measure (default: make test)")
    args = ap.parse_args(argv)
    command = args.command or ["make", "test"]
    if os.geteuid() != 0 or not shutil.which("accton") or not shutil.which("dump-acct"):
        print("suite_processes: needs root and Debian's acct (apt-get install acct): accton and dump-acct",
              file=sys.stderr)
        return 2
    acct = Path(tempfile.mkdtemp(prefix="mgpu-acct-")) / "pacct"
    acct.touch()
    seen: dict[int, list[tuple[float, str]]] = {}
    stop = threading.Event()
    watcher = threading.Thread(target=_watch, args=(seen, stop), daemon=True)
    subprocess.run(["accton", str(acct)], check=True, stdout=subprocess.DEVNULL)
    watcher.start()
    busy, start = _busy(), time.monotonic()
    before = {int(n) for n in os.listdir("/proc") if n.isdigit()}
    try:
        code = subprocess.run(command, cwd=ROOT).returncode
    finally:
        busy, wall = _busy() - busy, time.monotonic() - start
        _let_stragglers_end(before)  # a fork server ends just after its owner: accounting notes a process at its end
        subprocess.run(["accton", "off"], stdout=subprocess.DEVNULL)
        stop.set()
        watcher.join()
    rows = parse_acct(subprocess.run(["dump-acct", str(acct)], capture_output=True, text=True).stdout)
    found = inventory(rows, seen)
    print(table(found, busy, wall))
    results = ROOT / "bench" / "results"
    results.mkdir(exist_ok=True)
    (results / "suite_processes.json").write_text(json.dumps(
        {"command": command, "exit_code": code, "busy_core_s": round(busy), "wall_s": round(wall),
         "kinds": found}, indent=1))
    shutil.rmtree(acct.parent, ignore_errors=True)
    return code


if __name__ == "__main__":
    sys.exit(main())

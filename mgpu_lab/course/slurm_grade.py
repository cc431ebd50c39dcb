"""Grading a class on a SLURM cluster: one job array, a task per submission (or per chunk), gathered here.

:func:`grade_on_slurm` is ``mgpu-lab grade --slurm``: the submissions whose grade
the results folder does not keep yet are written to a job folder inside it, one
``sbatch --array`` job grades them (each task on its node, each submission in its
own sandbox, exactly as :func:`mgpu_lab.course.grade.grade` does, keeping every
grade in the results folder), progress comes from the array's state in
``squeue``, and once the array has left the queue every grade is read back from
the results folder into the same reports as a local run. A task that failed or
was cancelled costs only its own submissions: they are reported as not graded,
with the task's state, and a re-run submits only them. Interrupting the wait
(Ctrl-C) leaves the array running: what it has not graded yet is reported as
not graded (never as 0 points), and a re-run picks up that array (it waits for
it and reads its grades) instead of submitting the same submissions again. A
running task that gives no sign of life (each writes a heartbeat file every
few seconds) is named within :data:`SILENT` seconds: its node may have died.
The results folder must be on a file system every node sees (as home folders
are on a cluster).

SLURM's commands are those on ``PATH``; where this machine runs the course's own
local cluster (``mgpu-lab slurm up``), they run on its login node.

Example:
    >>> print(array_script(Path("/grades/slurm/job-1"), tasks=3, timeout=600, partition="cpu", parallel=2))
    #!/bin/bash
    #SBATCH --job-name=mgpu-lab-grade
    #SBATCH --array=0-2%2
    ...
    #SBATCH --partition=cpu
    ...
"""
from __future__ import annotations

import json
import math
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

__all__ = ["grade_on_slurm", "array_script", "task", "Slurm"]

POLL = 2.0  # seconds between two looks at the queue
HEARTBEAT = 10.0  # seconds between two heartbeats of a running task
SILENT = 60.0  # seconds without a heartbeat after which a running task is named (its node may be dead)
NO_CLUSTER = "no cluster: start one with `mgpu-lab slurm up`, or run on a cluster's login node"


class Slurm:
    """SLURM's client commands: this machine's local cluster when it is up, else those on ``PATH``."""

    def __init__(self, local: bool | None = None, state: Path | str | None = None):
        from mgpu_lab.cluster import slurm_local

        self._local, self.state = slurm_local, Path(state or slurm_local.STATE)
        up = (self.state / "slurm.conf").is_file()
        self.local = up if local is None else local
        if not self.local and shutil.which("sbatch") is None:
            raise RuntimeError(f"{NO_CLUSTER} (no local cluster is up and no `sbatch` is on PATH)")

    def check(self) -> None:
        """RuntimeError saying so when no SLURM controller answers (before anything is submitted)."""
        try:
            proc = self.run(["scontrol", "ping"], check=False)
        except (OSError, subprocess.SubprocessError, RuntimeError) as err:
            raise RuntimeError(f"{NO_CLUSTER} (`scontrol ping` failed: {err})") from None
        text = (proc.stdout + proc.stderr).strip()
        if proc.returncode != 0 or " is UP" not in text:
            last = text.splitlines()[-1] if text else f"exit {proc.returncode}"
            raise RuntimeError(f"{NO_CLUSTER} (`scontrol ping` reaches no controller on {self.where()}: "
                               f"{last[:200]})")

    def run(self, argv: list[str], cwd=None, check: bool = True) -> subprocess.CompletedProcess:
        if self.local:
            return self._local.run(argv, state=self.state, cwd=cwd, check=check, timeout=120)
        proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=120)
        if check and proc.returncode != 0:
            raise RuntimeError(f"`{shlex.join(argv)}` failed (exit {proc.returncode}): "
                               f"{(proc.stderr or proc.stdout).strip()}")
        return proc

    def where(self) -> str:
        return "this machine's local SLURM cluster" if self.local else "SLURM (commands on PATH)"


def array_script(job: Path, tasks: int, timeout: float, partition: str | None = None,
                 parallel: int | None = None, cpus: int = 2) -> str:
    """The batch script of one grading array: ``tasks`` tasks, at most ``parallel`` at once."""
    minutes = math.ceil((2 * timeout + 600) / 60)  # the notebook, its judging, and starting up
    lines = ["#!/bin/bash", "#SBATCH --job-name=mgpu-lab-grade",
             f"#SBATCH --array=0-{tasks - 1}" + (f"%{parallel}" if parallel else ""),
             "#SBATCH --nodes=1", "#SBATCH --ntasks=1", f"#SBATCH --cpus-per-task={cpus}",
             f"#SBATCH --time={minutes}", f"#SBATCH --output={job}/task-%a.out"]
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    lines += ["# each task grades its share of the submissions, each in a sandbox, keeping the grades",
              f"exec {shlex.quote(sys.executable)} -m mgpu_lab.course.slurm_grade {shlex.quote(str(job))} "
              "\"$SLURM_ARRAY_TASK_ID\""]
    return "\n".join(lines) + "\n"


def _heartbeat(path: Path) -> None:
    while True:
        try:
            path.touch()
        except OSError:
            pass
        time.sleep(HEARTBEAT)


def task(job: Path | str, index: int) -> int:
    """What array task ``index`` runs on its node: grade its submissions, keeping the grades, and touch its
    heartbeat file (``alive-<index>`` in the job folder) every :data:`HEARTBEAT` seconds meanwhile."""
    from .grade import grade

    threading.Thread(target=_heartbeat, args=(Path(job) / f"alive-{index}",), daemon=True).start()
    plan = json.loads((Path(job) / "plan.json").read_text())
    paths = [Path(p) for p in plan["chunks"][index]]
    grades = grade(paths, timeout=plan["timeout"], store=plan["store"], all_cells=plan["all_cells"])
    for g in grades:
        print(f"{g.path}: {g.points}/{g.max_points}" + ("" if g.completed else f" ({g.reason})"), flush=True)
    return 0


def _missing(paths: list[Path], store, force: bool) -> list[Path]:
    return [p for p in paths if force or store.get(store.key(p)) is None]


def _submit(slurm: Slurm, todo: list[Path], store_dir: Path, *, timeout, all_cells, partition, parallel,
            chunk: int) -> tuple[str, Path, list[list[str]]]:
    chunks = [[str(p.resolve()) for p in todo[i:i + chunk]] for i in range(0, len(todo), chunk)]
    job = (store_dir / "slurm" / time.strftime("job-%Y%m%d-%H%M%S")).resolve()
    job.mkdir(parents=True, exist_ok=True)
    (job / "plan.json").write_text(json.dumps({"chunks": chunks, "timeout": timeout, "all_cells": all_cells,
                                               "store": str(store_dir.resolve())}))
    script = job / "grade.sbatch"
    script.write_text(array_script(job, len(chunks), timeout, partition, parallel))
    job_id = slurm.run(["sbatch", "--parsable", str(script)], cwd=job).stdout.strip().split(";")[0]
    (job / "job_id").write_text(job_id + "\n")
    return job_id, job, chunks


def _queue(slurm: Slurm, job_id: str) -> dict[int, tuple[str, str]]:
    """Array task -> (state, node), for the tasks still in the queue."""
    out = slurm.run(["squeue", "-h", "-r", "-j", job_id, "-o", "%K %T %N"], check=False).stdout
    states = {}
    for line in out.splitlines():
        m = re.match(r"\s*(\d+)\s+(\S+)\s*(\S*)", line)
        if m:
            states[int(m.group(1))] = (m.group(2), m.group(3))
    return states


def _states(slurm: Slurm, job_id: str) -> dict[int, str]:
    """Array task -> state, for the tasks still in the queue."""
    return {k: state for k, (state, _) in _queue(slurm, job_id).items()}


def _live(slurm: Slurm, store_dir: Path) -> list[tuple[str, Path, list[list[str]]]]:
    """The arrays an earlier run submitted that are still in the queue: (job id, job folder, chunks)."""
    live = []
    for job in sorted((store_dir / "slurm").glob("job-*")):
        try:
            job_id = (job / "job_id").read_text().strip()
            chunks = json.loads((job / "plan.json").read_text())["chunks"]
        except (OSError, ValueError, KeyError):
            continue
        if job_id and _states(slurm, job_id):
            live.append((job_id, job.resolve(), chunks))
    return live


def _final_states(slurm: Slurm, job_id: str) -> dict[int, str]:
    """Array task -> its last state, as scontrol still remembers it (empty where it does not)."""
    out = slurm.run(["scontrol", "-o", "show", "job", job_id], check=False).stdout
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"ArrayTaskId=(\d+)\S*\s.*?JobState=(\S+)", out)}


def _ended(last_seen: str | None, record: str | None) -> str:
    """How a task that left no grade ended, in words: its record's state, else what was last seen of it
    (a pending array task that is cancelled leaves no record at all)."""
    if record:
        return f"ended {record}"
    if last_seen == "PENDING":
        return "was cancelled before it started"
    return f"ended (last seen {last_seen})" if last_seen else "ended"


def _silent(job: Path, queue: dict[int, tuple[str, str]], running_since: dict[int, float], told: set) -> list[str]:
    """A line for each running task that has given no heartbeat for :data:`SILENT` seconds (once each)."""
    now, lines = time.monotonic(), []
    for k, (state, node) in queue.items():
        if state != "RUNNING":
            running_since.pop(k, None)
            continue
        since = running_since.setdefault(k, now)
        try:
            quiet = time.time() - (job / f"alive-{k}").stat().st_mtime
        except OSError:
            quiet = now - since
        if quiet > SILENT and k not in told:
            told.add(k)
            lines.append(f"slurm job {job.name}: task {k} on {node or 'its node'} has given no sign of life "
                         f"for {quiet:.0f} s (its heartbeat, every {HEARTBEAT:g} s, stopped): its node may have "
                         f"died. `scancel` that task, then `mgpu-lab grade --slurm` again grades its submissions")
        elif quiet <= SILENT:
            told.discard(k)
    return lines


def _wait(slurm: Slurm, job_id: str, tasks: int, progress: bool, job: Path | None = None) -> dict[int, str]:
    """Each task's state in words, once the whole array has left the queue."""
    last, seen, since, told = "", {}, {}, set()
    while True:
        queue = _queue(slurm, job_id)
        states = {k: state for k, (state, _) in queue.items()}
        seen.update(states)
        lines = _silent(job, queue, since, told) if job is not None else []
        if progress:
            counts = {s: list(states.values()).count(s) for s in sorted(set(states.values()))}
            line = f"slurm job {job_id}: {tasks - len(states)}/{tasks} task(s) ended" + "".join(
                f", {n} {s.lower()}" for s, n in counts.items())
            if line != last:
                lines.insert(0, line)
                last = line
        for line in lines:
            print(line, file=sys.stderr, flush=True)
        if not states:
            records = _final_states(slurm, job_id)
            return {k: _ended(seen.get(k), records.get(k)) for k in range(tasks)}
        time.sleep(POLL)


def grade_on_slurm(paths, *, timeout: float = 600.0, store: Path | str = ".mgpu-lab-grades", force: bool = False,
                   all_cells: bool = False, partition: str | None = None, parallel: int | None = None,
                   chunk: int = 1, progress: bool = False, slurm: Slurm | None = None) -> list:
    """Grade ``paths`` as a SLURM job array (see the module docstring); one grade per path, in order.

    A submission no task graded (its task failed, or this run was interrupted
    while the array still ran) is "not graded" (``graded`` False), never 0 points.
    """
    from .batch import Store, fingerprint
    from .grade import _from_dict, check_timeout, not_graded

    timeout = check_timeout(timeout)
    if chunk < 1 or (parallel is not None and parallel < 1):
        raise ValueError(f"chunk={chunk}, parallel={parallel}: give whole numbers >= 1")
    slurm = slurm or Slurm()
    paths, store_dir = [Path(p) for p in paths], Path(store)
    kept = Store(store_dir, fingerprint(timeout, None, all_cells))
    todo = _missing(paths, kept, force)
    arrays = []  # (job id, job folder, chunks)
    if todo:
        slurm.check()
        wanted = {str(p.resolve()) for p in todo}
        for job_id, job, chunks in ([] if force else _live(slurm, store_dir)):
            if wanted & {p for c in chunks for p in c}:
                arrays.append((job_id, job, chunks))
                wanted -= {p for c in chunks for p in c}
                if progress:
                    print(f"grade --slurm: picking up job {job_id}, submitted by an earlier run and still in the "
                          f"queue; task logs in {job}", file=sys.stderr, flush=True)
        rest = [p for p in todo if str(p.resolve()) in wanted]
        if rest:
            job_id, job, chunks = _submit(slurm, rest, store_dir, timeout=timeout, all_cells=all_cells,
                                          partition=partition, parallel=parallel, chunk=chunk)
            arrays.append((job_id, job, chunks))
            if progress:
                print(f"grade --slurm: {len(rest)} of {len(paths)} submission(s) in {len(chunks)} task(s), job "
                      f"{job_id} on {slurm.where()}; task logs in {job}", file=sys.stderr, flush=True)
    how = _wait_all(slurm, arrays, progress)
    out = []
    for p in paths:
        data = kept.get(kept.key(p))
        if data is not None:
            out.append(_from_dict(data, p))
            continue
        out.append(not_graded(p, f"not graded: {how.get(str(p.resolve()), 'no task graded it')}, without a "
                                 "grade; `mgpu-lab grade --slurm` again grades what is missing"))
    return out


def _wait_all(slurm: Slurm, arrays: list, progress: bool) -> dict[str, str]:
    """Wait for every array; submission -> how its task ended, in words. Ctrl-C stops waiting, not the arrays."""
    how = {}
    for n, (job_id, job, chunks) in enumerate(arrays):
        try:
            states = _wait(slurm, job_id, len(chunks), progress, job)
        except KeyboardInterrupt:
            ids = " ".join(a[0] for a in arrays[n:])
            print(f"\ngrade --slurm: interrupted; job(s) {ids} keep grading on the cluster: `mgpu-lab grade "
                  f"--slurm` again picks up their grades (`scancel {ids}` stops them)", file=sys.stderr, flush=True)
            for job_id2, _, chunks2 in arrays[n:]:
                for k, chunk_paths in enumerate(chunks2):
                    how.update({p: f"its SLURM task ({job_id2}_{k}) was still queued or running when this run "
                                   "was interrupted" for p in chunk_paths})
            return how
        for k, chunk_paths in enumerate(chunks):
            how.update({p: f"its SLURM task ({job_id}_{k}) {states.get(k, 'ended')}" for p in chunk_paths})
    return how


if __name__ == "__main__":
    sys.exit(task(sys.argv[1], int(sys.argv[2])))

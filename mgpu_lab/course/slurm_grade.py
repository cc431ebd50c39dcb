"""Grading a class on a SLURM cluster: one job array, a task per submission (or per chunk), gathered here.

:func:`grade_on_slurm` is ``mgpu-lab grade --slurm``: the submissions whose grade
the results folder does not keep yet are written to a job folder inside it, one
``sbatch --array`` job grades them (each task on its node, each submission in its
own sandbox, exactly as :func:`mgpu_lab.course.grade.grade` does, keeping every
grade in the results folder), progress comes from the array's state in
``squeue``, and once the array has left the queue every grade is read back from
the results folder into the same reports as a local run. A task that failed or
was cancelled costs only its own submissions: they are reported as not graded,
with the task's state, and a re-run submits only them. The results folder must
be on a file system every node sees (as home folders are on a cluster).

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
import time
from pathlib import Path

__all__ = ["grade_on_slurm", "array_script", "task", "Slurm"]

POLL = 2.0  # seconds between two looks at the queue


class Slurm:
    """SLURM's client commands: this machine's local cluster when it is up, else those on ``PATH``."""

    def __init__(self, local: bool | None = None, state: Path | str | None = None):
        from mgpu_lab.cluster import slurm_local

        self._local, self.state = slurm_local, Path(state or slurm_local.STATE)
        up = (self.state / "slurm.conf").is_file()
        self.local = up if local is None else local
        if not self.local and shutil.which("sbatch") is None:
            raise RuntimeError("grade --slurm: no `sbatch` on PATH and no local cluster up: run it on a "
                               "cluster's login node, or start this machine's with `mgpu-lab slurm up`")

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


def task(job: Path | str, index: int) -> int:
    """What array task ``index`` runs on its node: grade its submissions, keeping the grades."""
    from .grade import grade

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
    return job_id, job, chunks


def _states(slurm: Slurm, job_id: str) -> dict[int, str]:
    """Array task -> state, for the tasks still in the queue."""
    out = slurm.run(["squeue", "-h", "-r", "-j", job_id, "-o", "%K %T"], check=False).stdout
    states = {}
    for line in out.splitlines():
        m = re.match(r"\s*(\d+)\s+(\S+)", line)
        if m:
            states[int(m.group(1))] = m.group(2)
    return states


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


def _wait(slurm: Slurm, job_id: str, tasks: int, progress: bool) -> dict[int, str]:
    """Each task's state in words, once the whole array has left the queue."""
    last, seen = "", {}
    while True:
        states = _states(slurm, job_id)
        seen.update(states)
        if progress:
            counts = {s: list(states.values()).count(s) for s in sorted(set(states.values()))}
            line = f"slurm job {job_id}: {tasks - len(states)}/{tasks} task(s) ended" + "".join(
                f", {n} {s.lower()}" for s, n in counts.items())
            if line != last:
                print(line, file=sys.stderr, flush=True)
                last = line
        if not states:
            records = _final_states(slurm, job_id)
            return {k: _ended(seen.get(k), records.get(k)) for k in range(tasks)}
        time.sleep(POLL)


def grade_on_slurm(paths, *, timeout: float = 600.0, store: Path | str = ".mgpu-lab-grades", force: bool = False,
                   all_cells: bool = False, partition: str | None = None, parallel: int | None = None,
                   chunk: int = 1, progress: bool = False, slurm: Slurm | None = None) -> list:
    """Grade ``paths`` as a SLURM job array (see the module docstring); one grade per path, in order."""
    from .batch import Store, fingerprint
    from .grade import _failed, _from_dict, check_timeout

    timeout = check_timeout(timeout)
    if chunk < 1 or (parallel is not None and parallel < 1):
        raise ValueError(f"chunk={chunk}, parallel={parallel}: give whole numbers >= 1")
    slurm = slurm or Slurm()
    paths, store_dir = [Path(p) for p in paths], Path(store)
    kept = Store(store_dir, fingerprint(timeout, None, all_cells))
    todo, states, job_id, chunks = _missing(paths, kept, force), {}, "", []
    if todo:
        job_id, job, chunks = _submit(slurm, todo, store_dir, timeout=timeout, all_cells=all_cells,
                                      partition=partition, parallel=parallel, chunk=chunk)
        if progress:
            print(f"grade --slurm: {len(todo)} of {len(paths)} submission(s) in {len(chunks)} task(s), job "
                  f"{job_id} on {slurm.where()}; task logs in {job}", file=sys.stderr, flush=True)
        states = _wait(slurm, job_id, len(chunks), progress)
    where = {p: k for k, chunk_paths in enumerate(chunks) for p in chunk_paths}
    out = []
    for p in paths:
        data = kept.get(kept.key(p))
        if data is not None:
            out.append(_from_dict(data, p))
            continue
        k = where.get(str(p.resolve()))
        how = f"its SLURM task ({job_id}_{k}) {states.get(k, 'ended')}" if k is not None else "no task graded it"
        out.append(_failed(p, f"not graded: {how}, without a grade; `mgpu-lab grade --slurm` again grades "
                              "what is missing"))
    return out


if __name__ == "__main__":
    sys.exit(task(sys.argv[1], int(sys.argv[2])))

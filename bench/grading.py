"""Benchmark: one student's whole course graded, against running the same notebooks end to end, in one run.

The student is the solution notebooks (every lesson, 08-10 included), copied
to a folder of their own. Side by side:

    nbclient       every notebook executed end to end with nbclient, one after
                   the other, no sandbox (what grading by running the notebook costs)
    full run       ``mgpu-lab grade --all-cells --jobs 1``: sandboxed, every cell run
    grade -j 1     ``mgpu-lab grade --jobs 1``: sandboxed, demo cells skipped
    grade -j N     the same, N at once (default: :func:`default_jobs`, 2 on 2 cores)

and whether each graded run gives the same points as the full run. Targets
(issue "Grading a whole class in an hour"): the course in at most 120 s, and
``--jobs 2`` on 2 cores no slower than ``--jobs 1``.

``--slurm`` (root, Linux) adds the class graded as a SLURM job array on this
machine's local cluster (``mgpu_lab.course.slurm_grade``) with 1 and with 2
compute nodes, side by side: the simulated nodes share this machine's cores, so
the ratio shows the array's overhead and what the nodes' sharing leaves, not a
cluster's speed-up. ``--autograder`` adds the Gradescope bundle's
``run_autograder`` for one submission (lesson 01's solution), in a folder laid
out as Gradescope does, with this environment (no ``setup.sh``).

Run: ``.venv/bin/python bench/grading.py [--skip-slow] [--jobs N] [--slurm] [--autograder]``.
``--skip-slow`` leaves out the two end-to-end runs (nbclient, full run), which take minutes.
Results also go to ``bench/results/grading.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mgpu_lab.course.batch import default_jobs  # noqa: E402
from mgpu_lab.course.grade import grade  # noqa: E402

TARGET_S = 120.0


def nbclient_run(paths: list[Path]) -> float:
    import nbformat
    from nbclient import NotebookClient

    start = time.perf_counter()
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        NotebookClient(nb, timeout=900, kernel_name="python3", allow_errors=True,
                       resources={"metadata": {"path": str(path.parent)}}).execute()
    return time.perf_counter() - start


def graded(paths: list[Path], **kw) -> tuple[float, dict]:
    start = time.perf_counter()
    grades = grade(paths, timeout=900, **kw)
    seconds = time.perf_counter() - start
    return seconds, {Path(g.path).name: (g.points, g.max_points, g.completed, g.reason) for g in grades}


def slurm_runs(paths: list[Path], tmp: Path) -> list[tuple[str, float]]:
    """The class as a SLURM array on 1 and on 2 local nodes (each run from scratch)."""
    from mgpu_lab.cluster import slurm_local
    from mgpu_lab.course.slurm_grade import Slurm, grade_on_slurm

    rows = []
    for nodes in (1, 2):
        state = tmp / f"slurm{nodes}"
        slurm_local.up(nodes, state=state, echo=False)
        try:
            start = time.perf_counter()
            grades = grade_on_slurm(paths, timeout=900, store=tmp / f"grades{nodes}",
                                    slurm=Slurm(local=True, state=state))
            rows.append((f"grade --slurm, {nodes} node(s)", time.perf_counter() - start))
        finally:
            slurm_local.down(state, quiet=True)
        print(f"  grade --slurm on {nodes} node(s): {rows[-1][1]:.0f} s, "
              f"{sum(g.points for g in grades)}/{sum(g.max_points for g in grades)} points", flush=True)
    return rows


def autograder_run(tmp: Path) -> tuple[str, float]:
    """run_autograder on lesson 01's solution, in Gradescope's layout, with this environment."""
    import subprocess
    import zipfile

    from mgpu_lab.course.autograder import build

    root = tmp / "autograder"
    with zipfile.ZipFile(build(tmp / "autograder.zip", ["01"])) as zf:
        zf.extractall(root / "source")
    (root / "submission").mkdir()
    shutil.copy(ROOT / "solutions" / "01_devices.ipynb", root / "submission" / "01_devices.ipynb")
    start = time.perf_counter()
    subprocess.run(["bash", str(root / "source" / "run_autograder")], check=True, capture_output=True,
                   env={**os.environ, "AUTOGRADER_ROOT": str(root), "MGPU_LAB_VENV": sys.prefix})
    seconds = time.perf_counter() - start
    score = json.loads((root / "results" / "results.json").read_text())["score"]
    print(f"  run_autograder, one submission (01): {seconds:.0f} s, score {score}", flush=True)
    return ("run_autograder, 01 solution", seconds)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--skip-slow", action="store_true", help="leave out nbclient and the full run")
    parser.add_argument("--jobs", type=int, default=default_jobs(), help="jobs of the last run")
    parser.add_argument("--slurm", action="store_true", help="also as a SLURM array on 1 and 2 local nodes (root)")
    parser.add_argument("--autograder", action="store_true", help="also the Gradescope bundle's run_autograder")
    parser.add_argument("--lessons", nargs="*", default=None, metavar="NN",
                        help="grade only these lessons' solutions (default: all ten)")
    args = parser.parse_args(argv)
    cores = len(os.sched_getaffinity(0))
    print(f"grading benchmark: {cores} cores, jobs {args.jobs}; one student = the solution notebooks of "
          f"{'lessons ' + ' '.join(args.lessons) if args.lessons else 'every lesson'}", flush=True)
    with tempfile.TemporaryDirectory(prefix="mgpu-bench-grading-") as tmp:
        student = Path(tmp) / "student"
        student.mkdir()
        paths = []
        for src in sorted((ROOT / "solutions").glob("*.ipynb")):
            if args.lessons is None or src.name[:2] in args.lessons:
                paths.append(Path(shutil.copy(src, student / src.name)))
        rows, points = [], {}
        if not args.skip_slow:
            rows.append(("nbclient, end to end", nbclient_run(paths)))
            print(f"  nbclient end to end: {rows[-1][1]:.0f} s", flush=True)
            seconds, points["full run"] = graded(paths, jobs=1, all_cells=True)
            rows.append(("grade --all-cells --jobs 1", seconds))
            print(f"  full run: {seconds:.0f} s", flush=True)
        for jobs in sorted({1, args.jobs}):
            seconds, points[f"jobs {jobs}"] = graded(paths, jobs=jobs)
            rows.append((f"grade --jobs {jobs}", seconds))
            print(f"  grade --jobs {jobs}: {seconds:.0f} s", flush=True)
        if args.slurm:
            rows += slurm_runs(paths, Path(tmp))
        if args.autograder:
            rows.append(autograder_run(Path(tmp)))
    base = rows[0][1]
    print(f"\n{'run':32} {'seconds':>8} {'vs first':>9}")
    for name, seconds in rows:
        print(f"{name:32} {seconds:8.1f} {seconds / base:8.2f}x")
    reference = points.get("full run") or points["jobs 1"]
    same = {name: p == reference for name, p in points.items()}
    full = all(pts == top and done for pts, top, done, _ in reference.values())
    print(f"\npoints: {sum(p[0] for p in reference.values())}/{sum(p[1] for p in reference.values())}"
          f" ({'full marks' if full else 'NOT full marks'}); same as the "
          f"{'full run' if 'full run' in points else 'jobs 1 run'}: {same}")
    for name, (pts, top, done, reason) in reference.items():
        if pts != top or not done:
            print(f"  {name}: {pts}/{top} {reason}")
    fastest = min(s for n, s in rows if n.startswith("grade --jobs"))
    print(f"target: the course graded in <= {TARGET_S:.0f} s: {fastest:.0f} s "
          f"({'met' if fastest <= TARGET_S else 'NOT met'})")
    if args.jobs > 1:
        j1 = dict(rows)["grade --jobs 1"]
        jn = dict(rows)[f"grade --jobs {args.jobs}"]
        print(f"target: --jobs {args.jobs} no slower than --jobs 1: {jn:.0f} s vs {j1:.0f} s "
              f"({'met' if jn <= j1 else 'NOT met'})")
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "grading.json").write_text(json.dumps({"cores": cores, "rows": rows, "same_points": same,
                                                  "points": {k: {n: list(v) for n, v in p.items()}
                                                             for k, p in points.items()}}, indent=1) + "\n")
    return 0 if all(same.values()) and full else 1


if __name__ == "__main__":
    sys.exit(main())

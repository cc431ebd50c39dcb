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

Run: ``.venv/bin/python bench/grading.py [--skip-slow] [--jobs N]``. ``--skip-slow``
leaves out the two end-to-end runs (nbclient, full run), which take minutes.
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--skip-slow", action="store_true", help="leave out nbclient and the full run")
    parser.add_argument("--jobs", type=int, default=default_jobs(), help="jobs of the last run")
    args = parser.parse_args(argv)
    cores = len(os.sched_getaffinity(0))
    print(f"grading benchmark: {cores} cores, jobs {args.jobs}; one student = the 10 solution notebooks", flush=True)
    with tempfile.TemporaryDirectory(prefix="mgpu-bench-grading-") as tmp:
        student = Path(tmp) / "student"
        student.mkdir()
        paths = []
        for src in sorted((ROOT / "solutions").glob("*.ipynb")):
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

#!/usr/bin/env python3
"""The course on a real GPU, in one prepared command: `make gpu-check` or `python3 scripts/gpu_check.py`.

Runs, each step in a child process with its own time limit, within about 8 minutes on a machine with one GPU
and 16 cores:

- ``environment``: Python, torch, CUDA, the GPUs (``nvidia-smi -L``);
- ``wheels``: installs the wheels `make gpu-wheels` fetched into ``.whl/`` (Jupyter's kernel, nbval, ...)
  where this Python lacks them, into a folder of their own put on PYTHONPATH (a GPU machine with no network);
- ``gpu-tests``: the suite's GPU-marked tests (``pytest -m gpu``);
- ``doctor``: ``mgpu-lab doctor``, real collectives on every backend that can work here;
- ``kernel-launch``: a Jupyter kernel that has already allocated a CUDA tensor launches 1 rank on the GPU with
  NCCL, then 2 ranks sharing it with gloo; each launch's banner must say so;
- ``notebooks``: the solution notebooks with GPU paths under nbval (lessons 01, 02, 04, 08, 13 and 14);
- ``figures``: the numbers the lessons promise on a GPU (``scripts/gpu_figures.py``).

It writes ``report.json`` and ``report.txt`` into ``--out`` (default ``gpu-check-report/``) and exits non-zero
when a check failed. Without a GPU it says "no GPU: N checks skipped", runs only what proves the wiring
(the wheels' list, the report, every step's entry point, a kernel's launch on the CPU) in seconds, and
exits 0: CI runs that mode (tests/test_gpu_check.py), so the command cannot rot.

Usage on any GPU machine (a learner's, a cluster node): ``make gpu-wheels`` where pip reaches an index
(only needed where Jupyter's packages are missing), then ``make gpu-check``; the report says what ran.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WHEELS = ROOT / ".whl"
SITE = Path(os.environ.get("TMPDIR", "/tmp")) / "mgpu-lab-gpu-site"
NOTEBOOKS = ("01_devices", "02_data_loading", "04_ddp", "08_sharding", "13_time_and_memory", "14_long_context")
# What the GPU machine lacks (its image has torch, pytest, matplotlib, cloudpickle, psutil, ...): a
# distribution name, and the module that proves it is importable.
CARRIED = {
    "nbval": "nbval", "nbformat": "nbformat", "nbclient": "nbclient", "ipykernel": "ipykernel",
    "jupyter_client": "jupyter_client", "jupyter_core": "jupyter_core", "ipython": "IPython",
    "ipywidgets": "ipywidgets", "py-spy": None, "pyzmq": "zmq", "tornado": "tornado", "traitlets": "traitlets",
    "comm": "comm", "debugpy": "debugpy", "matplotlib-inline": "matplotlib_inline",
    "nest-asyncio2": None, "jedi": "jedi", "parso": "parso", "pexpect": "pexpect", "ptyprocess": "ptyprocess",
    "prompt_toolkit": "prompt_toolkit", "wcwidth": "wcwidth", "stack_data": "stack_data",
    "executing": "executing", "asttokens": "asttokens", "pure_eval": "pure_eval",
    "ipython_pygments_lexers": "ipython_pygments_lexers", "fastjsonschema": "fastjsonschema",
    "jsonschema": "jsonschema", "jsonschema-specifications": "jsonschema_specifications",
    "referencing": "referencing", "rpds-py": "rpds", "platformdirs": "platformdirs", "tzdata": None,
    "widgetsnbextension": None, "jupyterlab_widgets": None,
}
# One name per step, in the order they run: (name, needs a GPU, seconds it may take).
CHECKS = (("environment", False, 30), ("wheels", False, 60), ("gpu-tests", True, 150), ("doctor", True, 60),
          ("kernel-launch", False, 90), ("notebooks", True, 240), ("figures", True, 150))
BUDGET_S = 480.0


def _run(cmd: list[str], timeout: float, env: dict | None = None) -> tuple[int, str, float]:
    """Run ``cmd`` in its own session; kill its whole group at ``timeout``. Returns (code, output, seconds)."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env or _env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        code, out = 124, (out or "") + f"\n[gpu-check: killed after {timeout:.0f} s]"
    return code, out or "", time.monotonic() - start


def _env() -> dict:
    """This process's environment with the carried wheels and the project on PYTHONPATH."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", MPLBACKEND="Agg")
    paths = [str(SITE)] if SITE.is_dir() else []
    paths += [str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def gpu_count() -> int:
    """CUDA GPUs torch sees, asked in a child process (this one never initialises CUDA)."""
    code, out, _ = _run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"], 120)
    try:
        return int(out.strip().splitlines()[-1]) if code == 0 else 0
    except (ValueError, IndexError):
        return 0


def step_environment(gpus: int, limit: float) -> dict:
    probe = ("import platform, torch; print(f'python {platform.python_version()}, torch {torch.__version__}, "
             "CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s)'); "
             "[print(f'  cuda:{i} {torch.cuda.get_device_name(i)}') for i in range(torch.cuda.device_count())]")
    code, out, secs = _run([sys.executable, "-c", probe], limit)
    smi = shutil.which("nvidia-smi")
    if smi and gpus:
        out += _run([smi, "-L"], 30)[1]
    return {"status": "passed" if code == 0 else "failed", "seconds": secs, "detail": _tail(out)}


def missing_wheels(folder: Path = WHEELS) -> list[str]:
    """The carried distributions with no wheel in ``folder`` (all of them when it does not exist)."""
    have = {p.name.split("-")[0].lower().replace("_", "-") for p in folder.glob("*.whl")} if folder.is_dir() else set()
    return sorted(n for n in CARRIED if n.lower().replace("_", "-") not in have)


PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux_2_5_x86_64", "manylinux1_x86_64")


def fetch_wheels(folder: Path = WHEELS, python: str = "3.12") -> int:
    """Download the carried wheels for CPython ``python`` on x86-64 Linux into ``folder`` (`make gpu-wheels`).

    Each at the version this Python has installed where it has one (the versions the suite ran with), else
    the newest. Returns pip's exit code; prints the folder's size (a GPU machine takes at most 64 MiB).
    """
    from importlib import metadata

    def pinned(name):
        try:
            return f"{name}=={metadata.version(name)}"
        except metadata.PackageNotFoundError:
            return name
    folder.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
           python, "--implementation", "cp", "-d", str(folder)]
    cmd += [arg for plat in PLATFORMS for arg in ("--platform", plat)] + ["--platform", "any"]
    code = subprocess.call(cmd + [pinned(name) for name in CARRIED], cwd=ROOT)
    size = sum(p.stat().st_size for p in folder.glob("*.whl"))
    print(f"{folder}: {len(list(folder.glob('*.whl')))} wheels, {size / 2**20:.1f} MiB; "
          f"missing: {missing_wheels(folder) or 'none'}")
    return code or (1 if missing_wheels(folder) else 0)


def _importable(modules) -> list[str]:
    code, out, _ = _run([sys.executable, "-c", "import importlib.util as u, sys; "
                         "print(' '.join(m for m in sys.argv[1:] if u.find_spec(m) is None))", *modules], 60)
    return out.split() if code == 0 else list(modules)


def step_wheels(gpus: int, limit: float) -> dict:
    lacking = _importable([m for m in CARRIED.values() if m])
    absent = missing_wheels()
    if not lacking:
        note = f"every carried package is importable already; .whl/ lacks {len(absent)} of {len(CARRIED)} wheels"
        return {"status": "passed", "seconds": 0.0, "detail": note}
    if absent:
        return {"status": "skipped" if not gpus else "failed", "seconds": 0.0,
                "detail": f"this Python lacks {', '.join(lacking)} and .whl/ has no wheel of {', '.join(absent)}: "
                          "run `make gpu-wheels` where pip reaches an index, and carry .whl/"}
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
           "--no-cache-dir", "--upgrade", "--target", str(SITE), *map(str, sorted(WHEELS.glob("*.whl")))]
    code, out, secs = _run(cmd, limit)
    still = _importable([m for m in CARRIED.values() if m]) if code == 0 else lacking
    ok = code == 0 and not still
    return {"status": "passed" if ok else "failed", "seconds": secs,
            "detail": f"installed {len(list(WHEELS.glob('*.whl')))} wheels into {SITE}" if ok
            else _tail(out) + f"\nstill not importable: {still}"}


def gpu_marked_tests() -> list[str]:
    """``file::test`` of every test marked ``@pytest.mark.gpu`` in tests/ (read from the source: no import)."""
    import ast

    found = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            marks = [ast.unparse(d) for d in getattr(node, "decorator_list", [])]
            if isinstance(node, ast.FunctionDef) and any(m.startswith("pytest.mark.gpu") for m in marks):
                found.append(f"{path.relative_to(ROOT)}::{node.name}")
    return found


def step_gpu_tests(gpus: int, limit: float) -> dict:
    marked = gpu_marked_tests()
    if not gpus:  # collecting the whole suite imports all of it: minutes on a loaded 2-core machine
        code, out, secs = _run([sys.executable, "-m", "pytest", "--version"], limit)
        return {"status": "skipped" if code == 0 and marked else "failed", "seconds": secs,
                "detail": f"no GPU: {len(marked)} GPU-marked tests would run ({_tail(out, 1)}): "
                          + ", ".join(t.split("::")[1] for t in marked)}
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-n", "4",
           "--timeout", str(int(limit - 10)), *sorted({t.split("::")[0] for t in marked})]
    code, out, secs = _run(cmd, limit)
    return {"status": "passed" if code == 0 else "failed", "seconds": secs, "detail": _tail(out, 30)}


def step_doctor(gpus: int, limit: float) -> dict:
    if not gpus:
        code, out, secs = _run([sys.executable, "-m", "mgpu_lab", "doctor", "--help"], limit)
        return {"status": "skipped" if code == 0 else "failed", "seconds": secs,
                "detail": "no GPU: `mgpu-lab doctor` answers; its NCCL checks need a GPU\n" + _tail(out, 2)}
    code, out, secs = _run([sys.executable, "-m", "mgpu_lab", "doctor", "--nprocs", str(gpus)], limit)
    return {"status": "passed" if code == 0 else "failed", "seconds": secs, "detail": _tail(out, 40)}


KERNEL_CODE = """
import torch
from mgpu_lab import launch
def probe():
    import torch, torch.distributed as dist
    from mgpu_lab import dist as mdist
    t = torch.ones(1, device=mdist.device())
    dist.all_reduce(t)
    return dist.get_backend(), str(t.device), t.item()
if torch.cuda.is_available():
    torch.zeros(1, device="cuda")  # this kernel has touched CUDA: no fork of it may follow
    print("RESULT", launch(probe, 1, backend="nccl"))
print("RESULT", launch(probe, 2, backend="gloo"))
"""
# What each launch must print and return, with a GPU and without.
KERNEL_EXPECT = {True: ["launch: 1 rank · nccl · cuda:0", "launch: 2 ranks · gloo · cuda:0 shared by 2 ranks",
                        "RESULT [('nccl', 'cuda:0', 1.0)]", "RESULT [('gloo', 'cuda:0', 2.0), ('gloo', 'cuda:0', 2.0)]"],
                 False: ["launch: 2 ranks · gloo · cpu (no CUDA GPU visible",
                         "RESULT [('gloo', 'cpu', 2.0), ('gloo', 'cpu', 2.0)]"]}


def kernel_output(code: str, timeout: float) -> str:
    """Run ``code`` in a fresh Jupyter kernel (as a notebook cell runs) and return what it printed."""
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3", env=_env(), cwd=str(ROOT))
    out = []

    def keep(msg):
        content = msg["content"]
        if msg["msg_type"] == "stream":
            out.append(content["text"])
        elif msg["msg_type"] == "error":
            out.append("\n".join(content.get("traceback", [])))
    try:
        kc.execute_interactive(code, timeout=timeout, output_hook=keep)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    return "".join(out)


def step_kernel_launch(gpus: int, limit: float) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--kernel-child", str(limit - 15)]
    code, out, secs = _run(cmd, limit)
    missing = [line for line in KERNEL_EXPECT[bool(gpus)] if line not in out]
    ok = code == 0 and not missing
    return {"status": "passed" if ok else "failed", "seconds": secs,
            "detail": _tail(out, 15) + ("" if ok else f"\nmissing from the kernel's output: {missing}")}


def step_notebooks(gpus: int, limit: float) -> dict:
    paths = [f"solutions/{name}.ipynb" for name in NOTEBOOKS]
    absent = [p for p in paths if not (ROOT / p).exists()]
    if absent or not gpus:
        return {"status": "failed" if absent else "skipped", "seconds": 0.0,
                "detail": f"missing: {absent}" if absent else f"no GPU: would run {', '.join(paths)} under nbval"}
    cmd = [sys.executable, "-m", "pytest", "--nbval-lax", "-q", "-p", "no:cacheprovider", "-n", str(len(paths)),
           "--dist", "loadfile", "--timeout", str(int(limit - 10)), *paths]
    code, out, secs = _run(cmd, limit)
    return {"status": "passed" if code == 0 else "failed", "seconds": secs, "detail": _tail(out, 30)}


def step_figures(gpus: int, limit: float, out_dir: Path | None = None) -> dict:
    script = ROOT / "scripts" / "gpu_figures.py"
    dest = (out_dir or ROOT) / "figures.json"
    cmd = [sys.executable, str(script), "--out", str(dest)] + ([] if gpus else ["--list"])
    code, out, secs = _run(cmd, limit)
    figures = json.loads(dest.read_text()) if code == 0 and gpus and dest.exists() else None
    status = ("passed" if gpus else "skipped") if code == 0 else "failed"
    return {"status": status, "seconds": secs, "detail": _tail(out, 30), "figures": figures}


STEPS = {"environment": step_environment, "wheels": step_wheels, "gpu-tests": step_gpu_tests,
         "doctor": step_doctor, "kernel-launch": step_kernel_launch, "notebooks": step_notebooks,
         "figures": step_figures}


def run_checks(out_dir: Path, gpus: int, budget: float = BUDGET_S) -> dict:
    """Run every check in order within ``budget`` seconds; return the report (also written to ``out_dir``)."""
    start = time.monotonic()
    report = {"gpus": gpus, "mode": "gpu" if gpus else "quick (no GPU)", "python": sys.version.split()[0],
              "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "checks": []}
    for name, needs_gpu, limit in CHECKS:
        left = budget - (time.monotonic() - start)
        if left < 20:
            result = {"status": "not run", "seconds": 0.0, "detail": f"out of time ({budget:.0f} s budget spent)"}
        else:
            kwargs = {"out_dir": out_dir} if name == "figures" else {}
            try:
                result = STEPS[name](gpus, min(limit, left), **kwargs)
            except Exception as err:  # a broken step is a failed check, and the report is still written
                result = {"status": "failed", "seconds": 0.0, "detail": f"{type(err).__name__}: {err}"}
        report["checks"].append({"name": name, "needs_gpu": needs_gpu, **result})
        print(f"gpu-check: {name:14s} {result['status']:8s} {result['seconds']:6.1f} s", flush=True)
    report["seconds"] = round(time.monotonic() - start, 1)
    write_report(report, out_dir)
    return report


def summary(report: dict) -> str:
    counts = {}
    for check in report["checks"]:
        counts[check["status"]] = counts.get(check["status"], 0) + 1
    head = f"no GPU: {counts.get('skipped', 0)} checks skipped; " if not report["gpus"] else ""
    return head + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) + f" in {report['seconds']} s"


def write_report(report: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    report["summary"] = summary(report)
    (out_dir / "report.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    lines = [f"mgpu-lab gpu-check: {report['mode']}, {report['gpus']} GPU(s), python {report['python']}, "
             f"{report['started']}", report["summary"], ""]
    for check in report["checks"]:
        lines.append(f"== {check['name']}: {check['status']} ({check['seconds']:.1f} s)")
        lines += ["   " + line for line in str(check["detail"]).splitlines()]
    (out_dir / "report.txt").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "gpu-check-report", help="where the report goes")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for all checks (default 480)")
    parser.add_argument("--fetch-wheels", action="store_true", help="download the wheels a GPU machine lacks into .whl/")
    parser.add_argument("--kernel-child", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.kernel_child is not None:  # the kernel-launch step's own process
        print(kernel_output(KERNEL_CODE, args.kernel_child))
        return 0
    if args.fetch_wheels:
        return fetch_wheels()
    gpus = gpu_count()
    report = run_checks(args.out, gpus, args.budget)
    print(report["summary"])
    print(f"report: {args.out / 'report.json'} and {args.out / 'report.txt'}")
    return 1 if any(c["status"] == "failed" for c in report["checks"]) else 0


if __name__ == "__main__":
    sys.exit(main())

"""Running real ``torchrun`` from a notebook, a test or a check, and reading what it says.

``torchrun`` (``python -m torch.distributed.run``) starts an agent that starts
the workers, watches them and, with ``--max-restarts=N``, stops and restarts
the whole worker group up to N times when one of them fails. Every worker of
a restart gets the same ``RANK`` and ``WORLD_SIZE`` again (on one node) and
``TORCHELASTIC_RESTART_COUNT`` tells it which attempt it is.

- :func:`torchrun_argv` builds the command; :func:`run` runs it with a time
  limit, showing its output live and keeping it;
- :func:`call` runs a Python function (a notebook's, shipped by value) in every
  worker of a real torchrun job and returns each rank's result;
- :func:`failure_summary` picks torchrun's error summary out of its output.

``fork=True`` adds ``--run-path --start-method=fork``: the workers are forked
from the agent, which has imported torch already, instead of starting Python
and importing torch again (about 3 s of CPU each on this machine). The agent,
its restarts and the variables are the same; a cluster does not need it.
The workers share the agent's output: a line written in one call stays whole
(``print('rank', r)`` writes its pieces one by one, and two workers' pieces can
interleave).

Example:
    >>> script = os.path.join(tempfile.mkdtemp(), "hello.py")
    >>> line = "sys.stdout.write('rank %s of %s' % (os.environ['RANK'], os.environ['WORLD_SIZE']) + chr(10))"
    >>> with open(script, "w") as f:
    ...     _ = f.write("import os, sys; " + line)
    >>> result = run(torchrun_argv(script, nproc=2, fork=True), echo=False)
    >>> result.returncode, sorted(result.lines("rank [0-9] of 2"))
    (0, ['rank 0 of 2', 'rank 1 of 2'])
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import cloudpickle

from mgpu_lab.core import procenv
from mgpu_lab.launcher import pickling

__all__ = ["torchrun_argv", "run", "call", "failure_summary", "Result", "WORKER", "STORE_PER_ATTEMPT"]

#: One rendezvous store per attempt. With the agent's store shared by every attempt (torch's default),
#: restarted workers failed here in gloo's connection set-up ("Connection refused") on a loaded machine.
STORE_PER_ATTEMPT = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}

#: The script that runs a pickled function in every torchrun worker (see :func:`call`).
WORKER = Path(__file__).resolve().parent / "torchrun_worker.py"
_RESULT = "rank{}.pkl"


@dataclass
class Result:
    """What a torchrun command did: its exit code, its complete output and how long it took."""

    argv: list[str]
    returncode: int | None  # None: stopped at the time limit
    output: str
    seconds: float

    def lines(self, pattern: str) -> list[str]:
        """The output lines that match a regular expression."""
        return [ln for ln in self.output.splitlines() if re.search(pattern, ln)]


def torchrun_argv(script, *script_args, nproc: int = 2, max_restarts: int = 0, fork: bool = False,
                  log_dir: str | None = None, extra: tuple = ()) -> list[str]:
    """``python -m torch.distributed.run --standalone --nproc-per-node=N --max-restarts=R ... script args``.

    Args:
        script: the training script. nproc: workers on this node.
        max_restarts: how often torchrun may restart the worker group after a failure.
        fork: fork the workers from the agent (see the module docstring).
        log_dir: torchrun's ``--log-dir`` (it keeps every attempt's ``error.json`` there).
        extra: more torchrun options, placed before the script.
    """
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}", "--monitor-interval=0.1"]
    argv += ["--run-path", "--start-method=fork"] if fork else []
    argv += [f"--log-dir={log_dir}"] if log_dir else []
    return argv + list(extra) + [str(Path(script).resolve()) if fork else str(script), *map(str, script_args)]


def _env(extra: dict | None) -> dict:
    # A command started from inside a rank must not look like one; one intra-op thread per worker.
    return procenv.child_env({"OMP_NUM_THREADS": "1", **(extra or {})})


def run(argv: list[str], *, env: dict | None = None, timeout: float = 180.0, echo: bool = True,
        show=None, cwd=None) -> Result:
    """Run a command (e.g. :func:`torchrun_argv`'s), its output live in the cell; stop it at ``timeout``.

    Args:
        env: variables added to this process's environment (OMP_NUM_THREADS=1, and
            the package on PYTHONPATH, so its workers import this ``mgpu_lab``).
        echo: print the output lines as they come.
        show: a function of a line returning the text to print (None: skip it); default every line.
        cwd: its working directory.

    Returns:
        A :class:`Result`; nothing it started is left running.
    """
    start = time.monotonic()
    lines: list[str] = []
    # torchrun leaves a log folder (torchelastic_*) and error files in the temp dir: this run's own, removed after it
    with tempfile.TemporaryDirectory(prefix="mgpu-lab-run-", ignore_cleanup_errors=True) as tmp:
        proc = subprocess.Popen(argv, env=_env({"TMPDIR": tmp, **(env or {})}), cwd=cwd, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)
        timer = _Timer(timeout, proc)
        try:
            for line in proc.stdout:
                line = line.rstrip("\n")
                lines.append(line)
                shown = show(line) if show else line
                if echo and shown is not None:
                    print(shown, flush=True)
            proc.wait()
        finally:
            timer.cancel()
            _kill_group(proc)
    code = None if timer.fired else proc.returncode
    return Result(list(argv), code, "\n".join(lines), time.monotonic() - start)


def _kill_group(proc: subprocess.Popen) -> None:
    # The command runs in a session of its own: agent, workers and their children go together.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


class _Timer:
    def __init__(self, timeout, proc):
        import threading

        self.fired = False
        self._t = threading.Timer(timeout, self._fire, (proc,))
        self._t.daemon = True
        self._t.start()

    def _fire(self, proc):
        self.fired = True
        _kill_group(proc)

    def cancel(self):
        self._t.cancel()


def call(fn, nproc: int, *args, max_restarts: int = 0, timeout: float = 180.0, env: dict | None = None,
         echo: bool = False, fork: bool = True, **kwargs) -> tuple[list | None, Result]:
    """Run ``fn(*args, **kwargs)`` in every worker of a real torchrun job; ``(results, Result)``.

    ``fn`` travels by value (cloudpickle), so a function defined in a notebook
    cell works. Restarts use one rendezvous store per attempt (:data:`STORE_PER_ATTEMPT`). Each worker
    initialises the process group (:func:`mgpu_lab.dist.setup`), runs ``fn`` and writes its return value;
    ``results`` lists them in rank order, or is None when the job failed.

    Example:
        >>> import torch.distributed
        >>> results, run_ = call(lambda: torch.distributed.get_rank(), 2, echo=False, fork=True)
        >>> results, run_.returncode
        ([0, 1], 0)
    """
    work = tempfile.mkdtemp(prefix="mgpu-lab-torchrun-")
    try:
        payload = os.path.join(work, "payload.pkl")
        with open(payload, "wb") as f:
            pickling.dump((fn, args, kwargs), f)
        result = run(torchrun_argv(WORKER, payload, work, nproc=nproc, max_restarts=max_restarts, fork=fork),
                     env={**STORE_PER_ATTEMPT, **(env or {})}, timeout=timeout, echo=echo)
        files = [os.path.join(work, _RESULT.format(r)) for r in range(nproc)]
        if result.returncode != 0 or not all(os.path.exists(p) for p in files):
            return None, result
        values = []
        for path in files:
            with open(path, "rb") as f:
                values.append(cloudpickle.load(f))
        return values, result
    finally:
        shutil.rmtree(work, ignore_errors=True)


def failure_summary(output: str) -> list[str]:
    """torchrun's error summary (the block after ``ChildFailedError``), its log prefixes removed."""
    lines = output.splitlines()
    start = next((i for i, ln in enumerate(lines) if "ChildFailedError" in ln), None)
    if start is None:
        return []
    out = []
    for ln in lines[start:]:
        out.append(re.sub(r"^[EWI]\d{4} [\d:.]+ \d+ \S+:\d+\] ", "", ln))
    return out

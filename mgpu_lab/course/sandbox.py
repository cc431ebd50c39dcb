"""Each submission in its own sandbox: a user, a directory, an environment, limits, namespaces.

The grader runs nothing of a submission itself. Everything the submission's
code touches runs in a :class:`Sandbox`:

- **its own user** when the grader is root (``nobody``, or
  ``MGPU_LAB_SANDBOX_USER``): it cannot write the grader's files, other
  submissions or the course code, nor read root's;
- **its own directory**, which is its ``/tmp`` and holds its HOME; ``/var/tmp``,
  ``/dev/shm`` and ``/run/lock`` (the other places anyone may write) are fresh
  and private, gone with it;
- **its own root** (a mount namespace): the system's programs, libraries and
  configuration, and read-only the Python the grader runs, its environment and
  the ``mgpu_lab`` package directory; nothing else of this machine's files (no
  home folder, no project clone around the package, no other submission, no
  kept grade), whatever their permissions;
- **an allow-listed environment** (:data:`ENV_KEEP` plus what the grader sets):
  nothing else of the grader's environment, secrets included, goes in;
- **resource limits** (:class:`~mgpu_lab.course.isolation.Limits`): address
  space per process (not where an NVIDIA driver is loaded), processes and
  threads of the sandbox user, file size, CPU time per process;
- **namespaces** (``unshare``): a network namespace with only the loopback
  interface up (ranks and the Jupyter kernel need 127.0.0.1; nothing else is
  reachable), a mount and an IPC namespace, and a PID namespace, so that
  whatever the submission starts (``setsid``, double forks, fork bombs) dies
  with it (``unshare --kill-child``; the grader dying kills it too).

What the sandbox cannot give where the grader is not root: without root there
is no other user (the submission runs as the grader's user, and the process
limit is not set, since it would count the grader's own processes); without
``unshare`` (or user namespaces) there are no namespaces: the network is
reachable, the file system is the grader's, and a process that leaves the
sandbox's session survives it. Memory is limited per process (address space),
not summed over the sandbox's processes, and the directory's total size is not
limited (only each file's). :func:`~mgpu_lab.course.isolation.protections` says
which protections this machine gives, once per run, in the report.

Example:
    >>> with Sandbox() as box:
    ...     proc = box.start([sys.executable, "-c", "print(1)"])
    ...     proc.wait()
    0
"""
from __future__ import annotations

import dataclasses
import json
import os
import pwd
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import psutil

from mgpu_lab.core import libc, procenv

from .isolation import ENV_KEEP, UNSHARE, Limits, Protections, protections, slot_user

__all__ = ["Limits", "Protections", "protections", "Sandbox", "ENV_KEEP", "self_test"]


def _python_paths() -> list[str]:
    """What the sandbox user must be able to read to run this Python and this package: the package's own
    directory, not the folder that holds it (a clone's solutions/, tests/ and .git stay out)."""
    package = os.path.join(procenv.package_root(), "mgpu_lab")
    paths = {sys.prefix, sys.base_prefix, os.path.dirname(os.path.realpath(sys.executable)), package}
    paths |= {p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
              if p and not _holds(os.path.realpath(p), package)}
    return sorted({os.path.realpath(p) for p in paths})


def _holds(folder: str, path: str) -> bool:
    """Whether ``path`` lies inside ``folder`` (a PYTHONPATH entry that holds the package: its clone)."""
    return os.path.realpath(path).startswith(folder.rstrip("/") + "/")


def _die_with_grader() -> None:  # runs in the child between fork and exec (libc is loaded already)
    libc.prctl(libc.PR_SET_PDEATHSIG, signal.SIGKILL)  # no sandbox outlives its grader


class Sandbox:
    """A directory and the means to run commands closed in with it; a context manager.

    Args:
        limits: resource limits (default :class:`Limits`).
        env: variables to add to the allow-listed environment of every command.
        slot: which of the sandboxes that run at once this is: each slot has a
            user of its own (:func:`~mgpu_lab.course.isolation.slot_user`).

    Attributes:
        work: the sandbox's directory on this machine.
        inside: the same directory as commands in the sandbox see it (``/tmp``
            with namespaces).
    """

    def __init__(self, limits: Limits | None = None, env: dict | None = None, slot: int = 0):
        self.limits = limits or Limits()
        self.prot = protections()
        user, uid, gid = slot_user(slot)
        if uid != self.prot.uid:
            self.prot = dataclasses.replace(self.prot, user=user, uid=uid, gid=gid)
        self.base = Path(tempfile.mkdtemp(prefix="mgpu-grade-"))
        self.work = self.base / "work"
        self.work.mkdir(mode=0o700)
        self.inside = "/tmp" if self.prot.namespaces else str(self.work)
        if self.prot.uid is not None:
            os.chown(self.work, self.prot.uid, self.prot.gid)
        if not self.prot.namespaces:
            os.chmod(self.base, 0o711)  # the sandbox user reaches its directory by its host path
        self.env = {k: os.environ[k] for k in ENV_KEEP if k in os.environ}
        # The sandbox runs the grader's own mgpu_lab, wherever the grader found it (even the current folder).
        self.env["PYTHONPATH"] = os.pathsep.join([procenv.package_root(), *filter(None, [self.env.get("PYTHONPATH")])])
        self.env.update(HOME=f"{self.inside}/home", TMPDIR=self.inside, USER=self.prot.user or "grader",
                        PYTHONNOUSERSITE="1", PYTHONDONTWRITEBYTECODE="1", MPLBACKEND="agg",
                        JUPYTER_PLATFORM_DIRS="1", **(env or {}))
        self.env.setdefault("PATH", "/usr/bin:/bin")
        self._procs: list[subprocess.Popen] = []

    def put(self, name: str, data: bytes) -> None:
        """Write a file (a single name) into the sandbox's directory, owned by its user."""
        path = self.work / name
        path.write_bytes(data)
        if self.prot.uid is not None:
            os.chown(path, self.prot.uid, self.prot.gid)

    def start(self, argv: list[str], *, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
              stderr=subprocess.DEVNULL, pass_fds=(), env: dict | None = None) -> subprocess.Popen:
        """Start ``argv`` (absolute program path) in the sandbox; its fds 0-2 and ``pass_fds`` only."""
        cfg = {"work": str(self.work), "netns": self.prot.namespaces, "mountns": self.prot.namespaces,
               "expose": _python_paths(), "shm_size": self.limits.shm, "uid": self.prot.uid,
               "gid": self.prot.gid, "cwd": self.inside,
               "limits": {k: v for k, v in asdict(self.limits).items() if k != "shm"
                          and (k != "processes" or self.prot.user) and (k != "memory" or not self.prot.cuda)}}
        command = [sys.executable, "-P", "-s", "-m", "mgpu_lab.course.sandbox_init", json.dumps(cfg), "--", *argv]
        if self.prot.namespaces:
            command = [shutil.which("unshare"), *(["--user", "--map-root-user"] if self.prot.userns else []),
                       *UNSHARE, *command]
        proc = subprocess.Popen(command, stdin=stdin, stdout=stdout, stderr=stderr, pass_fds=pass_fds,
                                env={**self.env, **(env or {})}, cwd="/", start_new_session=True,
                                preexec_fn=_die_with_grader)
        self._procs.append(proc)
        return proc

    def kill(self, proc: subprocess.Popen, wait: float = 10.0) -> None:
        """End ``proc`` and everything it started: with namespaces, its PID namespace dies with it."""
        try:
            family = psutil.Process(proc.pid).children(recursive=True)
        except psutil.Error:
            family = []
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # its session: all there is without namespaces
            except ProcessLookupError:
                pass
        for p in family:
            try:
                p.kill()
            except psutil.Error:
                pass
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            pass
        psutil.wait_procs(family, timeout=wait)

    def read(self, relpath: str, limit: int) -> bytes | None:
        """A regular file of the sandbox's directory, at most ``limit`` bytes; None if there is none.

        Symbolic links, FIFOs, devices and directories are refused at every step
        (the submission wrote the directory), so the grader only ever reads the
        submission's own files and never blocks.

        Raises:
            ValueError: the file is larger than ``limit``.
        """
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(self.work, flags | os.O_DIRECTORY)
        except OSError:
            return None
        try:
            parts = relpath.split("/")
            for part in parts[:-1]:
                nxt = os.open(part, flags | os.O_DIRECTORY, dir_fd=fd)
                os.close(fd)
                fd = nxt
            leaf = os.open(parts[-1], flags | os.O_NONBLOCK, dir_fd=fd)
        except OSError:
            return None
        finally:
            os.close(fd)
        try:
            if not stat.S_ISREG(os.fstat(leaf).st_mode):
                return None
            data = os.read(leaf, limit + 1)
            while len(data) <= limit and (more := os.read(leaf, limit + 1 - len(data))):
                data += more
        finally:
            os.close(leaf)
        if len(data) > limit:
            raise ValueError(f"{relpath} is larger than {limit} bytes")
        return data

    def close(self) -> None:
        """Kill every command still running and delete the directory (safe twice)."""
        for proc in self._procs:
            self.kill(proc)
        self._procs.clear()
        if self.base.exists():
            shutil.rmtree(self.base, onerror=_force)

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_SELF_TEST = "import torch, mgpu_lab.course.checks"


def self_test(timeout: float = 120.0) -> tuple[bool, str]:
    """Start a sandbox as ``mgpu-lab grade`` does and import torch and ``mgpu_lab`` in it.

    Returns:
        (passed, report): ``OK`` with the user it ran as and, in one line, what
        sandboxes cannot get here (e.g. without root); or ``FAILED`` with the
        sandbox's own words and the fix.
    """
    prot = protections()
    try:
        with Sandbox() as box:
            proc = box.start([sys.executable, "-c", _SELF_TEST], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            try:
                out, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                return False, f"FAILED: a sandboxed Python did not import torch within {timeout:g} s"
    except OSError as exc:
        return False, f"FAILED: could not make a sandbox: {exc}"
    if proc.returncode != 0:
        words = err.decode(errors="replace").strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
        return False, (f"FAILED: a sandboxed Python could not import torch and mgpu_lab: {words[0]}; grading "
                       "needs the Python, its environment and the project readable by the sandbox user")
    user = prot.user or f"the grader's own user ({pwd.getpwuid(os.getuid()).pw_name})"
    lacks = f"; not had here: {'; '.join(prot.missing)}" if prot.missing else ""
    return True, f"OK: submissions run as {user}, {'in namespaces' if prot.namespaces else 'with no namespaces'}{lacks}"


def _force(func, path, _exc_info) -> None:
    """rmtree's retry for what the submission made unreadable (as the grader's own user)."""
    try:
        os.chmod(os.path.dirname(path), 0o700)
        if os.path.isdir(path) and not os.path.islink(path):
            os.chmod(path, 0o700)
            shutil.rmtree(path, ignore_errors=True)
        else:
            func(path)
    except OSError:
        pass

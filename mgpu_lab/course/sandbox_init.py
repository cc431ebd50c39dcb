"""The first process inside a grading sandbox: close it in, drop privileges, start the runner.

:class:`mgpu_lab.course.sandbox.Sandbox` starts this module under ``unshare``
(new PID, network and mount namespaces) as ``python -P -s -m
mgpu_lab.course.sandbox_init CONFIG -- ARGV...`` with the current directory
``/`` and an allow-listed environment. Still privileged inside the namespaces,
it

1. brings the loopback interface up (ranks and the Jupyter kernel talk over
   127.0.0.1; the new network namespace has nothing else),
2. makes the submission's directory the sandbox's ``/tmp`` (its only writable
   place besides fresh, size-limited ``/var/tmp`` and ``/dev/shm``), puts
   a fresh tmpfs over directories the sandbox user could not enter (``/root``
   here, a ``0700`` home folder), and binds back, read-only, what the graded
   kernel needs (the interpreter, its environment, the project), wherever it
   lies (under ``/tmp`` too),
3. sets the resource limits, drops to the sandbox user (root only: setgroups,
   setgid, setuid) with ``no_new_privs``, and
4. replaces itself with ``ARGV`` in ``/tmp``.

No submission code has run when this module runs: the submission's files are
never on its import path (``-P``, current directory ``/``). Any step that fails
ends the sandbox with exit code 97 and the reason on stderr.
"""
from __future__ import annotations

import fcntl
import json
import os
import resource
import signal
import socket
import struct
import sys

from mgpu_lab.core import libc
from mgpu_lab.core.libc import (MS_BIND, MS_NOATIME, MS_NODEV, MS_NODIRATIME, MS_NOEXEC, MS_NOSUID, MS_PRIVATE,
                                 MS_RDONLY, MS_REC, MS_RELATIME, MS_REMOUNT, mount)

EXIT_SETUP = 97
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1
_LIMITS = {"memory": resource.RLIMIT_AS, "processes": resource.RLIMIT_NPROC,
           "file_size": resource.RLIMIT_FSIZE, "cpu_time": resource.RLIMIT_CPU}


def loopback_up() -> None:
    """Bring ``lo`` up in this (new) network namespace."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s, _SIOCGIFFLAGS, req))[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | _IFF_UP))


PRIVATE = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")  # every place anyone may write: fresh in the sandbox
# statvfs flag -> mount flag: a read-only remount must keep these, or a user namespace refuses it (EPERM).
_KEEP_FLAGS = {2: MS_NOSUID, 4: MS_NODEV, 8: MS_NOEXEC, 1024: MS_NOATIME, 2048: MS_NODIRATIME,
               4096: MS_RELATIME}


def _under(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def _blocked_ancestor(path: str) -> str | None:
    """The first directory on the way to ``path`` that others may not enter, if any."""
    here = "/"
    for part in path.strip("/").split("/"):
        if not os.stat(here).st_mode & 0o001:
            return here
        here = os.path.join(here, part)
    return None


def _needed(paths: list[str]) -> list[str]:
    """The existing ``paths`` to bind back, without those inside another.

    ``/`` and the folders that hold a private place (``/var``) stay visible as
    they are, so they need no binding.

    Raises:
        OSError: a path is one of the private places itself (binding it would hide the sandbox's own).
    """
    found = sorted({os.path.realpath(p) for p in paths if p and os.path.exists(p)})
    for path in found:
        if path in PRIVATE:
            raise OSError(f"{path} is needed in the sandbox, where {path} is private: install Python, the "
                          f"virtual environment and the project in a folder of their own (e.g. {path}/NAME)")
    found = [p for p in found if not any(_under(top, p) for top in PRIVATE)]
    return [p for p in found if not any(q != p and _under(p, q) for q in found)]


def _mountpoint(path: str) -> int:
    """An O_PATH descriptor of the directory ``path``, made where missing; no symbolic link followed."""
    fd = os.open("/", os.O_PATH | os.O_DIRECTORY)
    try:
        for part in path.strip("/").split("/"):
            try:
                nxt = os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except FileNotFoundError:
                os.mkdir(part, 0o755, dir_fd=fd)
                nxt = os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = nxt
    except OSError as exc:
        os.close(fd)
        raise OSError(exc.errno, f"cannot make {path} a mount point: {exc.strerror}") from None
    return fd


def expose(paths: list[str], work: str, shm_size: str) -> None:
    """Close the file system in, keeping ``paths`` (the Python, its environment, the project) readable.

    ``work`` becomes ``/tmp`` and the other :data:`PRIVATE` places fresh tmpfs; a
    tmpfs goes over each directory others may not enter (e.g. ``/root`` of a
    pyenv Python, a ``0700`` home folder), hiding what else it holds. Then every
    needed path, wherever it was (under ``/tmp`` too), is bound back at its
    place, read-only, from a descriptor opened before anything was hidden.
    """
    needed = _needed(paths)
    sources = {p: os.open(p, os.O_PATH) for p in needed}  # reachable after the mounts below hide them
    mount("none", "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates to the host
    blockers = {b for p in needed if (b := _blocked_ancestor(p)) not in (None, "/")
                and not any(_under(b, top) for top in PRIVATE)}
    for blocker in sorted(blockers):
        mount("tmpfs", blocker, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
    private_dirs(work, shm_size)
    for path, src in sources.items():
        target = _mountpoint(path)
        try:
            mount(f"/proc/self/fd/{src}", f"/proc/self/fd/{target}", None, MS_BIND | MS_REC)
        finally:
            os.close(target)
            os.close(src)
        kept = sum(m for f, m in _KEEP_FLAGS.items() if os.statvfs(path).f_flag & f)
        mount("none", path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | kept)


def private_dirs(work: str, shm_size: str) -> None:
    """``work`` becomes ``/tmp``; ``/var/tmp``, ``/dev/shm`` and ``/run/lock`` become fresh tmpfs."""
    mount(work, "/tmp", None, MS_BIND)
    for target in PRIVATE[1:]:
        if os.path.isdir(target):
            mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size={shm_size}")


def set_limits(limits: dict) -> None:
    """Soft and hard limits for this process and everything it starts; core dumps off."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    for name, value in limits.items():
        if value:
            resource.setrlimit(_LIMITS[name], (int(value), int(value)))


def drop(uid: int, gid: int) -> None:
    """Become ``uid``/``gid`` for good (no supplementary groups), and never gain privileges again."""
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    if os.getuid() != uid or os.geteuid() != uid:
        raise OSError(f"still uid {os.getuid()} after setresuid({uid})")
    # A change of user clears the parent-death signal (unshare --kill-child's, or the grader's without
    # namespaces): set it again, or a grader killed while the submission runs leaves the sandbox behind.
    libc.prctl(libc.PR_SET_PDEATHSIG, signal.SIGKILL, "prctl(PR_SET_PDEATHSIG)")


def no_new_privs() -> None:
    libc.prctl(libc.PR_SET_NO_NEW_PRIVS, 1, "prctl(PR_SET_NO_NEW_PRIVS)")


def main(argv: list[str]) -> int:
    """``CONFIG -- ARGV...``: close the sandbox as CONFIG (JSON) says, then exec ARGV."""
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m mgpu_lab.course.sandbox_init CONFIG -- ARGV...", file=sys.stderr)
        return 2
    cfg, command = json.loads(argv[0]), argv[2:]
    step = "start"
    try:
        if cfg.get("netns"):
            step = "bring the loopback interface up"
            loopback_up()
        if cfg.get("mountns"):
            step = "mount the private directories"
            expose(cfg.get("expose", []), cfg["work"], cfg.get("shm_size", "256m"))
        step = "set the resource limits"
        set_limits(cfg.get("limits", {}))
        if cfg.get("uid") is not None:
            step = f"drop to uid {cfg['uid']}"
            drop(cfg["uid"], cfg["gid"])
        step = "set no_new_privs"
        no_new_privs()
        step = "enter the sandbox's directory"
        os.chdir(cfg.get("cwd", cfg["work"]))
        step = f"start {command[0]}"
        os.execve(command[0], command, os.environ)
    except Exception as exc:  # noqa: BLE001 - a sandbox that cannot close must not run
        print(f"sandbox: could not {step}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return EXIT_SETUP
    return EXIT_SETUP  # pragma: no cover (execve does not return)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

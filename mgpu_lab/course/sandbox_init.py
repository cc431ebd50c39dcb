"""The first process inside a grading sandbox: close it in, drop privileges, start the runner.

:class:`mgpu_lab.course.sandbox.Sandbox` starts this module under ``unshare``
(new PID, network and mount namespaces) as ``python -P -s -m
mgpu_lab.course.sandbox_init CONFIG -- ARGV...`` with the current directory
``/`` and an allow-listed environment. Still privileged inside the namespaces,
it

1. brings the loopback interface up (ranks and the Jupyter kernel talk over
   127.0.0.1; the new network namespace has nothing else),
2. makes the submission's directory the sandbox's ``/tmp`` (its only writable
   place besides fresh, size-limited ``/var/tmp`` and ``/dev/shm``), and puts
   a fresh tmpfs over directories the sandbox user could not enter (``/root``
   here), bringing back only what Python needs from below them,
3. sets the resource limits, drops to the sandbox user (root only: setgroups,
   setgid, setuid) with ``no_new_privs``, and
4. replaces itself with ``ARGV`` in ``/tmp``.

No submission code has run when this module runs: the submission's files are
never on its import path (``-P``, current directory ``/``). Any step that fails
ends the sandbox with exit code 97 and the reason on stderr.
"""
from __future__ import annotations

import ctypes
import fcntl
import json
import os
import resource
import socket
import struct
import sys

EXIT_SETUP = 97
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_BIND, _MS_REC, _MS_PRIVATE = 1, 2, 4, 4096, 16384, 1 << 18
_PR_SET_NO_NEW_PRIVS = 38
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1
_LIMITS = {"memory": resource.RLIMIT_AS, "processes": resource.RLIMIT_NPROC,
           "file_size": resource.RLIMIT_FSIZE, "cpu_time": resource.RLIMIT_CPU}
_libc = ctypes.CDLL(None, use_errno=True)


def _mount(source: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    if _libc.mount(source.encode(), target.encode(), fstype.encode() if fstype else None, flags,
                   data.encode() if data else None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")


def loopback_up() -> None:
    """Bring ``lo`` up in this (new) network namespace."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s, _SIOCGIFFLAGS, req))[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | _IFF_UP))


def _blocked_ancestor(path: str) -> str | None:
    """The first directory on the way to ``path`` that others may not enter, if any."""
    here = "/"
    for part in path.strip("/").split("/"):
        if not os.stat(here).st_mode & 0o001:
            return here
        here = os.path.join(here, part)
    return None


def expose(paths: list[str]) -> None:
    """Make ``paths`` reachable for the sandbox user, hiding what else their closed parents hold.

    A tmpfs goes over each directory others may not enter (e.g. ``/root`` of a
    pyenv Python), and each needed path is bind-mounted back at its place.
    """
    by_blocker: dict[str, list[str]] = {}
    for path in paths:
        if os.path.exists(path) and (blocker := _blocked_ancestor(path)) not in (None, "/"):
            by_blocker.setdefault(blocker, []).append(path)
    for blocker, inside in by_blocker.items():
        fds = {p: os.open(p, os.O_PATH) for p in inside}  # reachable after the tmpfs hides them
        _mount("tmpfs", blocker, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=0755,size=1m")
        for p, fd in fds.items():
            os.makedirs(p, mode=0o755, exist_ok=True)
            _mount(f"/proc/self/fd/{fd}", p, None, _MS_BIND | _MS_REC)
            os.close(fd)


def private_dirs(work: str, shm_size: str) -> None:
    """``work`` becomes ``/tmp``; ``/var/tmp``, ``/dev/shm`` and ``/run/lock`` become fresh tmpfs."""
    _mount("none", "/", None, _MS_REC | _MS_PRIVATE)  # nothing below propagates to the host
    _mount(work, "/tmp", None, _MS_BIND)
    for target in ("/var/tmp", "/dev/shm", "/run/lock"):  # every other place anyone may write
        if os.path.isdir(target):
            _mount("tmpfs", target, "tmpfs", _MS_NOSUID | _MS_NODEV, f"mode=1777,size={shm_size}")


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


def no_new_privs() -> None:
    if _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")


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
            expose(cfg.get("expose", []))
            private_dirs(cfg["work"], cfg.get("shm_size", "256m"))
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

"""The first process inside a grading sandbox: close it in, drop privileges, start the runner.

:class:`mgpu_lab.course.sandbox.Sandbox` starts this module under ``unshare``
(new PID, network, IPC, UTS and mount namespaces) as ``python -P -s -m
mgpu_lab.course.sandbox_init CONFIG -- ARGV...`` with the current directory
``/`` and an allow-listed environment. Still privileged inside the namespaces,
it

1. brings the loopback interface up (ranks and the Jupyter kernel talk over
   127.0.0.1; the new network namespace has nothing else) and takes the host
   name ``localhost`` (new UTS namespace): torchrun gives its workers the host's
   name, which on a cluster node names an address the sandbox does not have,
2. builds a new root (:func:`expose`) holding only the system's programs,
   libraries and configuration, ``/dev``, ``/proc`` and ``/sys``, and, read-only,
   what the graded kernel needs (the interpreter, its environment, the
   ``mgpu_lab`` package directory: never the clone around it), wherever it
   lies; the submission's directory is its ``/tmp`` (its only writable place
   besides fresh, size-limited ``/var/tmp``, ``/dev/shm`` and ``/run/lock``),
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
from mgpu_lab.core.libc import (MNT_DETACH, MS_BIND, MS_NOATIME, MS_NODEV, MS_NODIRATIME, MS_NOEXEC, MS_NOSUID,
                                 MS_PRIVATE, MS_RDONLY, MS_REC, MS_RELATIME, MS_REMOUNT, mount, umount2)

EXIT_SETUP = 97
HOSTNAME = "localhost"  # the sandbox's own (UTS namespace): it resolves to 127.0.0.1, whatever the machine is called
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
# What a new root holds of the system, read-only: programs, libraries, configuration (host names, users).
SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
KERNEL = ("/dev", "/proc", "/sys")  # devices (/dev/shm private), this PID namespace's processes, sysfs (read-only)
# statvfs flag -> mount flag: a read-only remount must keep these, or a user namespace refuses it (EPERM).
_KEEP_FLAGS = {2: MS_NOSUID, 4: MS_NODEV, 8: MS_NOEXEC, 1024: MS_NOATIME, 2048: MS_NODIRATIME,
               4096: MS_RELATIME}


def _under(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def _needed(paths: list[str]) -> list[str]:
    """The existing ``paths`` to bind into the new root, without those inside another or inside
    :data:`SYSTEM` (bound whole).

    Raises:
        OSError: a path is one of the private places itself (binding it would hide the sandbox's own).
    """
    found = sorted({os.path.realpath(p) for p in paths if p and os.path.exists(p)})
    for path in found:
        if path in PRIVATE:
            raise OSError(f"{path} is needed in the sandbox, where {path} is private: install Python, the "
                          f"virtual environment and the project in a folder of their own (e.g. {path}/NAME)")
    found = [p for p in found if not any(_under(top, p) for top in PRIVATE + SYSTEM)]
    found = [p for p in found if not any(_under(p, top) for top in SYSTEM)]
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


def _bind(src: int, path: str, readonly: bool) -> None:
    """Bind the directory open at ``src`` (with what is mounted below it) on ``path``, read-only if asked."""
    target = _mountpoint(path)
    try:
        mount(f"/proc/self/fd/{src}", f"/proc/self/fd/{target}", None, MS_BIND | MS_REC)
    finally:
        os.close(target)
        os.close(src)
    if readonly:
        kept = sum(m for f, m in _KEEP_FLAGS.items() if os.statvfs(path).f_flag & f)
        mount("none", path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | kept)


def expose(paths: list[str], work: str, shm_size: str) -> None:
    """Make a new root holding only the system (:data:`SYSTEM`, :data:`KERNEL`), ``paths`` and the sandbox's own.

    Nothing else of this machine's files is there: no home folder, no project
    clone beside the package, no other submission and no kept grade, wherever
    they lie and whatever their permissions. The root is a tmpfs (built over
    ``/tmp``, then made ``/`` by ``pivot_root``; the old root is detached):
    ``work`` becomes its ``/tmp``, the other :data:`PRIVATE` places fresh
    tmpfs, and every needed path (the Python, its environment, the package,
    under ``/tmp`` too) is bound at its place, read-only, from a descriptor
    opened before anything was hidden; the folders on the way to it are empty.
    """
    needed = _needed(paths)
    links = {d: os.readlink(d) for d in SYSTEM if os.path.islink(d)}  # merged /usr: /bin -> usr/bin
    tops = [d for d in SYSTEM + KERNEL if os.path.isdir(d) and d not in links]
    sources = {p: os.open(p, os.O_PATH) for p in [*tops, *needed]}  # reachable after /tmp is covered
    work_fd = os.open(work, os.O_PATH)
    mount("none", "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates to the host
    root = "/tmp"
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
    for name, target in links.items():
        os.symlink(target, root + name)
    for path in tops:
        _bind(sources.pop(path), root + path, readonly=path not in ("/dev", "/proc"))
    _bind(work_fd, root + "/tmp", readonly=False)
    private_dirs(root, shm_size)
    for path, src in sources.items():  # after the private places: what lies in them is bound on top
        _bind(src, root + path, readonly=True)
    mount("none", root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir(root)
    libc.pivot_root(".", ".")  # the old root lies under the new one now: detach it, nothing of it stays
    umount2(".", MNT_DETACH)
    os.chdir("/")


def private_dirs(root: str, shm_size: str) -> None:
    """``/var/tmp``, ``/dev/shm`` and ``/run/lock`` of the new ``root`` become fresh tmpfs."""
    for target in PRIVATE[1:]:
        if target == "/dev/shm" and not os.path.isdir(root + "/dev"):
            continue
        os.close(_mountpoint(root + target))
        mount("tmpfs", root + target, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size={shm_size}")


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
            # torchrun hands its workers this host's name: it must name the loopback, the only address here
            step = f"take the host name {HOSTNAME}"
            libc.sethostname(HOSTNAME)
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

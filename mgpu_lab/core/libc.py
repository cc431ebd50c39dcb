"""The Linux calls the standard library lacks, each raising ``OSError`` with the errno and what failed.

One wrapper per call, for the launcher (``prctl``), the simulated nodes of
``cluster/`` (``setns``, ``unshare``, ``mount``, ``umount2``) and the grading
sandbox of ``course/`` (``mount``, ``umount2``, ``pivot_root``, ``prctl``,
``sethostname``). libc is loaded at import: a child between ``fork`` and
``exec`` may call these, and must not ``dlopen`` (another thread may hold the
loader's lock).

As a command it runs ARGV in a UTS namespace of its own with host name NAME
(a simulated node's ``torchrun`` started with ``exec``):
``python -m mgpu_lab.core.libc NAME ARGV...``.

Example:
    >>> from mgpu_lab.core import libc
    >>> libc.mount("none", "/no/such/dir", None, libc.MS_BIND)
    Traceback (most recent call last):
    ...
    FileNotFoundError: [Errno 2] mount none on /no/such/dir: No such file or directory
"""
from __future__ import annotations

import ctypes
import os
import socket
import sys

__all__ = ["mount", "umount2", "pivot_root", "setns", "unshare", "prctl", "sethostname", "MS_RDONLY", "MS_NOSUID",
           "MS_NODEV", "MS_NOEXEC", "MS_REMOUNT", "MS_BIND", "MS_REC", "MS_NOATIME", "MS_NODIRATIME", "MS_PRIVATE", "MS_SLAVE",
           "MS_RELATIME", "MNT_DETACH", "CLONE_NEWNS", "CLONE_NEWUTS", "CLONE_NEWNET", "PR_SET_PDEATHSIG",
           "PR_SET_CHILD_SUBREAPER", "PR_SET_NO_NEW_PRIVS"]

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = 1024, 2048, 4096, 16384
MS_PRIVATE, MS_SLAVE, MS_RELATIME = 1 << 18, 1 << 19, 1 << 21
MNT_DETACH = 2
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWNET = 0x00020000, 0x04000000, 0x40000000
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 36, 38

try:
    _libc = ctypes.CDLL(None, use_errno=True)
except OSError:  # pragma: no cover - not a Unix with a C library
    _libc = None


def _call(name: str, what: str, *args) -> None:
    fn = getattr(_libc, name, None)
    if fn is None:
        raise OSError(0, f"{what}: {name}() is not available on {sys.platform}")
    if fn(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _b(text: str | None) -> bytes | None:
    return None if text is None else os.fsencode(text)


def mount(source: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    """mount(2): ``source`` on ``target`` (``fstype`` None for binds and remounts)."""
    _call("mount", f"mount {source} on {target}", _b(source), _b(target), _b(fstype), flags, _b(data))


def umount2(target: str, flags: int = 0) -> None:
    """umount2(2), e.g. with :data:`MNT_DETACH`."""
    _call("umount2", f"umount {target}", _b(target), flags)


# pivot_root(2) has no C library wrapper: its system call number, per machine (asm-generic's where unlisted)
_SYS_PIVOT_ROOT = {"x86_64": 155, "i686": 217, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}


def pivot_root(new_root: str, put_old: str) -> None:
    """pivot_root(2): ``new_root`` (a mount point) becomes ``/``; the old root moves to ``put_old``."""
    number = _SYS_PIVOT_ROOT.get(os.uname().machine)
    if number is None or _libc is None:
        raise OSError(0, f"pivot_root: no system call number known for {os.uname().machine}")
    if _libc.syscall(number, _b(new_root), _b(put_old)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"pivot_root {new_root}: {os.strerror(err)}")


def setns(fd: int, nstype: int, what: str = "setns") -> None:
    """setns(2): join the namespace open at ``fd`` (``nstype`` e.g. :data:`CLONE_NEWNET`)."""
    _call("setns", what, fd, nstype)


def unshare(flags: int) -> None:
    """unshare(2): namespaces of this process's own, e.g. :data:`CLONE_NEWUTS`."""
    names = [n for n, f in (("mount", CLONE_NEWNS), ("UTS", CLONE_NEWUTS), ("network", CLONE_NEWNET)) if flags & f]
    _call("unshare", f"unshare the {' and '.join(names) or hex(flags)} namespace", flags)


def prctl(option: int, value: int, what: str | None = None) -> None:
    """prctl(2) with one argument, e.g. ``prctl(PR_SET_PDEATHSIG, signal.SIGKILL)``."""
    _call("prctl", what or f"prctl({option}, {value})", option, value, 0, 0, 0)


def sethostname(name: str) -> None:
    """This UTS namespace's host name (after ``unshare(CLONE_NEWUTS)``)."""
    socket.sethostname(name)


def _main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: python -m mgpu_lab.core.libc HOSTNAME ARGV...", file=sys.stderr)
        return 2
    try:
        unshare(CLONE_NEWUTS)
        sethostname(argv[0])
    except OSError as exc:
        print(f"mgpu_lab.cluster.multinode: cannot take host name {argv[0]}: {exc}", file=sys.stderr)
        return 1
    os.execvp(argv[1], argv[1:])
    return 1  # pragma: no cover (execvp does not return)


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))

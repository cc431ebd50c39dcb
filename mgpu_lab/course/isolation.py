"""What a grading sandbox can get on this machine: resource limits, and the protections ``unshare`` gives.

:func:`protections` finds out once, by trying, and :meth:`Protections.describe`
says it in words for the grader's report (once per run). As root a sandbox gets
its own user (``nobody``, or ``MGPU_LAB_SANDBOX_USER``) and new PID, network,
IPC, UTS and mount namespaces. Not root, there is no other user and no process limit
(it would count the grader's own processes), and the namespaces come from a
user namespace where the kernel allows one; without ``unshare`` at all there
are no namespaces. Where an NVIDIA driver is loaded there is no address-space
limit: CUDA reserves more address space than any such limit would allow.

Example:
    >>> print(protections().describe())   # as root: sandbox: user nobody; own PID, network (loopback only), ...
    sandbox: ...
"""
from __future__ import annotations

import functools
import os
import pwd
import shutil
import subprocess
from dataclasses import dataclass, field

__all__ = ["Limits", "Protections", "protections", "slot_user", "ENV_KEEP", "UNSHARE"]

GiB = 1 << 30
# What of the grader's environment a sandbox keeps: nothing that could hold a secret.
ENV_KEEP = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "PYTHONPATH", "CUDA_VISIBLE_DEVICES",
            "CUDA_DEVICE_ORDER", "NVIDIA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "MGPU_LAB_TIMEOUT",
            "MGPU_LAB_PREWARM", "MGPU_LAB_PRELOAD", "MGPU_LAB_NETNS")
UNSHARE = ["--pid", "--fork", "--kill-child", "--mount-proc", "--net", "--ipc", "--uts"]


@dataclass(frozen=True)
class Limits:
    """Resource limits of a sandbox (0 or None: no limit).

    Attributes:
        memory: bytes of address space per process (RLIMIT_AS).
        processes: processes and threads of the sandbox user (RLIMIT_NPROC; only
            when the sandbox has its own user).
        file_size: bytes a file written may reach (RLIMIT_FSIZE).
        cpu_time: CPU seconds per process (RLIMIT_CPU).
        shm: size of each private ``/var/tmp``, ``/dev/shm``, ``/run/lock`` (tmpfs syntax).
    """

    memory: int = 16 * GiB
    processes: int = 2048
    file_size: int = 2 * GiB
    cpu_time: int = 3600
    shm: str = "1g"


@dataclass(frozen=True)
class Protections:
    """What sandboxes get on this machine, and what they cannot get, in words."""

    user: str | None  # the sandbox user's name; None: the grader's own user
    uid: int | None
    gid: int | None
    namespaces: bool
    userns: bool  # namespaces through a user namespace (the grader is not root)
    missing: tuple[str, ...] = field(default_factory=tuple)
    cuda: bool = False  # an NVIDIA driver is loaded: no address-space limit (CUDA reserves more)

    def describe(self, limits: Limits | None = None) -> str:
        limits = limits or Limits()
        got = [f"user {self.user}" if self.user else "the grader's own user",
               "own PID, network (loopback only), IPC, UTS and mount namespaces, own root, private /tmp"
               if self.namespaces
               else "own directory", "allow-listed environment",
               "limits: " + ("" if self.cuda else f"{limits.memory / GiB:g} GiB address space per process, ")
               + (f"{limits.processes} processes, " if self.user else "")
               + f"{limits.file_size / GiB:g} GiB per file, {limits.cpu_time} s CPU per process"]
        text = "sandbox: " + "; ".join(got)
        return text + ("\nsandbox: not had here: " + "; ".join(self.missing) if self.missing else "")


SLOT_UIDS = range(65001, 65534)  # no user has them on Debian (65000-65533 are not allocated) or most systems


@functools.cache
def slot_user(slot: int) -> tuple[str | None, int | None, int | None]:
    """The user of the ``slot``-th sandbox graded at once: ``(name, uid, gid)``.

    Slot 0 is :func:`protections`' user. Others get their own uid (the first free
    ones of :data:`SLOT_UIDS`, no user of this machine) and its group, so that
    two sandboxes never share a process limit (RLIMIT_NPROC counts a user's
    processes): a fork bomb in one cannot starve another. Without a sandbox
    user (not root) every slot is the grader's own.
    """
    prot = protections()
    if slot == 0 or prot.uid is None:
        return prot.user, prot.uid, prot.gid
    free = (u for u in SLOT_UIDS if not _has_user(u))
    for _ in range(slot - 1):
        next(free)
    uid = next(free)
    return f"uid{uid}", uid, prot.gid


def _has_user(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


def _try_unshare(prefix: list[str]) -> bool:
    exe = shutil.which("unshare")
    if not exe:
        return False
    try:
        return subprocess.run([exe, *prefix, *UNSHARE, "true"], stdin=subprocess.DEVNULL,
                              capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@functools.cache
def protections() -> Protections:
    """Find out once which protections sandboxes get here (see the module docstring)."""
    missing = []
    if os.geteuid() == 0:
        name = os.environ.get("MGPU_LAB_SANDBOX_USER", "nobody")
        try:
            entry = pwd.getpwnam(name)
            user, uid, gid = name, entry.pw_uid, entry.pw_gid
        except KeyError:
            user = uid = gid = None
            missing.append(f"a separate user (no user {name!r} on this machine; set MGPU_LAB_SANDBOX_USER)")
        namespaces, userns = _try_unshare([]), False
    else:
        user = uid = gid = None
        missing.append("a separate user and a process limit (the grader is not root: submissions run "
                       "as its user)")
        namespaces = userns = _try_unshare(["--user", "--map-root-user"])
    cuda = os.path.exists("/proc/driver/nvidia/version")
    if cuda:
        missing.append("a memory limit (an NVIDIA driver is loaded: CUDA reserves more address space than "
                       "any per-process limit would allow)")
    if not namespaces:
        missing.append("namespaces (`unshare` failed here): submissions can reach the network and the "
                       "grader's file system, and a process that leaves their session can outlive them")
    return Protections(user, uid, gid, namespaces, userns, tuple(missing), cuda)

"""Start a node's ``torchrun`` without importing torch again: fork it from a process that already has.

Every ``torchrun`` starts a Python that imports torch, about 2.5 s of CPU before
it does anything; a lesson 07 run of the failure table starts 16 of them at once
on a 2-core machine. An :class:`AgentServer` imports ``torch.distributed.run``
once and forks each node's agent from itself. The child then does what
``ip netns exec NODE`` and the node's host name do for a started command (the
node's network namespace, a mount namespace of its own with the node's files
from ``/etc/netns/NODE`` bound over ``/etc`` and its own ``/sys``, a UTS
namespace with the host name), takes the node's environment, working
directory, session and output pipe, and calls torchrun's own ``main`` with the
same arguments: the same code as the ``torchrun`` command, minus the import.

Only variables that torch reads at run time may differ from the server's
environment (:data:`RUNTIME_VARS`, :data:`RUNTIME_PREFIXES`); for any other difference, as for any
command that is not ``torchrun``, :func:`mgpu_lab.cluster.noderunner.spawn`
starts the command as before. ``MGPU_LAB_FORK_TORCHRUN=0`` turns this off.

The server ends when the process that started it closes its end of the socket
(also when that process dies), killing the agents it forked that still run.
"""
from __future__ import annotations

import array
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from mgpu_lab.core import libc

__all__ = ["AgentServer", "Agent", "server", "RUNTIME_VARS", "RUNTIME_PREFIXES"]

# Read by torch and torchrun when they are used, not when torch is imported: a child can set them itself.
RUNTIME_VARS = ("TMPDIR", "LOGLEVEL", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "NCCL_DEBUG",
                "NCCL_DEBUG_SUBSYS", "MASTER_ADDR", "MASTER_PORT", "HEAD_NODE",
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE")  # read by the rendezvous when it starts
# what an sbatch script's srun line gives its command; scripts/allreduce_check.py's own settings
RUNTIME_PREFIXES = ("SLURM_", "SLURMD_", "ALLREDUCE_CHECK_")
_lock = threading.Lock()
_server: "AgentServer | None" = None


def server(env: dict[str, str]) -> "AgentServer | None":
    """This process's server with ``env``, started on first use and again when ``env`` has changed
    (the old one ends when the last of its agents' handles is dropped); None where forking agents is off."""
    global _server
    if os.environ.get("MGPU_LAB_FORK_TORCHRUN", "1") == "0":
        return None
    with _lock:
        if _server is None or not _server.alive() or _server.env != env:
            _server = AgentServer(env)
        return _server


class Agent:
    """A forked torchrun, with the parts of :class:`subprocess.Popen` that the node runner uses."""

    def __init__(self, srv: "AgentServer", pid: int, stdout):
        self._srv, self.pid, self.stdout, self.returncode = srv, pid, stdout, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._srv.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired("torchrun", timeout)
            time.sleep(0.02)
        return self.returncode


class AgentServer:
    """A process that has imported ``torch.distributed.run`` and forks node agents from itself.

    Args:
        env: its environment; an agent's may differ only in :data:`RUNTIME_VARS` and
            variables starting with :data:`RUNTIME_PREFIXES` (see :meth:`fits`).
    """

    def __init__(self, env: dict[str, str]):
        self.env = dict(env)
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            self.proc = subprocess.Popen([sys.executable, "-m", "mgpu_lab.cluster.agents", str(theirs.fileno())],
                                         pass_fds=(theirs.fileno(),), env=self.env, stdin=subprocess.DEVNULL)
        self._exits: dict[int, int] = {}
        self._lock = threading.Lock()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def fits(self, env: dict[str, str]) -> bool:
        """Whether an agent with ``env`` may be forked from here."""
        keys = {k for k in set(env) | set(self.env) if k not in RUNTIME_VARS and not k.startswith(RUNTIME_PREFIXES)}
        return all(env.get(k) == self.env.get(k) for k in keys)

    def start(self, argv: list[str], env: dict[str, str], cwd, netns: str | None, hostname: str | None) -> Agent:
        """Fork ``torchrun ARGV[1:]`` with ``env`` in ``cwd``, in node namespace ``netns`` under ``hostname``."""
        read, write = os.pipe()
        request = json.dumps({"args": argv[1:], "env": env, "cwd": str(cwd or os.getcwd()), "netns": netns,
                              "hostname": hostname}).encode()
        try:
            with self._lock:
                socket.send_fds(self._sock, [request], [write])
                while True:
                    reply = self._recv(timeout=120.0)
                    if "pid" in reply:
                        break
        finally:
            os.close(write)
        if reply.get("error"):
            os.close(read)
            raise RuntimeError(f"the torchrun agent server could not start torchrun: {reply['error']}")
        return Agent(self, reply["pid"], os.fdopen(read, "rb", buffering=0))

    def _recv(self, timeout: float | None) -> dict:
        """One message; exit reports on the way are filed. ``timeout`` 0: {} when none is waiting."""
        while True:
            self._sock.settimeout(timeout)
            try:
                data = self._sock.recv(65536)
            except (BlockingIOError, TimeoutError):
                if timeout == 0:
                    return {}
                raise RuntimeError("the torchrun agent server does not answer") from None
            if not data:
                raise RuntimeError("the torchrun agent server has ended")
            msg = json.loads(data)
            if "exit" not in msg:
                return msg
            self._exits[msg["exit"]] = msg["code"]

    def exit_code(self, pid: int) -> int | None:
        with self._lock:
            with contextlib.suppress(RuntimeError):
                while self._recv(timeout=0):
                    pass
            if pid not in self._exits and not self.alive():
                return -signal.SIGKILL  # the server was killed, and its agents with it
            return self._exits.get(pid)


# -- the server process ---------------------------------------------------------------------
def _enter(netns: str | None, hostname: str | None) -> None:
    """What ``ip netns exec NETNS`` and the node's host name give a command, in this (forked) process."""
    if netns:
        fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
        try:
            libc.setns(fd, libc.CLONE_NEWNET, f"setns {netns}")
        finally:
            os.close(fd)
        libc.unshare(libc.CLONE_NEWNS)
        libc.mount("none", "/", None, libc.MS_REC | libc.MS_SLAVE)  # mount --make-rslave /
        libc.umount2("/sys", libc.MNT_DETACH)
        libc.mount(netns, "/sys", "sysfs", 0)
        etc = f"/etc/netns/{netns}"
        for name in sorted(os.listdir(etc)) if os.path.isdir(etc) else []:
            libc.mount(f"{etc}/{name}", f"/etc/{name}", None, libc.MS_BIND)
    if hostname:
        libc.unshare(libc.CLONE_NEWUTS)
        libc.sethostname(hostname)


def _agent(req: dict, out: int) -> int:
    """In the forked child: become the node's torchrun; its exit code."""
    import logging
    import tempfile
    import traceback

    os.setsid()
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a Python just started (SIGPIPE stays ignored)
    for sig in (signal.SIGTERM, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(null)
    os.close(out)
    try:
        _enter(req["netns"], req["hostname"])
        os.environ.clear()
        os.environ.update(req["env"])
        os.chdir(req["cwd"])
        tempfile.tempdir = None  # read TMPDIR again: torchrun's log folder goes into the run's own
        level = os.environ.get("LOGLEVEL", "WARNING")  # elastic's loggers took it from the server's env
        for name, logger in list(logging.Logger.manager.loggerDict.items()):
            if name.startswith("torch.distributed") and isinstance(logger, logging.Logger):
                logger.setLevel(level)
        sys.argv = ["torchrun", *req["args"]]
        from torch.distributed.run import main

        main(req["args"])
        return 0
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - as Python reports an uncaught error of the torchrun command
        traceback.print_exc()
        return 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()


def _serve(fd: int) -> int:
    import select

    import torch.distributed.run  # noqa: F401 - the import every agent forked from here is spared

    sock = socket.socket(fileno=fd)
    children: set[int] = set()
    try:
        while True:
            ready, _, _ = select.select([sock], [], [], 0.05 if children else None)  # idle: sleep until asked
            while children:  # reap at once: a killed agent must not stay a zombie the runner waits on
                pid, status = os.waitpid(-1, os.WNOHANG)
                if not pid:
                    break
                children.discard(pid)
                sock.send(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}).encode())
            if not ready:
                continue
            data, fds, _, _ = socket.recv_fds(sock, 1 << 20, 4)
            if not data:
                return 0  # the runner's end is closed: it is done, or dead
            req, out = json.loads(data), array.array("i", fds)[0] if fds else -1
            try:
                pid = os.fork()
            except OSError as exc:
                os.close(out)
                sock.send(json.dumps({"pid": None, "error": str(exc)}).encode())
                continue
            if pid == 0:
                sock.close()
                os._exit(_agent(req, out))
            os.close(out)
            children.add(pid)
            sock.send(json.dumps({"pid": pid}).encode())
    finally:
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(_serve(int(sys.argv[1])))

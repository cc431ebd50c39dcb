"""The one libc module (mgpu_lab.core.libc): each call, and its errors with the errno and what failed."""
from __future__ import annotations

import doctest
import errno
import os
import signal
import subprocess
import sys

import pytest

from mgpu_lab.core import libc


def test_a_failed_call_raises_oserror_with_the_errno_and_what_failed(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        libc.mount("none", str(tmp_path / "missing"), None, libc.MS_BIND)
    assert info.value.errno == errno.ENOENT and f"mount none on {tmp_path}/missing" in str(info.value)
    with pytest.raises(OSError) as info:
        libc.setns(-1, libc.CLONE_NEWNET, "setns node0")
    assert info.value.errno == errno.EBADF and "setns node0" in str(info.value)


def test_prctl_sets_what_it_is_asked():
    code = ("import ctypes, signal\nfrom mgpu_lab.core import libc\n"
            "libc.prctl(libc.PR_SET_PDEATHSIG, signal.SIGKILL)\n"
            "sig = ctypes.c_int()\nctypes.CDLL(None).prctl(2, ctypes.byref(sig), 0, 0, 0)\nprint(sig.value)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == str(int(signal.SIGKILL)), out.stderr


def test_unshare_names_the_namespaces_it_could_not_make():
    if os.geteuid() == 0:
        pytest.skip("root may unshare; the error path needs an ordinary user")  # CI runs this file as a user
    with pytest.raises(PermissionError, match="unshare the UTS namespace"):
        libc.unshare(libc.CLONE_NEWUTS)


def test_the_command_runs_argv_under_its_own_host_name():
    if os.geteuid() != 0:
        out = subprocess.run([sys.executable, "-m", "mgpu_lab.core.libc", "node7", "hostname"], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 1 and "cannot take host name node7" in out.stderr
        return
    out = subprocess.run([sys.executable, "-m", "mgpu_lab.core.libc", "node7", "hostname"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "node7", out.stderr
    assert os.uname().nodename != "node7"  # this process's host name is untouched


def test_the_docstring_example_is_true():
    failed, tried = doctest.testmod(libc)
    assert tried >= 1 and failed == 0

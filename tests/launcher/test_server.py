"""The fork server's quick exit is the fork server's alone (mgpu_lab.launcher.server)."""
from __future__ import annotations

import subprocess
import sys
import textwrap

from mgpu_lab import launch


def _exit_code(code: str) -> int:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, timeout=300).returncode


def test_importing_the_server_module_leaves_the_exit_status_alone():
    assert _exit_code("import mgpu_lab.launcher.server, sys; sys.exit(3)") == 3
    assert _exit_code("import mgpu_lab.launcher.server\nraise ValueError('a failure')") == 1


def test_a_failing_test_run_fails_after_every_module_of_the_package_is_imported(tmp_path):
    # Runners that import the whole package (pytest --doctest-modules, coverage) must still see failures.
    (tmp_path / "test_all.py").write_text(textwrap.dedent("""
        import importlib, pkgutil
        import mgpu_lab

        def test_imports_everything_then_fails():
            names = [m.name for m in pkgutil.walk_packages(mgpu_lab.__path__, "mgpu_lab.")
                     if not m.name.endswith("__main__")]
            for name in names:
                importlib.import_module(name)
            assert "mgpu_lab.launcher.server" in names
            assert False, "this failure must reach the exit status"
    """))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                          str(tmp_path / "test_all.py")], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert "1 failed" in run.stdout, run.stdout[-2000:]
    assert run.returncode == 1, run.stdout[-2000:]


def _quick_exit_in_rank():
    from mgpu_lab.launcher import server

    return server.QUICK_EXIT


def test_the_fork_server_still_has_its_quick_exit():
    # The ranks are forks of the fork server, which preloaded the module: they inherit its state.
    from mgpu_lab.launcher import server

    assert launch(_quick_exit_in_rank, 1) == [True]
    assert server.QUICK_EXIT is False  # this process imported it too, and registered nothing

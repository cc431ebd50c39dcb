"""Run-wide test plumbing: for tests/ and for the solution notebooks that nbval runs.

``make test`` runs the suite in three worker processes (pytest-xdist,
``--dist loadfile``: all of a file's tests, or all of a notebook's cells, in one
worker, in order). A few files use something there is only one of on a machine,
so no two of them may run at the same time: the local SLURM cluster (one set of
daemons, host names and namespaces), and the grading sandboxes' users (a fork
bomb in one sandbox uses up its user's process limit, which a sandbox of another
grading run on the same user would share). Each such group holds a file lock
from the first test of a file to its last; the other worker goes on with other
files meanwhile. Files are also sent out longest first (the Makefile passes
``--no-loadscope-reorder`` so that xdist keeps this order), so that the last
file to finish is a short one.
"""
from __future__ import annotations

import fcntl
import os
import tempfile
from pathlib import Path

import pytest

ONE_AT_A_TIME = {
    "slurm": ["tests/cluster/test_slurm_local.py", "solutions/07_multi_node.ipynb", "mgpu_lab/cluster/slurm_local.py",
              "tests/course/test_slurm_grade.py"],
    # test_slurm_grade.py is in both: its SLURM tasks grade in sandboxes of the same users (a root run once
    # counted its ranks as processes test_grade_hostile.py's submissions had left behind)
    "sandbox-users": ["tests/course/test_grade.py", "tests/course/test_grade_hostile.py",
                      "tests/course/test_batch.py", "tests/course/test_sandbox.py", "mgpu_lab/course/grade.py",
                      "mgpu_lab/course/session.py", "mgpu_lab/course/sandbox.py", "tests/course/test_slurm_grade.py",
                      "tests/course/test_autograder.py"],  # as root, run_autograder grades as the sandbox users
    # What makes network namespaces or edits the machine's network files (hosts, the SLURM cluster's nodes): one
    # file at a time, so that the root part's two workers never build simulated nodes at once; the other worker
    # meanwhile grades (test_autograder.py and the sandbox files above)
    "network": ["tests/cluster/test_multinode.py", "tests/cluster/test_troubleshoot.py", "tests/cluster/test_agents.py",
                "tests/cluster/test_slurm.py", "tests/cluster/test_slurm_local.py", "solutions/07_multi_node.ipynb",
                "mgpu_lab/cluster/netns.py", "mgpu_lab/cluster/troubleshoot.py", "mgpu_lab/cluster/slurm_local.py",
                "tests/course/test_slurm_grade.py"],
}
_GROUPS: dict[str, list[str]] = {}
for _name in sorted(ONE_AT_A_TIME):  # a file in several groups takes their locks in this one order: no deadlock
    for _path in ONE_AT_A_TIME[_name]:
        _GROUPS.setdefault(_path, []).append(_name)

# What needs root (network namespaces, the local SLURM cluster, a sandbox user per submission): these files
# whole, and the tests marked `root`. CI runs them as root (`make test PART=root`) and everything else as an
# ordinary user from a clone in a 0700 home folder (`make test PART=user`); a plain `make test` runs both.
# (the docstring examples of network namespaces, troubleshooting and the local SLURM cluster too).
NEEDS_ROOT = ("tests/cluster/", "solutions/07_multi_node.ipynb", "mgpu_lab/cluster/netns.py",
              "mgpu_lab/cluster/troubleshoot.py", "mgpu_lab/cluster/slurm_local.py")
# Files that need no root but run in the root part because where they are used they run as root: Gradescope
# runs setup.sh and run_autograder as root (so as root they grade in the full sandbox, as there). As an
# ordinary user they pass too (a plain `make test` runs them whoever runs it).
RUN_AS_ROOT = ("tests/course/test_autograder.py",)

# The longest files of a serial run on the 2-core machine (CI's kind), longest first; files not
# named here come after these, in their usual order.
LONGEST_FIRST = [
    "tests/course/test_autograder.py",  # setup.sh installs torch into a fresh venv: minutes, mostly unpacking
    "tests/course/test_grade.py", "tests/mutants/test_mutants_08.py",  # 08.MiniFSDP: 11 answers on 2 and 3 ranks
    "solutions/07_multi_node.ipynb", "tests/browser/test_lab.py", "tests/mutants/test_mutants_04.py",
    "tests/cluster/test_multinode.py", "solutions/10_failures.ipynb", "tests/cluster/test_troubleshoot.py",
    "tests/cluster/test_slurm_local.py", "tests/mutants/test_mutants_10.py", "tests/mutants/test_mutants_12.py",
    "tests/mutants/test_mutants_11.py", "solutions/12_pipeline_schedules.ipynb", "tests/test_pp_script.py",
    "tests/test_tp_script.py", "solutions/11_tensor_parallel.ipynb", "solutions/14_long_context.ipynb",
    "tests/mutants/test_mutants_14.py", "tests/course/checks/test_checks_12.py",
    "tests/mutants/test_mutants_13.py", "solutions/13_time_and_memory.ipynb",
    "tests/mutants/test_mutants_02.py", "solutions/08_sharding.ipynb",
    "solutions/02_data_loading.ipynb", "solutions/04_ddp.ipynb", "tests/test_ddp_script.py",
    "solutions/05_balanced_samplers.ipynb", "solutions/09_inside_ddp.ipynb", "solutions/01_devices.ipynb",
    "tests/mutants/test_mutants_07.py", "tests/launcher/test_launch_kernel.py", "tests/devices/test_subset_jobs.py",
]
# The other files that grade (they share the sandbox users with test_grade.py) go last: by then the class
# batch is long done, and no worker waits for its lock.
LAST = ["tests/course/test_grade_hostile.py", "tests/course/test_batch.py", "tests/course/test_sandbox.py"]
_held: dict[str, object] = {}


def _file(item) -> str:
    return item.nodeid.split("::")[0]


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(session, config, items):
    for item in items:
        if _file(item).startswith(NEEDS_ROOT + RUN_AS_ROOT):
            item.add_marker(pytest.mark.root)
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    rank.update({path: len(LONGEST_FIRST) + 1 + i for i, path in enumerate(LAST)})
    items.sort(key=lambda item: rank.get(_file(item), len(LONGEST_FIRST)))  # stable: a file's own order is kept


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    groups = _GROUPS.get(_file(item), [])
    for group in groups:
        if group not in _held:
            # One lock per user: root's and an ordinary user's runs share no SLURM cluster and no sandbox user.
            lock = open(Path(tempfile.gettempdir()) / f"mgpu-lab-tests-{group}-{os.getuid()}.lock", "w")
            fcntl.flock(lock, fcntl.LOCK_EX)  # waits while the other worker runs a file of the group
            _held[group] = lock
    yield
    following = _GROUPS.get(_file(nextitem), []) if nextitem is not None else []
    for group in groups:
        if group not in following:
            _held.pop(group).close()

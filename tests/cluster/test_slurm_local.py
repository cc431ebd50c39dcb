"""A real SLURM cluster on this machine: sbatch, srun, squeue, scontrol, scancel for real.

The cluster needs root, Linux and Debian's slurm-wlm + munge (`.ci/run` and
`make test` install them when root). Elsewhere these tests skip with the reason;
under CI (CI=true) they fail instead, so a missing install never passes as a skip.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from mgpu_lab import cli
from mgpu_lab.cluster import slurm_local
from mgpu_lab.cluster.slurm import sbatch

ROOT = Path(__file__).resolve().parents[2]
WHY = slurm_local.problem()
if WHY and os.environ.get("CI") == "true" and os.geteuid() == 0:  # CI's root part must run them; its user part
    raise RuntimeError(f"CI must run the SLURM tests, but: {WHY}")  # only collects them (they are marked root)
needs_cluster = pytest.mark.skipif(bool(WHY), reason=f"no local SLURM cluster here: {WHY}")
pytestmark = pytest.mark.timeout(300)


def machine_network() -> tuple[str, str]:
    """What must never change: the machine's own links and its /etc/hosts."""
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return re.sub(r"\s+", " ", links), hashlib.sha256(Path("/etc/hosts").read_bytes()).hexdigest()


def leftovers(state: Path) -> list[str]:
    return slurm_local._leftovers(state)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    state = tmp_path_factory.mktemp("slurm") / "state"
    c = slurm_local.up(2, state=state, echo=False)
    yield c
    slurm_local.down(state, quiet=True)


def submit(cluster, script: Path, *args, cwd: Path, timeout=240, check=True) -> str:
    """The job id; with --wait, sbatch returns when the job ends (exit code: the job's)."""
    out = slurm_local.run(["sbatch", "--parsable", *args, script], state=cluster.state, cwd=cwd, timeout=timeout,
                          check=check)
    return out.stdout.strip().split(";")[0]


def job_state(cluster, job_id: str) -> str:
    shown = slurm_local.run(["scontrol", "show", "job", job_id], state=cluster.state).stdout
    return re.search(r"JobState=(\S+)", shown).group(1)


# -- without a cluster -----------------------------------------------------------------------------
def test_problem_names_the_missing_packages_and_how_to_install_them(monkeypatch):
    real = shutil.which
    monkeypatch.setattr(slurm_local.shutil, "which", lambda b: None if b in ("slurmd", "munged") else real(b))
    monkeypatch.setattr(slurm_local.os, "geteuid", lambda: 0)
    why = slurm_local.problem()
    assert "munge" in why and "slurm-wlm" in why and "apt-get install" in why, why


def test_up_refuses_bad_node_counts_and_says_why_it_cannot_start(monkeypatch):
    with pytest.raises(ValueError, match=r"nodes=0: a local cluster has 1 to 8 nodes"):
        slurm_local.up(0)
    monkeypatch.setattr(slurm_local, "problem", lambda: "a local SLURM cluster needs root (...)")
    with pytest.raises(RuntimeError, match="cannot start a local cluster: a local SLURM cluster needs root"):
        slurm_local.up(2)


def test_commands_without_a_cluster_say_how_to_start_one(tmp_path, capsys):
    with pytest.raises(RuntimeError, match="no local cluster is up; start one with `mgpu-lab slurm up`"):
        slurm_local.run(["squeue"], state=tmp_path / "none")
    assert cli.main(["slurm", "run"]) in (1, 2)
    assert "mgpu-lab slurm run" in capsys.readouterr().err


# -- up and down ----------------------------------------------------------------------------------
@needs_cluster
def test_up_and_down_leave_nothing_and_never_touch_the_machine_s_network(tmp_path):
    state = tmp_path / "state"
    before = machine_network()
    c = slurm_local.up(1, state=state, echo=False)
    assert c.nodes == ("node0",)
    assert "idle" in slurm_local.run(["sinfo", "-h", "-o", "%T"], state=state).stdout
    assert machine_network() == before  # every link lives in the cluster's namespaces
    with pytest.raises(RuntimeError, match="already up"):
        slurm_local.up(1, state=state, echo=False)
    removed = slurm_local.down(state, quiet=True)
    assert any(r.startswith("namespace mgpuslurm-") for r in removed), removed
    assert leftovers(state) == [] and machine_network() == before
    assert slurm_local.down(state, quiet=True) == []  # twice is fine


@needs_cluster
def test_down_cleans_up_after_a_crash_that_lost_the_state_folder(tmp_path):
    state = tmp_path / "state"
    slurm_local.up(1, state=state, echo=False)
    daemons = [p.pid for p in slurm_local._daemons(state)]
    assert len(daemons) >= 3, daemons  # munged, slurmctld, slurmd
    shutil.rmtree(state)  # pid files, configuration and logs gone, as after a crash or a wiped /tmp
    slurm_local.down(state, quiet=True)
    assert leftovers(state) == []
    assert not [pid for pid in daemons if psutil.pid_exists(pid)]


# -- jobs on the cluster -------------------------------------------------------------------------
@needs_cluster
def test_the_generated_script_trains_ddp_train_on_two_nodes_like_one_process(cluster, tmp_path):
    job = sbatch(ROOT / "scripts" / "ddp_train.py", "--samples", "96", "--val-samples", "32", "--hidden", "8",
                 "--epochs", "1", "--batch-size", "8", "--compare-reference",
                 nodes=2, gpus_per_node=0, nproc_per_node=2, interface="eth0", time="00:05:00")
    path = job.write(tmp_path / "train.sbatch")
    job_id = submit(cluster, path, "--wait", cwd=tmp_path)
    out = (tmp_path / f"mgpu-lab-{job_id}.out").read_text()
    assert job_state(cluster, job_id) == "COMPLETED", out
    for r in range(4):
        assert f"rank {r}/4 local_rank {r % 2} node {r // 2}: backend gloo" in out, out
    diff = float(re.search(r"one process with global batch 32\| = (\S+)", out).group(1))
    assert diff < 1e-6, out


@needs_cluster
def test_a_failing_rank_ends_the_whole_job(cluster, tmp_path):
    train = tmp_path / "fail_on_rank_3.py"
    train.write_text("import os, sys, time\n"
                     "if os.environ['RANK'] == '3':\n"
                     "    sys.exit('rank 3 fails on purpose')\n"
                     "time.sleep(600)  # the other ranks would wait for ever\n")
    path = sbatch(train, nodes=2, gpus_per_node=0, nproc_per_node=2, interface="eth0",
                  time="00:10:00").write(tmp_path / "fail.sbatch")
    start = time.monotonic()
    job_id = submit(cluster, path, "--wait", cwd=tmp_path, timeout=200, check=False)
    assert time.monotonic() - start < 200  # well before the 600 s the survivors would sleep
    assert job_state(cluster, job_id) == "FAILED"
    out = (tmp_path / f"mgpu-lab-{job_id}.out").read_text()
    assert "rank 3 fails on purpose" in out, out


@needs_cluster
def test_squeue_shows_a_job_and_scancel_cancels_it(cluster, tmp_path):
    script = tmp_path / "sleep.sbatch"
    script.write_text("#!/bin/bash\n#SBATCH --job-name=sleeper\n#SBATCH --nodes=1\nsleep 600\n")
    job_id = submit(cluster, script, cwd=tmp_path)
    queue = ""
    for _ in range(50):
        queue = slurm_local.run(["squeue", "-h", "-o", "%i %j %T"], state=cluster.state).stdout
        if f"{job_id} sleeper RUNNING" in queue:
            break
        time.sleep(0.2)
    assert f"{job_id} sleeper RUNNING" in queue, queue
    slurm_local.run(["scancel", job_id], state=cluster.state)
    deadline = time.monotonic() + 60  # COMPLETING (its processes being stopped) took over 10 s on a loaded machine
    while job_state(cluster, job_id) in ("RUNNING", "COMPLETING") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert job_state(cluster, job_id) == "CANCELLED"


@needs_cluster
def test_sbatch_test_only_accepts_the_committed_example_shape(cluster, tmp_path):
    path = sbatch("train.py", nodes=2, gpus_per_node=0, nproc_per_node=2).write(tmp_path / "j.sbatch")
    proc = slurm_local.run(["sbatch", "--test-only", path], state=cluster.state, cwd=tmp_path, check=False)
    assert "to start at" in proc.stderr, proc.stderr  # the controller would run it now

"""Tests for mgpu_lab.cluster.slurm: the generated sbatch script, its validation, and its srun line run for real."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from mgpu_lab.cluster import netns
from mgpu_lab.cluster.multinode import PROBE_SCRIPT, SimCluster, probe_reports
from mgpu_lab.cluster.slurm import NODE_COMMAND, sbatch

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "scripts" / "slurm_example.sbatch"


def directives(text: str) -> list[str]:
    return [line.split(None, 1)[1] for line in text.splitlines() if line.startswith("#SBATCH")]


def test_script_for_two_nodes_with_four_gpus():
    job = sbatch("train.py", "--epochs", "3", "--out", "my dir", nodes=2, gpus_per_node=4, interface="ib0",
                 partition="gpu", account="proj-1", cpus_per_task=32, time="01:30:00", debug=True,
                 setup=["module load cuda", "source .venv/bin/activate"])
    text = job.text
    assert text.startswith("#!/bin/bash\n") and text.endswith("\n")
    assert directives(text) == ["--job-name=mgpu-lab", "--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=4",
                                "--cpus-per-task=32", "--time=01:30:00", "--output=%x-%j.out",
                                "--partition=gpu", "--account=proj-1"]
    for line in ("set -euo pipefail", "module load cuda", "source .venv/bin/activate",
                 'export HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
                 "export HEAD_PORT=29500", "export NPROC_PER_NODE=4", "export NCCL_SOCKET_IFNAME=ib0",
                 "export GLOO_SOCKET_IFNAME=ib0", "export NCCL_DEBUG=INFO", "export OMP_NUM_THREADS=8",
                 "srun --kill-on-bad-exit=1 bash -c '", "  exec torchrun \\",
                 """    "$@"' torchrun-node train.py --epochs 3 --out 'my dir'"""):
        assert line in text.splitlines(), line
    # the two c10d traps of the lesson, handled on every node
    assert "    --rdzv-conf=\"is_host=$(( SLURM_NODEID == 0 ))\" \\" in text.splitlines()
    assert '--rdzv-conf="is_host=$(( SLURM_NODEID == 0 ))"' in NODE_COMMAND
    assert '--local-addr="$SLURMD_NODENAME"' in NODE_COMMAND
    assert "--rdzv-backend=c10d" in NODE_COMMAND and '--rdzv-id="$SLURM_JOB_ID"' in NODE_COMMAND
    # every line is explained, blank lines aside
    assert all(why for line, why in job.explained())
    assert len(job.explained()) == len([line for line in text.splitlines() if line.strip()])


def test_script_is_valid_bash():
    job = sbatch("train.py", "--name", "it's", nodes=3, gpus_per_node=8, interface="eth0")
    proc = subprocess.run(["bash", "-n"], input=job.text, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    # what srun runs: bash -c, then the script and its arguments as $@, quoted once
    assert job.node_argv == ("bash", "-c", NODE_COMMAND, "torchrun-node", "train.py", "--name", "it's")


def test_cpu_nodes_need_nproc_per_node_and_no_gpu_line():
    job = sbatch("train.py", nodes=2, gpus_per_node=0, nproc_per_node=4)
    assert not any(d.startswith("--gpus") for d in directives(job.text))
    assert "export NPROC_PER_NODE=4" in job.text
    with pytest.raises(ValueError, match="gpus_per_node=0: pass nproc_per_node"):
        sbatch("train.py", nodes=2, gpus_per_node=0)


@pytest.mark.parametrize("kwargs, message", [
    (dict(nodes=0, gpus_per_node=1), "nodes=0 must be an int >= 1"),
    (dict(nodes=True, gpus_per_node=1), "nodes=True"),
    (dict(nodes=2, gpus_per_node=-1), "gpus_per_node=-1"),
    (dict(nodes=2, gpus_per_node=2, nproc_per_node=4), "nproc_per_node=4 > gpus_per_node=2"),
    (dict(nodes=2, gpus_per_node=2, time="1 hour"), "time='1 hour'"),
    (dict(nodes=2, gpus_per_node=2, port=80), "port=80"),
    (dict(nodes=2, gpus_per_node=2, interface="eth0; rm -rf /"), "not a network interface name"),
    (dict(nodes=2, gpus_per_node=2, job_name="my job"), "job_name='my job'"),
    (dict(nodes=2, gpus_per_node=2, partition="a b"), "partition='a b'"),
    (dict(nodes=2, gpus_per_node=2, cpus_per_task=0), "cpus_per_task=0"),
])
def test_bad_arguments_say_what_and_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("$", r"\$")):
        sbatch("train.py", **kwargs)


def test_time_formats():
    for time in ("30", "0:30", "01:30:00", "2-00:00:00"):
        assert f"--time={time}" in sbatch("t.py", nodes=1, gpus_per_node=1, time=time).text


def test_write_and_slurm_env(tmp_path):
    job = sbatch("train.py", nodes=2, gpus_per_node=2, interface="eth0")
    path = job.write(tmp_path / "job.sbatch")
    assert path.read_text() == job.text and path.stat().st_mode & 0o100
    env = job.slurm_env(1, ["gpu-a", "gpu-b"], job_id="77")
    assert env["HEAD_NODE"] == "gpu-a" and env["SLURM_NODEID"] == "1" and env["SLURMD_NODENAME"] == "gpu-b"
    assert env["SLURM_JOB_NUM_NODES"] == "2" and env["GLOO_SOCKET_IFNAME"] == "eth0" and env["HEAD_PORT"] == "29500"


def test_the_committed_example_is_what_the_generator_writes():
    from mgpu_lab.cluster.slurm import example

    assert EXAMPLE.read_text() == example().text, "regenerate it: python -m mgpu_lab.cluster.slurm > scripts/slurm_example.sbatch"


@pytest.mark.slow
@pytest.mark.skipif(bool(netns.problem()), reason=f"network namespaces unavailable: {netns.problem()}")
def test_the_srun_line_runs_torchrun_with_c10d_on_simulated_nodes():
    """Every node runs exactly what srun would run, with the variables SLURM would set."""
    job = sbatch(PROBE_SCRIPT, "--backend", "gloo", nodes=2, gpus_per_node=0, nproc_per_node=1, interface="eth0")
    with SimCluster(2) as cluster:
        hostnames = [n.hostname for n in cluster.nodes]
        env = lambda node: {**job.slurm_env(node.rank, hostnames), "ALLREDUCE_CHECK_JSON": "1"}
        result = cluster.run([list(job.node_argv)] * 2, env=env, timeout=180, echo=False)
    assert result.ok, "\n".join(result.lines())
    reports = probe_reports(result)
    assert [(r["RANK"], r["GROUP_RANK"], r["hostname"]) for r in reports] == [("0", "0", "node0"), ("1", "1", "node1")]
    assert {r["MASTER_ADDR"] for r in reports} == {"node0"}  # node 0's --local-addr, as SLURM names it

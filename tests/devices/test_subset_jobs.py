"""mgpu_lab.devices.subset_jobs: real child processes, each started with its own CUDA_VISIBLE_DEVICES.

On a machine without a GPU the children train on the CPU and report 0 GPUs;
the test marked ``gpu`` checks that a child given GPU 0 trains on ``cuda:0``.
"""
from __future__ import annotations

import pytest

from mgpu_lab import devices
from mgpu_lab.devices.subset_jobs import SubsetJobs
from mgpu_lab.devices.subset_train import LEARNING_RATES, cuda_sees

pytestmark = pytest.mark.timeout(300)
HAS_GPU = devices.gpu_count() > 0


def _expected_device(ids) -> str:
    """What a child given ``ids`` trains on here: cuda:0 if CUDA exposes any of them."""
    return "cuda:0" if cuda_sees(ids, devices.gpu_count()) else "cpu"


# -- SubsetJobs: two children, disjoint device sets ---------------------------------------------
@pytest.fixture(scope="module")
def jobs():
    with SubsetJobs({"A": [0, 1], "B": [2, 3]}, echo=False) as running:
        yield running


def test_children_start_and_train_at_once_each_seeing_its_own_devices(jobs):
    assert set(jobs.startup_s) == {"A", "B"} and min(jobs.startup_s.values()) > 0
    runs = jobs.train(steps=20)
    assert list(runs) == ["A", "B"]
    for name, visible, ids in (("A", "0,1", (0, 1)), ("B", "2,3", (2, 3))):
        run = runs[name]
        assert (run.name, run.ids, run.visible, run.steps, run.lr) == (name, ids, visible, 20, LEARNING_RATES[name])
        assert run.gpu_count == len(cuda_sees(ids, devices.gpu_count()))
        assert run.device == _expected_device(ids)
        assert run.last_loss < run.first_loss
        assert 0 <= run.began_s < run.ended_s and run.wall_s == run.ended_s - run.began_s
    # Both were told to train before either answered: that is what "at once" means.
    assert max(r.began_s for r in runs.values()) < min(r.ended_s for r in runs.values())


def test_one_job_at_a_time_and_same_work_every_time(jobs, capsys):
    first = jobs.train(["B"], steps=10, echo=True)
    assert list(first) == ["B"]
    assert capsys.readouterr().out.startswith("[B] model B (lr 0.2) on ")
    again = jobs.train(["B"], steps=10)
    assert again["B"].last_loss == first["B"].last_loss


def test_train_rejects_unknown_jobs_and_bad_steps(jobs):
    with pytest.raises(ValueError, match="names must be among"):
        jobs.train(["C"])
    with pytest.raises(ValueError, match="steps=0"):
        jobs.train(steps=0)


@pytest.mark.parametrize("plan, words", [
    ({"A": [1, 1]}, "more than once"), ({"A": [-1]}, "negative"), ({"C": [0]}, "name each job"), ({}, "name each job"),
])
def test_bad_plans_fail_before_any_child_starts(plan, words):
    with pytest.raises(ValueError, match=words):
        SubsetJobs(plan)


def test_a_dead_child_is_an_error_with_its_output_and_the_others_stop():
    running = SubsetJobs({"A": [0], "B": [1]}, echo=False)
    procs = dict(running._procs)
    procs["A"].stdin.write("bogus\n")  # the child raises on it and exits with code 1
    procs["A"].stdin.flush()
    with pytest.raises(RuntimeError, match=r"model A \(GPUs \[0\]\) exited with code 1") as err:
        running.train(steps=5)
    assert "expected 'train STEPS' or 'quit'" in str(err.value)
    assert all(proc.poll() is not None for proc in procs.values())
    with pytest.raises(RuntimeError, match="closed"):
        running.train()


def test_a_child_that_takes_too_long_is_stopped():
    running = SubsetJobs({"A": [0]}, echo=False)
    proc = running._procs["A"]
    running.timeout = 0.5
    with pytest.raises(RuntimeError, match=r"model\(s\) A did not answer within 0.5 s"):
        running.train(steps=10**7)
    assert proc.poll() is not None


def test_close_ends_the_children_and_is_idempotent():
    running = SubsetJobs({"A": [0]}, echo=False)
    proc = running._procs["A"]
    running.close()
    assert proc.returncode == 0  # stdin closed: it left its loop and exited by itself
    running.close()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason=f"needs a CUDA GPU: {devices.describe()}")
def test_a_child_given_gpu_0_trains_on_its_cuda_0():
    with SubsetJobs({"A": [0], "B": [devices.gpu_count()]}, echo=False) as running:
        runs = running.train(steps=10)
    assert (runs["A"].visible, runs["A"].gpu_count, runs["A"].device) == ("0", 1, "cuda:0")
    assert (runs["B"].gpu_count, runs["B"].device) == (0, "cpu")  # a GPU past the last one: CPU


def test_a_gpu_env_function_of_the_caller_gives_each_child_its_variables():
    def mine(ids):  # as lesson 01's learner writes it, and passes it
        return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, ids)), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}

    with SubsetJobs({"A": [3]}, echo=False, gpu_env=mine) as running:
        assert running.train(steps=5)["A"].visible == "3"

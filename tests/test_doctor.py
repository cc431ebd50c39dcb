"""Tests for mgpu_lab.doctor and its probes (mgpu_lab.doctor_probes).

The report logic is tested against a stand-in launcher (fast, and every
failure mode on demand); the end-to-end tests start real ranks through
mgpu_lab.launch, including ranks that fail.
"""

from __future__ import annotations

import io
import sys
import types

import pytest
import torch
import torch.distributed as dist

from mgpu_lab import devices, doctor, doctor_probes


class FakeLaunchError(RuntimeError):
    pass


class FakeLaunchTimeout(FakeLaunchError):
    pass


def fake_launcher(monkeypatch, behaviour):
    """Install a stand-in mgpu_lab.launcher.launch whose launch() calls ``behaviour``."""
    calls = []

    def launch(fn, nprocs, *args, backend=None, timeout=300.0, init=True, **kwargs):
        calls.append({"fn": fn, "nprocs": nprocs, "args": args, "backend": backend,
                      "timeout": timeout, "init": init, "kwargs": kwargs})
        return behaviour(nprocs)

    module = types.ModuleType("mgpu_lab.launcher.launch")
    module.launch = launch
    module.LaunchError = FakeLaunchError
    module.LaunchTimeout = FakeLaunchTimeout
    monkeypatch.setitem(sys.modules, "mgpu_lab.launcher.launch", module)
    return calls


def correct(nprocs):
    total = float(sum(range(1, nprocs + 1)))
    return [[total] * 4 for _ in range(nprocs)]


def run(**kwargs):
    """The doctor's report; only the collective checks unless ``course=True``."""
    out = io.StringIO()
    kwargs.setdefault("course", False)
    code = doctor.run_doctor(out=out, **kwargs)
    return code, out.getvalue()


@pytest.fixture
def gpus(monkeypatch):
    """Set how many GPUs the doctor sees: ``gpus(2)``."""
    def set_count(n):
        props = types.SimpleNamespace(name="Simulated GPU", total_memory=2**34, major=9, minor=0)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    set_count(0)
    return set_count


@pytest.fixture
def backends_built(monkeypatch):
    """Set which backends torch claims to have: ``backends_built(gloo=True, nccl=False)``."""
    def set_available(gloo=True, nccl=True, mpi=False):
        monkeypatch.setattr(dist, "is_gloo_available", lambda: gloo)
        monkeypatch.setattr(dist, "is_nccl_available", lambda: nccl)
        monkeypatch.setattr(dist, "is_mpi_available", lambda: mpi)
    set_available()
    return set_available


# --- arguments -------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"backends": ["foo"]}, r"backends=\['foo'\] names unknown backend 'foo'.*gloo, nccl"),
        ({"backends": "mpi"}, r"unknown backend 'mpi'.*mpirun"),
        ({"backends": []}, r"backends=\[\] is empty"),
        ({"nprocs": 0}, r"nprocs=0 must be an int >= 1"),
        ({"nprocs": 2.0}, r"nprocs=2.0 must be an int"),
        ({"nprocs": True}, r"nprocs=True must be an int"),
        ({"timeout": 0}, r"timeout=0 must be a positive number"),
        ({"timeout": "30"}, r"timeout='30' must be a positive number"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        doctor.run_doctor(out=io.StringIO(), **kwargs)


# --- report with a stand-in launcher ----------------------------------------


def test_report_sections_and_ok(monkeypatch, gpus, backends_built):
    calls = fake_launcher(monkeypatch, correct)
    code, text = run(nprocs=3, timeout=12)
    assert code == 0
    for expected in ("versions", "python", f"torch        {torch.__version__}", "nccl",
                     "torchvision", "devices", devices.describe(), "cpus",
                     "gloo         available", "mpi          not available"):
        assert expected in text
    assert "  gloo   OK in " in text
    assert "all_reduce sum 6 on every rank" in text
    assert "  nccl   skipped: nccl needs one GPU per rank, 0 visible" in text
    assert text.rstrip().endswith("result: all 1 check(s) passed")
    [call] = calls
    assert call["fn"] is doctor_probes.allreduce_probe
    assert (call["nprocs"], call["args"], call["backend"], call["timeout"]) == (3, ("cpu",), "gloo", 12)
    assert "--nodes" not in text


def test_nccl_skipped_with_one_gpu(monkeypatch, gpus, backends_built):
    fake_launcher(monkeypatch, correct)
    gpus(1)
    code, text = run()
    assert code == 0
    assert "nccl   skipped: nccl needs one GPU per rank, 1 visible" in text


def test_nccl_runs_on_cuda_with_enough_gpus(monkeypatch, gpus, backends_built):
    calls = fake_launcher(monkeypatch, correct)
    gpus(2)
    code, text = run()
    assert code == 0, text
    assert [(c["backend"], c["args"]) for c in calls] == [("gloo", ("cpu",)), ("nccl", ("cuda",))]
    assert "nccl   OK in " in text
    assert "result: all 2 check(s) passed" in text


def test_nccl_not_built(monkeypatch, gpus, backends_built):
    fake_launcher(monkeypatch, correct)
    gpus(4)
    backends_built(nccl=False)
    code, text = run()
    assert code == 0
    assert f"nccl   skipped: torch {torch.__version__} was built without nccl" in text


def test_explicit_nccl_that_cannot_run_fails(monkeypatch, gpus, backends_built):
    calls = fake_launcher(monkeypatch, correct)
    code, text = run(backends=["nccl"])
    assert code == 1
    assert calls == []
    assert ("nccl   FAILED: cannot run here: nccl needs one GPU per rank, 0 visible; "
            "use backend gloo") in text
    checks = text.split("\nchecks:")[1].splitlines()[1:-1]
    assert [line.split()[0] for line in checks] == ["nccl"]  # only the one asked for


def test_no_backend_at_all_fails(monkeypatch, gpus, backends_built):
    fake_launcher(monkeypatch, correct)
    backends_built(gloo=False, nccl=False)
    code, text = run()
    assert code == 1
    assert "no backend could be checked" in text


def test_wrong_sum_fails_and_names_what_to_try(monkeypatch, gpus, backends_built):
    fake_launcher(monkeypatch, lambda n: [[3.0] * 4, [2.0] * 4])
    code, text = run()
    assert code == 1
    assert "gloo   FAILED: all_reduce(SUM) of ones * (rank + 1) over 2 ranks should give 3" in text
    assert "rank 1 got [2.0, 2.0, 2.0, 2.0]" in text
    assert "GLOO_SOCKET_IFNAME=lo" in text
    assert "result: 1 check(s) FAILED" in text


def test_wrong_number_of_results_fails(monkeypatch, gpus, backends_built):
    fake_launcher(monkeypatch, lambda n: [[3.0] * 4])
    code, text = run()
    assert code == 1
    assert "expected a list of one result per rank (2), got [[3.0, 3.0, 3.0, 3.0]]" in text


def test_rank_error_fails_with_traceback_and_hint(monkeypatch, gpus, backends_built):
    def crash(nprocs):
        raise FakeLaunchError("rank 1/2 raised RuntimeError: Connection reset by peer\nTraceback ...")

    fake_launcher(monkeypatch, crash)
    code, text = run()
    assert code == 1
    assert "gloo   FAILED after" in text and "a rank raised an error" in text
    assert "      | rank 1/2 raised RuntimeError: Connection reset by peer" in text
    assert "MASTER_ADDR=127.0.0.1" in text


def test_hang_fails_and_says_so(monkeypatch, gpus, backends_built):
    def hang(nprocs):
        raise FakeLaunchTimeout("ranks did not finish within 5 s\nrank 0: in barrier")

    fake_launcher(monkeypatch, hang)
    gpus(2)
    code, text = run(timeout=5)
    assert code == 1
    assert "a rank hung: no result within timeout=5 s" in text
    assert "NCCL_P2P_DISABLE=1" in text  # nccl hung too, with the nccl hints


def test_other_exception_from_launch_fails(monkeypatch, gpus, backends_built):
    def refuse(nprocs):
        raise ValueError("backend='gloo' is broken here")

    fake_launcher(monkeypatch, refuse)
    code, text = run()
    assert code == 1
    assert "FAILED after" in text and "raised ValueError: backend='gloo' is broken here" in text


def test_missing_launcher_fails(monkeypatch, gpus, backends_built):
    monkeypatch.setitem(sys.modules, "mgpu_lab.launcher.launch", None)  # makes the import fail
    code, text = run()
    assert code == 1
    assert "cannot import mgpu_lab.launcher.launch" in text and "pip install -e ." in text


# --- the probe itself, in this process --------------------------------------


def test_probe_in_a_world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert doctor_probes.allreduce_probe("cpu") == [1.0] * 4
    finally:
        dist.destroy_process_group()


# --- end to end, real ranks through mgpu_lab.launch ---------------------------


def _real_launcher_or_skip():
    try:
        import mgpu_lab.launcher.launch  # noqa: F401
    except ImportError as err:
        pytest.skip(f"mgpu_lab.launch is not importable yet: {err}")


@pytest.mark.slow
def test_real_gloo_check_passes(capsys):
    _real_launcher_or_skip()
    code, text = run(backends=["gloo"], timeout=120)
    assert code == 0, text + capsys.readouterr().out
    assert "gloo   OK in " in text


@pytest.mark.slow
def test_real_rank_that_raises_fails_the_check(monkeypatch, capsys):
    _real_launcher_or_skip()

    def broken_probe(device_type):  # a local function: shipped to the ranks by value
        raise RuntimeError(f"simulated broken collective on {device_type}")

    monkeypatch.setattr(doctor_probes, "allreduce_probe", broken_probe)
    code, text = run(backends=["gloo"], timeout=120)
    assert code == 1, text
    assert "a rank raised an error" in text
    assert "simulated broken collective on cpu" in text
    assert "GLOO_SOCKET_IFNAME=lo" in text


@pytest.mark.slow
def test_real_rank_with_wrong_sum_fails_the_check(monkeypatch):
    _real_launcher_or_skip()

    def wrong_probe(device_type):
        return [0.0] * 4

    monkeypatch.setattr(doctor_probes, "allreduce_probe", wrong_probe)
    code, text = run(backends=["gloo"], timeout=120)
    assert code == 1, text
    assert "rank 0 got [0.0, 0.0, 0.0, 0.0]" in text


@pytest.mark.gpu
@pytest.mark.skipif(devices.gpu_count() < 2, reason=f"needs 2 CUDA GPUs: {devices.describe()}")
def test_real_nccl_check_passes():
    _real_launcher_or_skip()
    code, text = run(backends=["nccl"], timeout=180)
    assert code == 0, text
    assert "nccl   OK in " in text


@pytest.mark.gpu
@pytest.mark.skipif(devices.gpu_count() != 1, reason=f"needs exactly 1 CUDA GPU: {devices.describe()}")
def test_real_doctor_with_one_gpu_skips_nccl_and_passes():
    _real_launcher_or_skip()
    code, text = run(timeout=180)
    assert code == 0, text
    assert "nccl   skipped: nccl needs one GPU per rank, 1 visible" in text


# --- what notebooks and grading need ----------------------------------------


@pytest.mark.slow
def test_the_course_checks_prove_the_traceback_and_the_sandbox(capsys):
    _real_launcher_or_skip()
    code, text = run(backends=["gloo"], timeout=120, course=True)
    assert code == 0, text + capsys.readouterr().out
    assert "  traceback OK in " in text and "shows the notebook cell's own line" in text
    from mgpu_lab.course.sandbox import protections
    prot = protections()
    assert f"  sandbox   OK: submissions run as {prot.user or 'the grader'}" in text
    assert ("not had here: a separate user" in text) == (prot.user is None)  # one line says what root would add
    assert text.rstrip().endswith("result: all 3 check(s) passed")


@pytest.mark.slow
def test_a_traceback_without_the_cells_line_fails_and_names_the_fix(monkeypatch):
    # What cloudpickle >= 3.1.3 does to a function pickled by value (its file becomes <dynamic-code>),
    # whichever cloudpickle is installed here.
    import copyreg
    import types

    from mgpu_lab.launcher import pickling

    def renamed(code):
        ctor, args = pickling._code_reduce(code)
        return ctor, tuple("<dynamic-code>" if a == code.co_filename else a for a in args)

    class Renaming(pickling.Pickler):
        dispatch_table = copyreg.dispatch_table.copy() | dict(pickling.Pickler.dispatch_table) | {
            types.CodeType: renamed}

    def dumps(obj, protocol=None):
        import io
        buf = io.BytesIO()
        Renaming(buf, protocol=protocol).dump(obj)
        return buf.getvalue()

    monkeypatch.setattr(pickling, "dumps", dumps)
    passed, report = doctor_probes.check_traceback(120)
    assert not passed
    assert "lost the notebook cell's line" in report and "pip install -c constraints.txt -e ." in report
    assert "<dynamic-code>" in report


def test_a_sandbox_that_cannot_import_the_package_fails_with_its_words(monkeypatch):
    from mgpu_lab.course import sandbox

    monkeypatch.setattr(sandbox, "_SELF_TEST", "import mgpu_lab_not_installed_here")
    passed, report = sandbox.self_test(60)
    assert not passed
    assert "could not import torch and mgpu_lab" in report and "mgpu_lab_not_installed_here" in report

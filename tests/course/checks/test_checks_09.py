"""Lesson 09's checkers against the solutions, stubs, the library's versions and the wrong answers
only a recorded run can see (tests/mutants/test_mutants_09.py has the named mutants)."""
from __future__ import annotations

from pathlib import Path

import pytest

from checking import case_starting
from mgpu_lab.course.checks import check, exercises

pytestmark = pytest.mark.timeout(300)
NOTEBOOK = Path(__file__).resolve().parents[3] / "solutions" / "09_inside_ddp.ipynb"
NAMES = ("ring_allreduce", "bucket_assignment", "bf16_compress_hook")


def _by_value(source: str, name: str):
    """A function that belongs to no module, so that cloudpickle ships it by value: a rank that got a
    function of this file by reference would import this file, and with it nbformat (seconds per rank).
    Kept in ANSWERS, not as a module attribute, where cloudpickle would find it and pickle by reference."""
    namespace = {}
    exec(compile(source, f"<{name}>", "exec"), namespace)
    return namespace[name]


ANSWERS = {"stub": _by_value("def stub(*args, **kwargs):\n    raise NotImplementedError('write this')\n", "stub")}


def test_lesson_09_registers_its_three_exercises_with_one_point_per_case():
    got = {e.id: e.points for e in exercises("09")}
    assert got == {"09.bf16_compress_hook": 5, "09.bucket_assignment": 7, "09.ring_allreduce": 8}


@pytest.mark.parametrize("name", NAMES)
def test_a_stub_is_not_attempted(name):
    assert check(f"09.{name}", ANSWERS["stub"]).status == "not attempted"


def test_the_library_versions_pass():
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

    from mgpu_lab.comm.collectives import ring_allreduce
    from mgpu_lab.comm.ddp_buckets import torch_bucket_assignment

    assert check("09.ring_allreduce", ring_allreduce).passed
    assert check("09.bucket_assignment", torch_bucket_assignment).passed
    assert check("09.bf16_compress_hook", bf16_compress_hook).passed  # torch's own hook


ANSWERS["everyone_to_everyone"] = _by_value('''
def everyone_to_everyone(tensor):
    """A correct sum in which every rank sends its whole tensor to every other rank: no ring."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    peers = [p for p in range(world) if p != rank]
    incoming = [torch.empty_like(tensor) for _ in peers]
    reqs = [dist.isend(tensor, p) for p in peers] + [dist.irecv(buf, p) for buf, p in zip(incoming, peers)]
    for req in reqs:
        req.wait()
    return tensor + sum(incoming)
''', "everyone_to_everyone")


def test_everyone_to_everyone_fails_only_the_neighbour_and_traffic_cases():
    result = check("09.ring_allreduce", ANSWERS["everyone_to_everyone"])
    failed = {c.name.split(":")[0] for c in result.cases if not c.passed}
    assert failed == {"each rank talks only to its two ring neighbours (4 ranks",
                      "each rank sends about 2(W-1)/W of the tensor"}, result
    assert "rank 0 did isend with rank 2" in case_starting(result, "each rank talks only").got
    assert "rank 0 sent 12012 bytes" in case_starting(result, "each rank sends about").got

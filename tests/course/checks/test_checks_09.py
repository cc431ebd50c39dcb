"""Lesson 09's checkers against stubs, answers that call a reference, trivially wrong answers and the
wrong answers only a recorded run can see (tests/mutants/test_mutants_09.py has the named mutants)."""
from __future__ import annotations

import pytest

from checking import by_value, case_starting
from mgpu_lab.course.checks import check, exercises

pytestmark = pytest.mark.timeout(300)
NAMES = ("ring_allreduce", "MiniDDP", "error_feedback_hook")


ANSWERS = {"stub": by_value("def stub(*args, **kwargs):\n    raise NotImplementedError('write this')\n", "stub")}


def test_lesson_09_registers_its_three_exercises_with_one_point_per_case():
    got = {e.id: e.points for e in exercises("09")}
    assert got == {"09.ring_allreduce": 8, "09.MiniDDP": 6, "09.error_feedback_hook": 6}


@pytest.mark.parametrize("name", NAMES)
def test_a_stub_is_not_attempted(name):
    assert check(f"09.{name}", ANSWERS["stub"]).status == "not attempted"


ANSWERS["library_ring"] = by_value('''
def library_ring(tensor):
    from mgpu_lab.comm.ring import all_reduce as mine   # the library's reference, under another name
    return mine(tensor)
''', "library_ring")
ANSWERS["ddp_inside"] = by_value('''
import torch
from torch import nn


class ddp_inside(nn.Module):
    """MiniDDP that is torch's DDP underneath."""

    def __init__(self, module, bucket_cap_bytes):
        super().__init__()
        from torch.nn.parallel import DistributedDataParallel
        self.ddp = DistributedDataParallel(module, bucket_cap_mb=bucket_cap_bytes / 2**20)

    def forward(self, *args):
        return self.ddp(*args)

    def finish_gradient_sync(self):
        pass
''', "ddp_inside")
ANSWERS["torch_buckets"] = by_value("""
import torch
import torch.distributed as dist
from torch import nn


class torch_buckets(nn.Module):
    \"\"\"MiniDDP whose buckets come from DDP's own C++ bucketing.\"\"\"

    def __init__(self, module, bucket_cap_bytes):
        super().__init__()
        self.module = module
        params = [p for p in module.parameters() if p.requires_grad][::-1]
        self.buckets, _ = dist._compute_bucket_assignment_by_size(params, [bucket_cap_bytes])

    def forward(self, *args):
        return self.module(*args)

    def finish_gradient_sync(self):
        pass
""", "torch_buckets")
ANSWERS["torch_buckets_imported"] = by_value("""
import torch
from torch import nn
from torch.distributed import _compute_bucket_assignment_by_size as buckets_of


class torch_buckets_imported(nn.Module):
    \"\"\"MiniDDP whose buckets come from DDP's C++ bucketing, imported by name before the ranks start.\"\"\"

    def __init__(self, module, bucket_cap_bytes):
        super().__init__()
        self.module = module
        params = [p for p in module.parameters() if p.requires_grad][::-1]
        self.buckets, _ = buckets_of(params, [bucket_cap_bytes])

    def forward(self, *args):
        return self.module(*args)

    def finish_gradient_sync(self):
        pass
""", "torch_buckets_imported")
ANSWERS["torch_hook"] = by_value('''
def torch_hook(state, bucket):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    return default_hooks.bf16_compress_hook(None, bucket)
''', "torch_hook")


@pytest.mark.parametrize("exercise, answer, says", [
    ("09.ring_allreduce", "library_ring", "mgpu_lab.comm.ring.all_reduce"),
    ("09.MiniDDP", "ddp_inside", "torch.nn.parallel.DistributedDataParallel"),
    ("09.MiniDDP", "torch_buckets", "torch.distributed._compute_bucket_assignment_by_size"),
    ("09.MiniDDP", "torch_buckets_imported", "torch.distributed._compute_bucket_assignment_by_size"),
    ("09.error_feedback_hook", "torch_hook", "default_hooks.bf16_compress_hook"),
])
def test_an_answer_that_calls_a_reference_fails_every_case_naming_it(exercise, answer, says):
    result = check(exercise, ANSWERS[answer])
    assert result.points == 0, result
    assert says in str(result), result


# -- trivially wrong answers pass no case that names a behaviour they lack ---------------------------------
ANSWERS["ring_nothing"] = by_value('''
def ring_nothing(tensor):
    return tensor.clone()
''', "ring_nothing")
ANSWERS["mini_nothing"] = by_value('''
from torch import nn


class mini_nothing(nn.Module):
    def __init__(self, module, bucket_cap_bytes):
        super().__init__()
        self.module = module

    def forward(self, *args):
        return self.module(*args)

    def finish_gradient_sync(self):
        pass
''', "mini_nothing")
ANSWERS["hook_nothing"] = by_value('''
import torch


def hook_nothing(state, bucket):
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut
''', "hook_nothing")


def test_a_ring_that_sends_nothing_passes_no_case():
    result = check("09.ring_allreduce", ANSWERS["ring_nothing"])
    assert result.points == 0, result
    assert "nothing sent" in case_starting(result, "only point-to-point").got


def test_a_minddp_that_does_nothing_passes_no_case():
    result = check("09.MiniDDP", ANSWERS["mini_nothing"])
    assert result.points == 0, result


def test_a_hook_that_does_not_communicate_passes_only_the_shape_of_its_value():
    result = check("09.error_feedback_hook", ANSWERS["hook_nothing"])
    assert [c.name for c in result.cases if c.passed] == [
        "the future's value is one tensor of the bucket's dtype (float32) and shape"], result
    assert "0 all-reduces" in result.cases[0].got
    assert "all_reduce of nothing" in case_starting(result, "20 steps").got


ANSWERS["everyone_to_everyone"] = by_value('''
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


ANSWERS["ring_by_all_reduce"] = by_value('''
def ring_by_all_reduce(tensor):
    import torch.distributed as dist

    out = tensor.clone()
    dist.all_reduce(out)
    return out
''', "ring_by_all_reduce")
ANSWERS["ring_send_first"] = by_value('''
def ring_send_first(tensor):
    """Every rank sends its whole tensor right with a blocking send, then receives: a deadlock."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    incoming = torch.empty_like(tensor)
    dist.send(tensor.contiguous(), (rank + 1) % world)
    dist.recv(incoming, (rank - 1) % world)
    return tensor + incoming
''', "ring_send_first")


def test_a_ring_that_calls_all_reduce_passes_only_the_sums():
    result = check("09.ring_allreduce", ANSWERS["ring_by_all_reduce"])
    passed = [c.name for c in result.cases if c.passed]
    assert len(passed) == 4 and all("the sum" in name for name in passed), result
    assert "rank 0 sent 0 bytes" in case_starting(result, "each rank sends about").got
    assert "no send or receive" in case_starting(result, "the buffers live").got


def test_a_deadlocking_ring_passes_no_case_and_says_the_deadlock_once_with_its_world_sizes():
    result = check("09.ring_allreduce", ANSWERS["ring_send_first"])
    assert result.points == 0, result
    text = str(result)
    assert text.count("every rank waits and none can proceed") == 1, text
    assert "deadlock with 2, 3 and 4 ranks" in text, text
    assert text.count("A blocking send returns only") == 1, text
    assert "rank 0:" not in text, text


ANSWERS["mini_sync_at_end"] = by_value('''
import torch
import torch.distributed as dist
from torch import nn


class mini_sync_at_end(nn.Module):
    """Rank 0's weights and buffers at the start, then one blocking all-reduce per gradient after backward: no
    buckets."""

    def __init__(self, module, bucket_cap_bytes):
        super().__init__()
        self.module = module
        for p in [*module.parameters(), *module.buffers()]:
            dist.broadcast(p.data, 0)

    def forward(self, *args):
        return self.module(*args)

    def finish_gradient_sync(self):
        for p in self.module.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
''', "mini_sync_at_end")


def test_a_minddp_that_all_reduces_each_gradient_after_backward_passes_only_start_and_gradients():
    result = check("09.MiniDDP", ANSWERS["mini_sync_at_end"])
    failed = [c.name for c in result.cases if not c.passed]
    assert len(failed) == 3 and all(("bucket" in n or "during backward" in n) for n in failed), result
    assert "one all-reduce per parameter" in case_starting(result, "one asynchronous all-reduce").hint


ANSWERS["hook_fp32"] = by_value('''
import torch
import torch.distributed as dist


def hook_fp32(state, bucket):
    """Plain float32 averaging: right gradients, no compression, no residuals."""
    buffer = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda fut: fut.value()[0])
''', "hook_fp32")


def test_a_float32_hook_passes_only_what_it_does():
    result = check("09.error_feedback_hook", ANSWERS["hook_fp32"])
    assert [c.passed for c in result.cases] == [True, False, True, True, False, False], result
    assert "torch.float32" in case_starting(result, "the tensors it all-reduces").got


# -- the judges, on hand-made evidence ---------------------------------------------------------
ECHO = "RuntimeError: [pair.cc:561] Connection closed by peer [127.0.0.1]:36754. This is typically caused by a remote worker crashing."
CAUSE = "RuntimeError: a recv of a tensor on meta, not on the input's device cpu"


@pytest.mark.parametrize("errors", [(ECHO, CAUSE), (CAUSE, ECHO), (None, CAUSE)])
def test_a_rank_s_own_error_is_named_not_its_peer_s_echo_of_it(errors):
    # A rank whose peer raised first fails in its next send or receive ("Connection closed by peer"), whichever
    # rank number it has (CI, 2026-11-29: rank 0's echo was named, and the mutant's words were not said).
    from mgpu_lab.course.checks._core import Exercise, Tester
    from mgpu_lab.course.checks.l09 import judges

    def trial(error):
        entry = {"shape": [7], "dtype": "float32", "meta": True, "expected": [0.0] * 7, "events": [{"op": "send"}]}
        return {**entry, "error": error} if error else {
            **entry, "result": {"type": "Tensor", "device": "cpu", "values": [0.0] * 7}}  # a rank that got it right

    t = Tester(Exercise("09.x", 1, "", None))
    judges.ring_device(t, {2: [[trial(e)] for e in errors]})
    (case,) = t.cases
    assert not case.passed and case.got == f"rank {errors.index(CAUSE)}: {CAUSE}", case

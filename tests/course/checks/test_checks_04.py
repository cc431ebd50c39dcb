"""Lesson 04's checkers: the solutions, stubs, hangs and crashes, and the probes' own machinery.

The named wrong answers of every exercise (and correct variants, the library's
versions among them) are tests/mutants/test_mutants_04.py.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from mgpu_lab.parallel import ddp
from mgpu_lab.course.checks import check, exercises
from mgpu_lab.course.checks.l04 import checkers, ranks
from mgpu_lab.course.checks.l04.judges import variant_train
from mgpu_lab.course.checks.sim.cuda import simulated_gpus
from mgpu_lab.course.checks.sim.devices import Placed, reset

pytestmark = pytest.mark.timeout(300)
# The answers below travel to the check's processes by value, as notebook
# functions do: by reference, every call would re-import this test module there.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

NOTEBOOK = Path(__file__).resolve().parents[3] / "solutions" / "04_ddp.ipynb"
NAMES = ("shard_indices", "ddp_train", "global_mean", "download_once", "train_exact")


def test_lesson_04_registers_its_five_exercises_and_train_exact_carries_half_of_the_points():
    got = {e.id: e.points for e in exercises("04")}
    assert got == {"04.ddp_train": 9, "04.download_once": 4, "04.global_mean": 6, "04.shard_indices": 6,
                   "04.train_exact": 25}
    assert 2 * got["04.train_exact"] >= sum(got.values())


def _stub(*args, **kwargs):  # checking.stub would travel by reference: every rank would import nbformat
    raise NotImplementedError("write this function")


@pytest.mark.parametrize("name", NAMES)
def test_a_stub_is_not_attempted(name):
    answer = (lambda fn: _stub) if name == "download_once" else _stub
    assert check(f"04.{name}", answer).status == "not attempted"


# -- no answer in sight: the library's versions are references, and doing nothing earns nothing ----------
def _library_shards(n, rank, world_size, shuffle=False, seed=0, epoch=0, drop_last=False):
    from mgpu_lab.data import sampler_view  # DistributedSampler itself, behind a helper of the lesson's demos

    return sampler_view.sampler_indices(n, rank, world_size, shuffle, seed, epoch, drop_last)


def _library_train(model_fn, dataset, epochs, batch_size, lr, accumulate=1):
    return ddp.train(model_fn, dataset, epochs, batch_size, lr, accumulate=accumulate)


def _library_download_once(fn):
    from mgpu_lab.data import per_node

    return per_node.run_once(fn)


def _library_exact(model_fn, dataset, global_batch, epochs, lr):
    return ddp.train(model_fn, dataset, epochs, max(1, global_batch // dist.get_world_size()), lr)


LIBRARY = {"train_exact": (_library_exact, "mgpu_lab.parallel.ddp.train"),
           "shard_indices": (_library_shards, "torch.utils.data.distributed.DistributedSampler"),
           "ddp_train": (_library_train, "mgpu_lab.parallel.ddp.train"),
           "global_mean": (ddp.mean_over_ranks, "mgpu_lab.parallel.ddp.mean_over_ranks"),
           "download_once": (_library_download_once, "mgpu_lab.data.per_node.run_once")}


@pytest.mark.parametrize("name", NAMES)
def test_an_answer_that_calls_the_library_s_version_fails_every_case_naming_it(name):
    answer, reference = LIBRARY[name]
    result = check(f"04.{name}", answer)
    assert result.points == 0, str(result)
    assert f"your code calls {reference}" in result.cases[0].got, str(result)


def _nothing(*args, **kwargs):
    return None


@pytest.mark.parametrize("name", NAMES)
def test_an_answer_that_does_nothing_passes_no_case(name):
    answer = (lambda fn: _nothing) if name == "download_once" else _nothing
    result = check(f"04.{name}", answer)
    assert result.points == 0, str(result)


# Trivially wrong answers a learner would try: the ranks taken in turn without padding, a single-process
# training on every rank, a local mean, fn called as it is on every rank. Each passes only what it really does.
def _shards_in_turn(n, rank, world_size, shuffle=False, seed=0, epoch=0, drop_last=False):
    return list(range(rank, n, world_size))


def _single_process_on_every_rank(model_fn, dataset, epochs, batch_size, lr, accumulate=1):
    from mgpu_lab import dist as mdist

    device = mdist.device()
    model = model_fn().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(0)  # the same order on every rank: the same training
    for _ in range(epochs):
        for x, y in torch.utils.data.DataLoader(dataset, batch_size=batch_size * dist.get_world_size(),
                                                shuffle=True, generator=generator):
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
    return {k: v.cpu() for k, v in model.state_dict().items()}


def _one_process_on_every_rank(model_fn, dataset, global_batch, epochs, lr):
    from mgpu_lab import dist as mdist

    device = mdist.device()
    model = model_fn().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for epoch in range(epochs):
        order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(epoch)).tolist()
        for start in range(0, len(order), global_batch):
            x, y = torch.utils.data.default_collate([dataset[i] for i in order[start:start + global_batch]])
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device)).backward()
            optimizer.step()
    return {k: v.cpu() for k, v in model.state_dict().items()}


def _local_mean(local_sum, local_count):
    return float(local_sum / local_count) if local_count else 0.0


def _every_rank_fetches(fn):
    return fn


def _second_call_without_waiting(fn):
    """Right the first time; later, local rank 0 calls fn again but the others return the remembered path at
    once: the file is complete from the first call, so only the order of returns tells."""
    from mgpu_lab import dist as mdist

    remembered = {}

    def wrapper(root):
        path = fn(root) if mdist.local_rank() == 0 else None
        if root in remembered:
            return remembered[root]
        dist.barrier()
        paths = [None] * dist.get_world_size()
        dist.all_gather_object(paths, path)
        remembered[root] = paths[dist.get_rank() - mdist.local_rank()]
        return remembered[root]
    return wrapper


@pytest.mark.parametrize("name, answer, allowed", [
    ("shard_indices", _shards_in_turn, {"no shuffle, 12 samples on 3 ranks"}),
    ("ddp_train", _single_process_on_every_rank, {"the data order changes", "2 nodes x 2 GPUs (virtual)",
                                                  "every batch's inputs and labels"}),
    ("global_mean", _local_mean, set()),
    ("download_once", _every_rank_fetches, set()),
    # one process's training on every rank: right weights, but no DDP and no shared work
    ("train_exact", _one_process_on_every_rank, {"3 ranks, 28 samples", "24 samples", "... the weights",
                                                 "NCCL ranks", "... the loss meets"}),
    # the second-call case holds its evidence: who called fn, and whether every rank returned after it
    ("download_once", _second_call_without_waiting, {"2 nodes x 3 ranks", "every rank returns its own node's path",
                                                     "no rank returns before its node's file is complete"}),
])
def test_a_trivially_wrong_answer_passes_only_what_it_does(name, answer, allowed):
    result = check(f"04.{name}", answer)
    passed = [c.name for c in result.cases if c.passed]
    assert all(any(p.startswith(a) for a in allowed) for p in passed), str(result)
    assert result.status == "failed", str(result)


# -- global_mean: one launch, every scenario judged even when a later one fails ----------
def _all_reduce_unless_empty(local_sum, local_count):
    if local_count == 0:  # this rank skips the collective the others wait in
        return float("nan")
    from mgpu_lab import dist as mdist

    t = torch.tensor([float(local_sum), float(local_count)], dtype=torch.float64, device=mdist.device())
    dist.all_reduce(t)
    return (t[0] / t[1]).item()


def _raises_on_empty(local_sum, local_count):
    from mgpu_lab import dist as mdist

    t = torch.tensor([float(local_sum), float(local_count)], dtype=torch.float64, device=mdist.device())
    if local_count == 0:
        raise ValueError("no samples on this rank")
    dist.all_reduce(t)
    return (t[0] / t[1]).item()


def test_global_mean_a_rank_skipping_the_collective_in_the_last_scenario_fails_only_its_case(monkeypatch):
    monkeypatch.setattr(checkers, "GLOBAL_MEAN_TIMEOUT", 8.0)
    result = check("04.global_mean", _all_reduce_unless_empty)  # a hang, or a peer's closed connection
    assert [c.passed for c in result.cases] == [True] * 5 + [False], result
    assert result.cases[5].got, result


def test_global_mean_an_error_in_the_last_scenario_fails_only_its_case():
    result = check("04.global_mean", _raises_on_empty)
    assert [c.passed for c in result.cases] == [True] * 5 + [False], result
    assert "ValueError: no samples on this rank" in result.cases[5].got


# Answers right on gloo that a GPU rank breaks, or that lose precision: each fails its own case, naming the bug.
def _mean_of_cpu_tensors(local_sum, local_count):
    t = torch.tensor([float(local_sum), float(local_count)], dtype=torch.float64)  # on the CPU: NCCL refuses it
    dist.all_reduce(t)
    return (t[0] / t[1]).item()


def _mean_in_float32(local_sum, local_count):
    from mgpu_lab import dist as mdist

    t = torch.tensor([local_sum, local_count], device=mdist.device())  # torch's default dtype: float32
    dist.all_reduce(t)
    return (t[0] / t[1]).item()


@pytest.mark.parametrize("answer, case, words", [
    (_mean_of_cpu_tensors, "NCCL ranks", ("NCCL refuses", "rank 0's all_reduce given a tensor on cpu")),
    (_mean_in_float32, "sums past 2**24", ("float32", "8388608.0")),
])
def test_global_mean_judges_what_only_a_gpu_or_large_sums_show(answer, case, words):
    result = check("04.global_mean", answer)
    failed = [c for c in result.cases if not c.passed]
    assert len(failed) == 1 and failed[0].name.startswith(case), str(result)
    assert all(w in failed[0].hint + failed[0].got for w in words), str(result)


# -- download_once: ranks that wait for something that never comes hang, in bounded time ---
def _waits_for_a_message_never_sent(fn):
    from mgpu_lab import dist as mdist

    def wrapper(root):
        if mdist.local_rank() == 0:
            return fn(root)
        path = [None]  # waits for a path that local rank 0 never sends
        dist.recv_object_list(path, src=dist.get_rank() - mdist.local_rank())
        return path[0]

    return wrapper


@pytest.fixture(scope="module")
def hanging():
    """The two answers below that hang, each judged by ``check()`` under a short launch bound, both at once in two
    threads (their waits, the bounds, overlap; neither checker draws from the other's global RNG):
    ``{exercise: (result, seconds it took)}``."""
    from concurrent.futures import ThreadPoolExecutor

    def timed(exercise, answer):
        start = time.monotonic()
        return check(exercise, answer), time.monotonic() - start

    with pytest.MonkeyPatch.context() as patch, ThreadPoolExecutor(2, thread_name_prefix="hang-04") as pool:
        patch.setattr(checkers, "DOWNLOAD_TIMEOUT", 8.0)
        patch.setattr(checkers, "EXACT_TIMEOUT", 10.0)
        futures = {"04.download_once": pool.submit(timed, "04.download_once", _waits_for_a_message_never_sent),
                   "04.train_exact": pool.submit(timed, "04.train_exact", _skips_when_empty)}
        return {exercise: future.result() for exercise, future in futures.items()}


def test_download_once_that_hangs_fails_in_bounded_time(hanging):
    result, _ = hanging["04.download_once"]
    assert result.points == 0 and "no answer within 8 s" in result.cases[0].got, result
    assert all("did not finish" in c.hint for c in result.cases[1:]), result


# -- the probe's own pieces, in this process (the simulation layer itself: test_sim.py) -----
def test_the_probes_model_and_data_log_the_moves_and_the_batches_made():
    reset()
    with simulated_gpus(2, local_rank=1):
        assert torch.cuda.is_available() and torch.cuda.device_count() == 2
        model = ranks.placed_model().to("cuda:1")
        x, y = next(iter(torch.utils.data.DataLoader(ranks.Recorded(ranks.check_data(4), "/dev/null"),
                                                     batch_size=4)))
        x = x.to("cuda:1")
        assert x.device.type == "cpu" and model(x).shape == (4, 3)  # the data stays here
    assert Placed.moves == [("model", "cpu", "cuda:1"), ("inputs", "cpu", "cuda:1")]
    assert Placed.batches == ["inputs", "labels"]
    assert list(model.state_dict()) == list(ranks.check_model().state_dict())


def test_the_diagnosis_reference_is_the_reference_when_nothing_is_changed():
    s = checkers.DDP_SETUP
    ref = ddp.reference_train(ranks.check_model, ranks.check_data(s["n"]), s["epochs"],
                              s["batch"] * s["world"], s["lr"])
    assert ddp.max_diff(variant_train(s, s["batch"] * s["world"], s["lr"]), ref) < 1e-6
    assert ddp.max_diff(variant_train(s, s["batch"] * s["world"], s["lr"], set_epoch=False), ref) > 1e-3


# -- train_exact: a rank without samples that skips the step hangs the others, reported in bounded time ------
def _skips_when_empty(model_fn, dataset, global_batch, epochs, lr):
    """Right but for the step in which this rank has no sample: it leaves the step out (no forward, no backward),
    while the others wait for it in DDP's gradient all-reduce."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from mgpu_lab import dist as mdist

    device, rank, world = mdist.device(), dist.get_rank(), dist.get_world_size()
    model = model_fn().to(device)
    ddp_model = DDP(model)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr)
    for epoch in range(epochs):
        order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(epoch)).tolist()
        for start in range(0, len(order), global_batch):
            step = order[start:start + global_batch]
            mine = step[rank::world]
            if not mine:
                continue  # the bug: nothing to train on, so this rank leaves the step out
            x, y = torch.utils.data.default_collate([dataset[i] for i in mine])
            loss = torch.nn.functional.cross_entropy(ddp_model(x.to(device)), y.to(device), reduction="sum")
            optimizer.zero_grad()
            (loss * world / len(step)).backward()
            optimizer.step()
    return {k: v.cpu() for k, v in model.state_dict().items()}


def test_train_exact_a_rank_that_skips_its_empty_step_fails_in_bounded_time_naming_it(hanging):
    result, seconds = hanging["04.train_exact"]
    assert seconds < 120, result
    passed = [c.passed for c in result.cases]
    assert passed[:4] == [True] * 4 and not any(passed[4:]), result  # the scenarios before it are judged
    hang = result.cases[4]
    assert "left the step out" in hang.hint and "no answer within 10 s" in hang.got, result
    done = [int(d) for d in hang.got.split("backward passes per rank before it: [")[1].rstrip("]").split(", ")]
    assert done[0] > done[1] == done[2] == 6, result  # ranks 1 and 2 left the last step of each epoch out
    assert result.points == 1 + 6 + 2 + 2, result  # the weights of the first two scenarios, and their counts


def test_the_train_exact_reference_is_one_process_with_a_dataloader_over_the_epoch_s_order():
    from mgpu_lab.course.checks.l04 import judges

    n, g, epochs, _ = checkers.EXACT_SCENARIOS[2]
    ref = ddp.reference_train(ranks.exact_model, ranks.check_data(n), epochs, g, ranks.EXACT_LR)
    assert ddp.max_diff(judges.reference_exact(n, g, epochs, ranks.EXACT_LR), ref) < 1e-6
    wrong = [judges._exact_steps(n, epochs, ranks.EXACT_LR, plan)
             for key, plan in judges.exact_plans(g, 3).items() if key != "right"]
    assert all(ddp.max_diff(w, ref) > 1e-3 for w in wrong)  # every known wrong training is told apart

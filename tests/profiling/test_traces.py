"""mgpu_lab.profiling.traces: one Chrome trace per rank, read back; the lesson's traces are valid Chrome JSON."""
from __future__ import annotations

import collections
import json
import time

import pytest
import torch

from mgpu_lab import launch
from mgpu_lab.profiling import runs, traces

pytestmark = pytest.mark.timeout(240)


def _lesson_traces(folder):
    """What the lesson's notebook records: DDP (several buckets) and FSDP2 with mixed precision; and FSDP2
    with each block compiled (the eager backend: dynamo's capture without code generation)."""
    return ([runs.ddp_trace(folder, 0.25, width=64, depth=3), runs.fsdp_trace(folder, width=64, depth=2, mixed=True)],
            runs.fsdp_compiled("eager", steps=2))


@pytest.fixture(scope="module")
def lesson_traces(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("traces"))
    return launch(_lesson_traces, 2, folder)


def test_every_rank_writes_its_own_trace_of_valid_chrome_json(lesson_traces):
    for rank, (paths, _) in enumerate(lesson_traces):
        for path in paths:
            assert path.endswith(f"rank{rank}.json")
            with open(path, encoding="utf-8") as f:
                trace = json.load(f)  # plain JSON, as Perfetto and chrome://tracing read it
            events = trace["traceEvents"]
            assert all("ph" in e and "name" in e for e in events if e["ph"] != "M" or "name" in e)
            complete = [e for e in events if e["ph"] == "X"]
            assert complete and all(isinstance(e["ts"], (int, float)) and e["dur"] >= 0 for e in complete)
            assert sum(1 for e in complete if e["name"].startswith("ProfilerStep#")) == 1  # active=1 step kept
            assert any(e["name"] == "[memory]" for e in events)  # profile_memory=True


def test_the_traces_hold_the_collectives_of_ddp_and_fsdp2_on_the_backend_s_threads(lesson_traces):
    ddp, fsdp = (traces.load_trace(p) for p in lesson_traces[0][0])
    ddp_names = {e["name"]: e["tid"] for e in traces.complete_events(ddp)}
    assert "c10d::allreduce_" in ddp_names and "gloo:all_reduce" in ddp_names
    assert ddp_names["gloo:all_reduce"] != ddp_names["c10d::allreduce_"]  # gloo works on threads of its own
    fsdp_names = collections.Counter(e["name"] for e in traces.complete_events(fsdp))
    gathers, scatters = fsdp_names["c10d::_allgather_base_"], fsdp_names["c10d::_reduce_scatter_base_"]
    assert gathers and scatters
    # the mixed-precision casts: per all-gather, one foreach copy casts the shards, one fills the buffer
    assert fsdp_names["aten::_foreach_copy_"] == 2 * gathers, fsdp_names
    assert fsdp_names["aten::_chunk_cat"] == scatters, fsdp_names  # bfloat16 gradients into float32 buffers


def test_a_schedule_keeps_only_the_active_steps(tmp_path):
    x = torch.randn(32, 32)
    path = traces.profile_steps(lambda: (x @ x).sum(), str(tmp_path), wait=2, warmup=1, active=3)
    steps = sorted(e["name"] for e in traces.complete_events(traces.load_trace(path))
                   if e["name"].startswith("ProfilerStep#"))
    assert steps == ["ProfilerStep#3", "ProfilerStep#4", "ProfilerStep#5"]


def test_a_schedule_without_an_active_step_is_refused(tmp_path):
    with pytest.raises(ValueError, match="active >= 1"):
        traces.profile_steps(lambda: None, str(tmp_path), active=0)


def test_load_trace_says_what_is_wrong_with_a_file_that_is_no_trace(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="is not JSON"):
        traces.load_trace(str(bad))
    bad.write_text('{"traceEvents": [{"name": "x"}]}')
    with pytest.raises(ValueError, match="without a phase"):
        traces.load_trace(str(bad))


def test_a_busy_thread_shows_in_a_trace_of_every_thread(tmp_path):
    x = torch.randn(64, 64)
    with traces.BusyThread(size=64) as helper:
        path = traces.profile_steps(lambda: (time.sleep(0.02), x @ x), str(tmp_path), wait=0, warmup=1, active=2,
                                    all_threads=True)  # the sleep lets the helper run while a step is recorded
    tids = {e["tid"] for e in traces.complete_events(traces.load_trace(path)) if e.get("cat") == "cpu_op"}
    assert helper.tid in tids and len(tids) >= 2


def test_memory_snapshot_needs_a_gpu_and_says_so():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: test_memory_snapshot_on_a_gpu runs instead")
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        traces.memory_snapshot(lambda: None, "unused.pickle")


@pytest.mark.gpu
def test_memory_snapshot_on_a_gpu(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import pickle

    out = traces.memory_snapshot(lambda: torch.empty(2**20, device="cuda").sum(), str(tmp_path / "snap.pickle"))
    assert out["peak_bytes"] >= 4 * 2**20
    with open(out["path"], "rb") as f:
        assert "segments" in pickle.load(f)


@pytest.mark.gpu
def test_a_gpu_trace_has_kernels_on_a_stream_lane(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from mgpu_lab.profiling import lanes

    x = torch.randn(256, 256, device="cuda")
    trace = traces.load_trace(traces.profile_steps(lambda: (x @ x).sum(), str(tmp_path)))
    assert any(name.startswith("GPU stream") and spans for name, spans in lanes.lanes(trace))


def test_fsdp2_with_each_block_compiled_trains_as_eager(lesson_traces):
    for _, compiled in lesson_traces:
        assert compiled["compiled"]["losses"] == pytest.approx(compiled["eager"]["losses"], rel=1e-5)
        assert compiled["eager"]["losses"][1] < compiled["eager"]["losses"][0]

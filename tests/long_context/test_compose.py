"""long_context.compose: CP x DP and EP x DP on 4 real gloo ranks, each collective's group recorded."""
from __future__ import annotations

import pytest
import torch

from mgpu_lab import launch
from mgpu_lab.launcher.errors import LaunchError
from mgpu_lab.long_context import compose


def _steps():
    """In each rank: both steps, right and with the gradient reduced over the DP group only."""
    return {"cp": compose.cp_dp_step(), "cp_dp_only": compose.cp_dp_step(reduce_over="dp"),
            "ep": compose.ep_dp_step(), "ep_dp_only": compose.ep_dp_step(reduce_over="dp")}


@pytest.fixture(scope="module")
def runs():
    return launch(_steps, 4)


CP_GROUP = {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}
DP_GROUP = {0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]}


def test_cp_x_dp_sends_within_the_cp_group_and_reduces_over_every_rank(runs):
    ref = compose.reference_grads("cp")["qkv"]
    for rank, run in enumerate(r["cp"] for r in runs):
        p2p = [e for e in run["events"] if e["op"] in ("send", "recv")]
        # K and V as one message each way: forward to the ring's next rank, backward the gradient home
        assert [(e["op"], e["ranks"], e["peer"]) for e in p2p] == [
            (op, CP_GROUP[rank], rank ^ 1) for op in ("send", "recv")] * 2, run["events"]
        assert all(e["bytes"] == 2 * (compose.SEQ // 2) * compose.DIM * 8 for e in p2p)
        reduces = [e for e in run["events"] if e["op"] not in ("send", "recv")]
        assert [(e["op"], e["ranks"]) for e in reduces] == [("all_reduce", [0, 1, 2, 3])]
        assert torch.allclose(run["grads"]["qkv"], ref, atol=1e-12), rank


def test_cp_x_dp_reducing_over_the_dp_group_only_gives_a_wrong_gradient(runs):
    ref = compose.reference_grads("cp")["qkv"]
    for rank, run in enumerate(r["cp_dp_only"] for r in runs):
        assert [e["ranks"] for e in run["events"] if e["op"] == "all_reduce"] == [DP_GROUP[rank]]
        assert (run["grads"]["qkv"] - ref).abs().max() > 1e-3, rank


def test_ep_x_dp_all_to_alls_within_ep_shared_over_all_experts_over_dp(runs):
    ref = compose.reference_grads("ep")
    experts = set()
    for rank, run in enumerate(r["ep"] for r in runs):
        a2a = [e for e in run["events"] if e["op"] == "all_to_all"]
        # dispatch and combine, forward and backward: this rank's tokens, T x D float64 each time
        assert [(e["ranks"], e["bytes"]) for e in a2a] == [(CP_GROUP[rank], compose.TOKENS * compose.DIM * 8)] * 4
        reduces = [e["ranks"] for e in run["events"] if e["op"] == "all_reduce"]
        assert reduces == [[0, 1, 2, 3], DP_GROUP[rank]], run["events"]
        assert run["expert"] == rank % 2
        experts.add(run["expert"])
        assert torch.allclose(run["grads"]["shared"], ref["shared"], atol=1e-12), rank
        assert torch.allclose(run["grads"]["expert"], ref["experts"][run["expert"]], atol=1e-12), rank
    assert experts == {0, 1}


def test_ep_x_dp_averaging_the_experts_over_dp_only_doubles_their_gradient(runs):
    ref = compose.reference_grads("ep")
    for run in (r["ep_dp_only"] for r in runs):
        assert torch.allclose(run["grads"]["expert"], 2 * ref["experts"][run["expert"]], atol=1e-12)
        assert torch.allclose(run["grads"]["shared"], ref["shared"], atol=1e-12)


def test_the_table_names_each_group_and_its_mesh_dimension(runs):
    text = compose.table([r["cp"] for r in runs], "cp")
    assert "send       [0, 1]        cp" in text and "all_reduce [0, 1, 2, 3]  dp x cp" in text
    text = compose.table([r["ep"] for r in runs], "ep")
    assert "all_reduce [1, 3]        dp" in text and "all_to_all [2, 3]        ep" in text


def test_a_world_that_is_not_the_2x2_mesh_and_unknown_reductions_are_refused():
    with pytest.raises(LaunchError, match="world_size=2, but the \\(dp, cp\\) mesh is 2 x 2: launch 4 ranks"):
        launch(compose.cp_dp_step, 2)
    with pytest.raises(ValueError, match="reduce_over='cp'"):
        compose.cp_dp_step(reduce_over="cp")
    with pytest.raises(ValueError, match="reduce_over='world'"):
        compose.ep_dp_step(reduce_over="world")
    with pytest.raises(ValueError, match="kind='tp'"):
        compose.reference_grads("tp")

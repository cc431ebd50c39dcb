"""Per-rank progress: bars in the launcher fed by progress() inside real ranks."""
from __future__ import annotations

import time

import torch.distributed as dist

from mgpu_lab import launch, progress
from mgpu_lab.launcher.progressbars import ProgressBoard


def _count(n):
    total = 0
    for i in progress(range(n), desc="steps"):
        time.sleep(0.01 * (dist.get_rank() + 1))
        total += i
    return total


def test_ranks_report_progress_as_text_lines_in_a_terminal(capsys):
    assert launch(_count, 2, 30) == [435, 435]
    lines = capsys.readouterr().out.splitlines()
    for r in (0, 1):
        mine = [ln for ln in lines if ln.startswith(f"[rank {r}/2] steps")]
        assert mine[0] == f"[rank {r}/2] steps   0% 0/30" and mine[-1] == f"[rank {r}/2] steps 100% 30/30"
        counts = [int(ln.rsplit(" ", 1)[1].split("/")[0]) for ln in mine]
        assert counts == sorted(set(counts)) and 3 <= len(counts) <= 12  # advancing, about ten lines


def test_widget_board_makes_one_bar_per_rank_and_advances_it():
    board = ProgressBoard(2, widgets=True)
    board.update(1, {"n": 0, "total": 10, "desc": "epoch 0"})
    board.update(0, {"n": 4, "total": 10, "desc": "epoch 0"})
    board.update(1, {"n": 7, "total": 10, "desc": "epoch 1"})
    rows = board._box.children
    assert len(rows) == 2
    labels = [row.children[0].value for row in rows]
    assert labels == ["[rank 0/2] epoch 0", "[rank 1/2] epoch 1"]
    assert [row.children[1].value for row in rows] == [4, 7]
    assert rows[1].children[2].value == "7/10"


def test_progress_outside_a_launch_is_a_plain_iterator():
    assert list(progress(iter(range(4)), total=4, desc="x")) == [0, 1, 2, 3]

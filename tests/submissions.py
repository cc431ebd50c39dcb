"""Submitted notebooks for the grading tests: a right answer to 01.pick_device, and a notebook writer."""
from __future__ import annotations

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_notebook

PICK_DEVICE_BODY = """
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if index is None:
        return torch.device("cuda", 0) if n else torch.device("cpu")
    if not 0 <= index < n:
        raise ValueError(f"{n} GPUs visible")
    return torch.device("cuda", index)
"""
HEADER = "import torch\nfrom mgpu_lab import check\n"
PICK_DEVICE = HEADER + "def pick_device(index=None):" + PICK_DEVICE_BODY  # right, full marks
CHECK_PICK_DEVICE = "check('01.pick_device', pick_device)"


def notebook(folder: Path, name: str, *sources: str) -> Path:
    """Write ``folder/name``: one code cell per source; its path."""
    path = Path(folder) / name
    nbformat.write(new_notebook(cells=[new_code_cell(s) for s in sources]), path)
    return path

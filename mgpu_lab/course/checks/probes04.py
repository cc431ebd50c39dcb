"""What lesson 04's checks run inside real ranks: the probes and what they hand the learner's code.

Each probe calls the learner's function in a fresh process (``t.call``) or in
real ranks (``t.ranks``) for :mod:`.lesson04`, and returns plain evidence for
the checker to judge in the kernel: which samples each rank read and in which
order, the weights it ended with, which rank called the download and what it
found on return. They are module-level functions of an importable module, so a
rank receives them by name and imports this module, which holds no judging.
"""
from __future__ import annotations

import os
import time

import torch
import torch.distributed as tdist
from torch.utils.data import Dataset

from mgpu_lab import dist as mdist
from mgpu_lab.data import synthetic_classification
from mgpu_lab.download import simulate_nodes


# -- shard_indices -----------------------------------------------------------------------
def shard_all(shard_indices, combos):
    """Probe: ``shard_indices(*combo)`` for each combination: ("ok", list) or ("raised", type, message)."""
    out = []
    for combo in combos:
        try:
            got = shard_indices(*combo)
            got = got.tolist() if isinstance(got, torch.Tensor) else list(got)
            out.append(("ok", [int(i) for i in got]))
        except NotImplementedError:
            raise
        except Exception as exc:  # noqa: BLE001 - the check judges each combination
            out.append(("raised", type(exc).__name__, str(exc)))
    return out


# -- ddp_train ---------------------------------------------------------------------------
class Recorded(Dataset):
    """A data set that appends every index it is asked for to a file (works in DataLoader workers too)."""

    def __init__(self, inner, log_path: str):
        self.inner, self.log_path = inner, log_path

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        with open(self.log_path, "a") as f:
            f.write(f"{int(i)}\n")
        return self.inner[i]


def check_model():
    """The model the ddp_train check trains: the same initial weights in every process."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))


def check_data(n):
    """The data set the ddp_train check trains on: ``n`` samples, 6 features, 3 classes."""
    return synthetic_classification(n, features=6, classes=3, seed=3)


def run_ddp_train(ddp_train, n, epochs, batch_size, lr, log_dir):
    """Probe: the learner's ddp_train in this rank, on a data set that records what it serves."""
    log = os.path.join(log_dir, f"rank{tdist.get_rank()}.log")
    state = ddp_train(check_model, Recorded(check_data(n), log), epochs, batch_size, lr)
    seen = [int(line) for line in open(log)] if os.path.exists(log) else []
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        return {"state": None, "type": type(state).__name__, "seen": seen}
    state = {k.removeprefix("module."): v.detach().cpu().clone() for k, v in state.items()}
    return {"state": state, "type": "dict", "seen": seen}


# -- download_once -----------------------------------------------------------------------
PAYLOAD = bytes(range(256)) * 32


def slow_fetch(root):
    """The function the check decorates: logs its calls, writes data.bin slowly, skips a complete file."""
    root = os.fspath(root)
    with open(os.path.join(root, "calls.log"), "a") as f:
        f.write(f"{os.environ.get('MGPU_LAB_CHECK_ROUND', '?')} {mdist.rank()}\n")
    path = os.path.join(root, "data.bin")
    if os.path.isfile(path) and os.path.getsize(path) == len(PAYLOAD):
        return path
    with open(os.path.join(root, "downloads.log"), "a") as f:
        f.write(f"{os.environ.get('MGPU_LAB_CHECK_ROUND', '?')} {mdist.rank()}\n")
    with open(path, "wb") as f:  # written in place, slowly: an early reader sees half a file
        for i in range(0, len(PAYLOAD), 1024):  # 8 chunks over about 0.3 s
            f.write(PAYLOAD[i:i + 1024])
            f.flush()
            time.sleep(0.04)
    return path


def run_download_once(download_once, roots, ranks_per_node, rounds=2):
    """Probe: simulate the node layout, call the decorated slow_fetch ``rounds`` times."""
    node = simulate_nodes(ranks_per_node)
    fetch = download_once(slow_fetch)
    out = []
    for k in range(rounds):
        os.environ["MGPU_LAB_CHECK_ROUND"] = str(k)
        path = fetch(roots[node])
        ok = isinstance(path, (str, os.PathLike)) and os.path.isfile(path)
        complete = ok and open(path, "rb").read() == PAYLOAD
        out.append({"path": os.fspath(path) if ok else repr(path), "complete": complete})
        tdist.barrier()
    return {"node": node, "rounds": out}


# -- global_mean -------------------------------------------------------------------------
def run_global_mean(global_mean, sums, counts):
    """Probe: this rank's (value, type name) of the learner's global_mean."""
    value = global_mean(sums[tdist.get_rank()], counts[tdist.get_rank()])
    return (value.item() if isinstance(value, torch.Tensor) else value), type(value).__name__

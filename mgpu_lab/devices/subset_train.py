"""Train one small model in this process, on the GPUs it sees: the child of a GPU-subset job.

The plainest way to use a multi-GPU machine for more than one job: start one
process per job and give each a disjoint set of GPUs through
``CUDA_VISIBLE_DEVICES`` (model A on GPUs 0-1, model B on GPUs 2-3). Each child
numbers its own GPUs from ``cuda:0`` and cannot touch the others. The variable
must be in the child's environment when it starts: CUDA reads it once, when
the process first initialises CUDA. This module is what such a child runs;
:class:`mgpu_lab.devices.subset_jobs.SubsetJobs` is the parent that starts them.

One job by hand, as a plain script::

    CUDA_VISIBLE_DEVICES=0,1 python -m mgpu_lab.devices.subset_train --model A --steps 300

With ``--serve`` the child imports torch once, prints ``READY``, then trains
on each ``train STEPS`` line of stdin and answers each with a ``RESULT {json}``
line. Each job trains on the first GPU of its set (``cuda:0`` in the child),
or on the CPU when it sees no GPU.

Example:
    >>> from mgpu_lab.devices.subset_train import cuda_sees, train
    >>> cuda_sees([2, 3], 2)   # on a 2-GPU machine, GPUs 2-3 do not exist
    []
    >>> train("A", steps=5)["device"] in ("cpu", "cuda:0")   # a job's first GPU is its cuda:0
    True
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterable, Sequence

__all__ = ["LEARNING_RATES", "cuda_sees", "main", "train"]

# The jobs differ in one hyper-parameter, as in a small learning-rate sweep.
LEARNING_RATES = {"A": 0.05, "B": 0.2}
# The lines of the protocol between a --serve child and SubsetJobs, its parent.
READY, RESULT = "READY", "RESULT "
_FEATURES, _CLASSES, _HIDDEN, _SAMPLES = 64, 10, 256, 4096


def cuda_sees(ids: Sequence[int], physical_gpus: int) -> list[int]:
    """The physical GPUs a child started with ``CUDA_VISIBLE_DEVICES=ids`` can use.

    CUDA walks the list in order and stops at the first index that does not
    exist, so on a 2-GPU machine ``[0, 1]`` gives GPUs 0 and 1, ``[2, 3]`` gives
    none (the child falls back to the CPU) and ``[1, 5, 0]`` gives only GPU 1.

    Args:
        ids: The GPU indices put into the child's ``CUDA_VISIBLE_DEVICES``.
        physical_gpus: How many GPUs the machine has.

    Returns:
        The physical indices in the order the child numbers them (``cuda:0``
        first); empty when the child sees no GPU.

    Example:
        >>> cuda_sees([2, 3], 4), cuda_sees([2, 3], 2), cuda_sees([0, 1], 1)
        ([2, 3], [], [0])
    """
    seen = []
    for gpu in ids:
        if not 0 <= gpu < physical_gpus:
            break
        seen.append(gpu)
    return seen


def train(name: str, steps: int = 300, batch_size: int = 256) -> dict:
    """Train job ``name`` from scratch in this process: on ``cuda:0`` if a GPU is visible, else the CPU.

    The data (a learnable synthetic classification set) and the initial weights
    are the same on every call, so every run of a job does the same work.

    Args:
        name: A key of :data:`LEARNING_RATES` (``"A"`` or ``"B"``).
        steps: Optimisation steps, one batch each.
        batch_size: Samples per batch.

    Returns:
        A dict with ``visible``, ``gpu_count``, ``device``, ``lr``, ``steps``,
        ``first_loss``, ``last_loss`` and ``train_s``.

    Raises:
        ValueError: For an unknown name, or ``steps`` or ``batch_size`` below 1.

    Example:
        >>> run = train("B", steps=20)
        >>> run["steps"], run["last_loss"] < run["first_loss"]
        (20, True)
    """
    if name not in LEARNING_RATES:
        raise ValueError(f"model {name!r} is not one of {sorted(LEARNING_RATES)}; use 'A' or 'B'")
    if steps < 1 or batch_size < 1:
        raise ValueError(f"steps={steps} and batch_size={batch_size} must both be at least 1")
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = torch.device("cuda", 0) if gpus else torch.device("cpu")
    gen = torch.Generator().manual_seed(1)
    inputs = torch.randn(_SAMPLES, _FEATURES, generator=gen)
    labels = (inputs @ torch.randn(_FEATURES, _CLASSES, generator=gen)).argmax(dim=1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(_FEATURES, _HIDDEN), torch.nn.ReLU(),
                                torch.nn.Linear(_HIDDEN, _CLASSES)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATES[name], momentum=0.9)
    losses = []
    start = time.perf_counter()
    for _ in range(steps):
        index = torch.randint(0, _SAMPLES, (batch_size,), generator=gen)
        x, y = inputs[index].to(device), labels[index].to(device)
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    losses = [float(v) for v in losses]  # on a GPU: one wait for the results, not one per step
    return {"visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "gpu_count": gpus, "device": str(device),
            "lr": LEARNING_RATES[name], "steps": steps, "first_loss": losses[0], "last_loss": losses[-1],
            "train_s": time.perf_counter() - start}


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m mgpu_lab.devices.subset_train``: say what this process sees, then train.

    Without ``--serve`` it trains once. With ``--serve`` it prints ``READY``
    and then trains each time a line ``train STEPS`` arrives on stdin, until
    stdin closes. Every run ends with a line ``RESULT {json}``.

    Args:
        argv: Command-line arguments (default ``sys.argv[1:]``).

    Returns:
        The exit code, 0 on success.

    Example:
        >>> main(["--model", "A", "--steps", "5"])
        pid ... · CUDA_VISIBLE_DEVICES=... · ...
        model A (lr 0.05) on ...: loss ... -> ... in 5 steps, ... s
        RESULT {"visible": ...}
        0
    """
    parser = argparse.ArgumentParser(prog="python -m mgpu_lab.devices.subset_train",
                                     description="Train one small model on the GPUs this process sees.")
    parser.add_argument("--model", required=True, choices=sorted(LEARNING_RATES))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads torch may use (default 1)")
    parser.add_argument("--serve", action="store_true", help="train on each 'train STEPS' line of stdin")
    args = parser.parse_args(argv)
    import torch

    from mgpu_lab.devices import describe

    torch.set_num_threads(args.threads)
    print(f"pid {os.getpid()} · CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r} · "
          f"{describe()}", flush=True)
    orders = _orders(sys.stdin) if args.serve else [args.steps]
    if args.serve:
        # One step first, so that one-time costs (torch.optim imports torch._dynamo
        # on first use: seconds on a busy machine) count as start-up, not training.
        train(args.model, 1)
        print(READY, flush=True)
    for steps in orders:
        result = train(args.model, steps)
        print(f"model {args.model} (lr {result['lr']}) on {result['device']}: loss {result['first_loss']:.3f} "
              f"-> {result['last_loss']:.3f} in {steps} steps, {result['train_s']:.2f} s", flush=True)
        print(RESULT + json.dumps(result), flush=True)
    if args.serve:
        # Nothing is left to clean up; skip the interpreter's teardown of torch,
        # which takes seconds on a busy machine while the parent waits.
        sys.stdout.flush()
        os._exit(0)
    return 0


def _orders(lines: Iterable[str]):
    """The step counts of ``train STEPS`` lines; stops at the end of input or ``quit``."""
    for line in lines:
        words = line.split()
        if words == ["quit"]:
            return
        if len(words) != 2 or words[0] != "train" or not words[1].isdigit():
            raise ValueError(f"expected 'train STEPS' or 'quit' on stdin, got {line.strip()!r}")
        yield int(words[1])


if __name__ == "__main__":
    sys.exit(main())

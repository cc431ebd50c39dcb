"""PyTorch's own gradient bucketing: which parameters DDP puts in which bucket, for given sizes and a cap.

The course's checks and the library's tests use it (``tests/comm/test_ddp_buckets.py``
holds it against the buckets a real DDP forms).

Example:
    >>> torch_bucket_assignment([400, 400, 400], cap_bytes=800)
    [[2, 1], [0]]
"""
from __future__ import annotations

import torch
import torch.distributed as tdist

__all__ = ["torch_bucket_assignment"]


def torch_bucket_assignment(param_bytes: list[int], cap_bytes: int) -> list[list[int]]:
    """The buckets PyTorch forms for parameters of these sizes, as DDP rebuilds them.

    Calls ``torch.distributed._compute_bucket_assignment_by_size``, the function
    DDP's reducer uses, with the parameters in gradient-ready order (the reverse of
    registration order) and one cap, which is what DDP does from the second
    iteration on when ``bucket_cap_mb`` is given (the first iteration puts
    everything in one bucket; without ``bucket_cap_mb`` the first bucket's cap is
    1 MiB and the others' 25 MiB).

    Args:
        param_bytes: bytes of each parameter, in registration order.
        cap_bytes: the bucket cap in bytes (``bucket_cap_mb * 2**20``).

    Returns:
        Buckets in the order they are all-reduced; each a list of parameter indices.

    Raises:
        ValueError: a size or the cap that is not a positive int.
    """
    for name, value in [("cap_bytes", cap_bytes)] + [(f"param_bytes[{i}]", b) for i, b in enumerate(param_bytes)]:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int (bytes)")
    if not param_bytes:
        return []  # no parameters, no buckets (the C++ function asserts on an empty list)
    order = list(reversed(range(len(param_bytes))))
    tensors = [torch.empty(param_bytes[i], dtype=torch.uint8) for i in order]
    buckets, _ = tdist._compute_bucket_assignment_by_size(tensors, [cap_bytes], [False] * len(order), order)
    return [list(b) for b in buckets]

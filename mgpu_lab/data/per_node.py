"""Once per node: one rank of each node runs a download, the others wait and get its result.

:func:`run_once` makes a function (a download: ``per_node.run_once(fetch_archive)``)
run on local rank 0 of every node while the node's other ranks wait for its result;
``scripts/ddp_train.py`` uses it with :func:`mgpu_lab.data.download.fetch_archive`.
"""
from __future__ import annotations

import functools

from mgpu_lab import dist as mdist

__all__ = ["run_once"]


def run_once(fn):
    """Decorate ``fn(root, ...) -> path`` so that one rank per node runs it.

    Local rank 0 of every node calls ``fn``; the other ranks of the node wait
    (the gather below is a barrier) and get local rank 0's return value, so no
    rank continues before the file is complete. Outside a process group, ``fn``
    simply runs. An error in ``fn`` is raised on every rank instead of leaving
    the others waiting forever.

    Args:
        fn: the download function; it should skip a file it finds complete.

    Returns:
        The wrapped function, same signature.

    Raises:
        RuntimeError: ``fn`` raised on some node (the message names the node and the error).

    Example:
        >>> import tempfile
        >>> from mgpu_lab import launch
        >>> from mgpu_lab.data.per_node import run_once
        >>> def each_rank(marks):
        ...     @run_once
        ...     def get(root):                   # stands in for fetch_archive(url, root, md5)
        ...         with open(f"{root}/downloads", "a") as f:
        ...             f.write("x")
        ...         return root
        ...     return get(marks)                # every rank calls it; the node's local rank 0 runs it
        >>> marks = tempfile.mkdtemp()
        >>> _ = launch(each_rank, 2, marks)
        launch: 2 ranks · ...
        >>> open(f"{marks}/downloads").read()    # one node here: one download
        'x'
    """
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return fn(*args, **kwargs)
        me = mdist.info()
        answer = None
        if me.local_rank == 0:
            try:
                answer = ("ok", fn(*args, **kwargs))
            except Exception as exc:  # noqa: BLE001 - re-raised on every rank below
                answer = ("error", f"{type(exc).__name__}: {exc}")
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (me.node_rank, me.local_rank, answer))
        for node, local, result in everyone:
            if local == 0 and result[0] == "error":
                raise RuntimeError(f"per_node.run_once: {fn.__name__} failed on node {node}: {result[1]}")
        leader = [result for node, local, result in everyone if node == me.node_rank and local == 0]
        if not leader:
            raise RuntimeError(f"per_node.run_once: node {me.node_rank} has no local rank 0; check "
                               "LOCAL_RANK and GROUP_RANK (torchrun sets them)")
        return leader[0][1]

    return wrapper

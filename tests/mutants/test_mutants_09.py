"""Lesson 09's named mutants (learner bugs put into the solution's source) and correct variants."""
from __future__ import annotations

import functools

import pytest

from mutation import ExerciseMutants, Mutant, Variant, mutant_tests, prelude, replace

pytestmark = pytest.mark.timeout(600)
NOTEBOOK = "09_inside_ddp.ipynb"

RING_WAIT = ("reqs = [dist.isend(chunks[send_i], right), dist.irecv(incoming, left)]  # both posted: no deadlock\n"
             "        for req in reqs:\n            req.wait()")
RING = ExerciseMutants("09.ring_allreduce", NOTEBOOK, ("ring_allreduce",), mutants=[
    Mutant("every rank sends first with a blocking send (deadlock)",
           replace(RING_WAIT, "dist.send(chunks[send_i], right)\n        dist.recv(incoming, left)"),
           expect=("deadlock", "irecv")),
    Mutant("torch.chunk instead of tensor_split (fewer chunks than ranks)",
           replace("flat.tensor_split(world)", "flat.chunk(world)"), expect="tensor_split"),
    Mutant("no all-gather phase: each rank keeps partial sums",
           replace("for step in range(world - 1):  # all-gather", "for step in range(0):  # all-gather"),
           expect=("all-gather", "elements differ")),
    Mutant("calls dist.all_reduce instead of building it",
           replace("    rank, world = dist.get_rank(), dist.get_world_size()\n",
                   "    out = tensor.clone()\n    dist.all_reduce(out)\n    return out\n"),
           expect=("collectives used: all_reduce",)),
    Mutant("passes the whole tensor around the ring W-1 times",
           replace("    for step in range(world - 1):  # reduce-scatter",
                   "    total, passing = flat.clone(), flat.clone()\n"
                   "    for _ in range(world - 1):\n"
                   "        incoming = torch.empty_like(passing)\n"
                   "        reqs = [dist.isend(passing, right), dist.irecv(incoming, left)]\n"
                   "        for req in reqs:\n            req.wait()\n"
                   "        total += incoming\n        passing = incoming\n"
                   "    return total.view_as(tensor)\n"
                   "    for step in range(world - 1):  # reduce-scatter"),
           expect=("not the whole tensor", "12012")),
    Mutant("receive buffer made without a device (a CPU tensor on a GPU rank)",
           replace("incoming = torch.empty_like(chunks[recv_i])",
                   "incoming = torch.zeros(len(chunks[recv_i]), dtype=tensor.dtype)"),
           expect=("input's device", "on meta")),
    Mutant("returns the flat tensor, not the input's shape",
           replace("return flat.view_as(tensor)", "return flat"), expect=("input's shape", "[3, 5]")),
], variants=[
    Variant("blocking send/recv ordered by rank parity, chunks copied and concatenated", '''
def ring_allreduce(tensor):
    rank, world = dist.get_rank(), dist.get_world_size()
    chunks = [c.clone() for c in tensor.flatten().tensor_split(world)]
    right, left = (rank + 1) % world, (rank - 1) % world

    def exchange(outgoing, into):
        if rank % 2 == 0:  # even ranks send first, odd ranks receive first: no cycle of waiting sends
            dist.send(outgoing, right)
            dist.recv(into, left)
        else:
            dist.recv(into, left)
            dist.send(outgoing, right)

    for step in range(world - 1):
        s, r = (rank - step) % world, (rank - step - 1) % world
        buf = torch.empty_like(chunks[r])
        exchange(chunks[s], buf)
        chunks[r] = chunks[r] + buf
    for step in range(world - 1):
        s, r = (rank + 1 - step) % world, (rank - step) % world
        buf = torch.empty_like(chunks[r])
        exchange(chunks[s], buf)
        chunks[r] = buf
    return torch.cat(chunks).reshape(tensor.shape)
'''),
    Variant("the ring the other way round, with P2POp and batch_isend_irecv", '''
def ring_allreduce(tensor):
    rank, world = dist.get_rank(), dist.get_world_size()
    out = tensor.detach().clone().reshape(-1)
    parts = out.tensor_split(world)
    to, frm = (rank - 1) % world, (rank + 1) % world   # send left, receive from the right
    pos = (-rank) % world                              # this rank's place along that direction
    for step in range(2 * (world - 1)):
        if step < world - 1:
            send_i, recv_i = (pos - step) % world, (pos - step - 1) % world
            buf = torch.empty_like(parts[recv_i])
        else:
            k = step - (world - 1)
            send_i, recv_i = (pos + 1 - k) % world, (pos - k) % world
            buf = parts[recv_i]
        ops = [dist.P2POp(dist.isend, parts[send_i], to), dist.P2POp(dist.irecv, buf, frm)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        if step < world - 1:
            parts[recv_i].add_(buf)
    return out.reshape(tensor.shape)
'''),
])

BUCKETS = ExerciseMutants("09.bucket_assignment", NOTEBOOK, ("bucket_assignment",), mutants=[
    Mutant("fills the buckets from the first parameter",
           replace("reversed(range(len(param_bytes)))", "range(len(param_bytes))"), expect="reverse order"),
    Mutant("closes only when the size is over the cap, not at it",
           replace("if size >= cap_bytes:", "if size > cap_bytes:"), expect="size >= cap_bytes"),
    Mutant("keeps every bucket under the cap (closes before adding)",
           replace("        current.append(i)\n        size += param_bytes[i]\n        if size >= cap_bytes:"
                   "  # closed once it reaches the cap, the crossing parameter included\n"
                   "            buckets.append(current)\n            current, size = [], 0\n",
                   "        if current and size + param_bytes[i] > cap_bytes:\n"
                   "            buckets.append(current)\n            current, size = [], 0\n"
                   "        current.append(i)\n        size += param_bytes[i]\n"),
           expect="don't close it before adding"),
    Mutant("drops the last, not yet full bucket",
           replace("    if current:\n        buckets.append(current)\n", ""), expect="don't drop it"),
    Mutant("returns the buckets first-parameters-first",
           replace("    return buckets", "    return buckets[::-1]"), expect="bucket 0 is the one holding the last"),
    Mutant("always appends the open bucket, even an empty one",
           replace("    if current:\n        buckets.append(current)\n", "    buckets.append(current)\n"),
           expect="not [[]]"),
    Mutant("never starts a new bucket list (keeps appending to the closed one)",
           replace("            current, size = [], 0\n", "            size = 0\n"), expect="reach cap_bytes"),
], variants=[
    Variant("a queue of indices, buckets sorted ascending", '''
def bucket_assignment(param_bytes, cap_bytes):
    order = list(range(len(param_bytes)))[::-1]
    out = []
    while order:
        bucket, total = [], 0
        while order and total < cap_bytes:
            i = order.pop(0)
            bucket.append(i)
            total += param_bytes[i]
        out.append(sorted(bucket))
    return out
'''),
    Variant("a flag for a new bucket, tuples returned", '''
def bucket_assignment(param_bytes, cap_bytes):
    buckets, start_new, filled = [], True, 0
    for i in range(len(param_bytes) - 1, -1, -1):
        if start_new:
            buckets.append([])
            filled = 0
        buckets[-1].append(i)
        filled += param_bytes[i]
        start_new = filled >= cap_bytes
    return [tuple(b) for b in buckets]
'''),
])

HOOK = ExerciseMutants("09.bf16_compress_hook", NOTEBOOK, ("bf16_compress_hook",), mutants=[
    Mutant("sums instead of averaging", replace(".div_(group.size())", ""), expect="divide by the world size"),
    Mutant("sends float32 (no compression)", replace("buffer.to(torch.bfloat16)", "buffer.clone()"),
           expect="all_reduce of torch.float32"),
    Mutant("returns the bfloat16 tensor", replace("return buffer.copy_(fut.value()[0])", "return fut.value()[0]"),
           expect=("bucket's dtype", "torch.bfloat16")),
    Mutant("returns fut.value(), a list", replace("return buffer.copy_(fut.value()[0])", "return fut.value()"),
           expect="fut.value()[0]"),
    Mutant("casts back to float32, not to the bucket's dtype",
           replace("return buffer.copy_(fut.value()[0])", "return fut.value()[0].float()"),
           expect=("bucket's own dtype", "float64")),
    Mutant("blocking all_reduce, returns a tensor instead of a future",
           replace("return dist.all_reduce(compressed, group=group, async_op=True).get_future().then(decompress)",
                   "dist.all_reduce(compressed, group=group)\n    return buffer.copy_(compressed)"),
           expect="return the future"),
    Mutant("takes state for the group even when it is None",
           replace("group = state if state is not None else dist.group.WORLD", "group = state"),
           expect=("none for the default group", "nonetype")),
], variants=[
    Variant("torch's own bf16_compress_hook",
            "from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook\n"),
    Variant("a blocking all-reduce, divided afterwards, in a completed Future", '''
def bf16_compress_hook(state, bucket):
    buffer = bucket.buffer()
    low = buffer.to(torch.bfloat16)
    dist.all_reduce(low, group=state)
    fut = torch.futures.Future()
    fut.set_result(low.to(buffer.dtype) / dist.get_world_size(state))
    return fut
'''),
])

SPECS = [RING, BUCKETS, HOOK]


@functools.cache
def namespace() -> dict:
    """The notebook's first cell (its imports), as every solution cell sees it."""
    ns: dict = {}
    exec(compile(prelude(NOTEBOOK), "<prelude 09>", "exec"), ns)
    return ns


test_mutant_fails_naming_its_bug, test_correct_variant_passes, test_every_exercise_has_five_mutants_and_two_variants = \
    mutant_tests(SPECS, "09", namespace)

"""Lesson 09's named mutants (learner bugs put into the solution's source) and correct variants."""
from __future__ import annotations

import functools

import pytest

from mutation import ExerciseMutants, Mutant, Variant, mutant_tests, prelude, replace, sub

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
    Mutant("sums into the caller's tensor instead of a new one",
           replace("flat = tensor.reshape(-1).clone()", "flat = tensor.reshape(-1)"),
           expect=("new tensor", "the input holds the sum")),
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

MINI = ExerciseMutants("09.MiniDDP", NOTEBOOK, ("MiniDDP",), mutants=[
    Mutant("all-reduces every bucket in finish_gradient_sync, after backward",
           (replace("self._pending.append((i, flat, dist.all_reduce(flat, async_op=True)))",
                    "self._pending.append((i, flat, None))"),
            replace("work.wait()", "dist.all_reduce(flat)")),
           expect="while backward goes on"),
    Mutant("a blocking all-reduce in the hook",
           (replace("dist.all_reduce(flat, async_op=True)", "dist.all_reduce(flat)"), replace("work.wait()", "pass")),
           expect=("blocking", "asynchronously")),
    Mutant("sums instead of averaging", replace(".div_(dist.get_world_size())", ""), expect="world_size times"),
    Mutant("fills the buckets from the first parameter", replace("for p in reversed(params):", "for p in params:"),
           expect="filled from the first parameter"),
    Mutant("closes a bucket only above the cap, not at it",
           replace("if size >= bucket_cap_bytes:", "if size > bucket_cap_bytes:"), expect="exactly at the cap"),
    Mutant("one all-reduce per parameter, no buckets",
           replace("if size >= bucket_cap_bytes:", "if True:"), expect="one all-reduce per parameter"),
    Mutant("never resets what counts the ready gradients",
           replace("        self._ready = [0] * len(self._buckets)\n        ### END SOLUTION",
                   "        ### END SOLUTION"),
           expect="start over every step"),
    Mutant("never copies the average back into .grad",
           replace("p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))", "pass"), expect="still its own"),
    Mutant("no broadcast: every rank keeps its own initial weights",
           replace("                dist.broadcast(tensor, src=0)  # every rank starts from rank 0's weights",
                   "                pass"), expect="rank 0's parameters"),
    Mutant("starts each bucket's all-reduce asynchronously and waits on it at once, in the hook",
           replace("self._pending.append((i, flat, dist.all_reduce(flat, async_op=True)))",
                   "work = dist.all_reduce(flat, async_op=True)\n            work.wait()\n"
                   "            self._pending.append((i, flat, work))"),
           expect=("waited on at once", "before all-reduce 1 started")),
    Mutant("a blocking all-reduce per parameter: the blocking named beside the count",
           (replace("dist.all_reduce(flat, async_op=True)", "dist.all_reduce(flat)"), replace("work.wait()", "pass"),
            replace("if size >= bucket_cap_bytes:", "if True:")),
           expect=("one all-reduce per parameter", "blocking")),
    Mutant("divides by a hard-coded 2 (right on 2 ranks only)",
           replace(".div_(dist.get_world_size())", ".div_(2)"), expect="divided by 2"),
    Mutant("broadcasts the parameters but not the buffers",
           replace("for tensor in [*module.parameters(), *module.buffers()]:", "for tensor in module.parameters():"),
           expect=("buffers", "buffer 0 differs")),
    Mutant("refuses a parameter larger than the cap",
           replace("            bucket.append(p)\n",
                   "            if p.numel() * p.element_size() > bucket_cap_bytes:\n"
                   "                raise ValueError('parameter larger than the bucket cap')\n"
                   "            bucket.append(p)\n"),
           expect=("larger than the cap is no error", "parameter larger than the bucket cap")),
    Mutant("puts parameters that require no gradient in a bucket",
           replace("params = [p for p in module.parameters() if p.requires_grad]",
                   "params = list(module.parameters())"),
           expect="requires no gradient"),
], variants=[
    Variant("gradients copied into a flat buffer per bucket as they arrive, views back at the end", '''
class MiniDDP(nn.Module):
    def __init__(self, module, bucket_cap_bytes):
        super().__init__()
        self.module = module
        for t in list(module.state_dict().values()):
            dist.broadcast(t, 0)
        trainable = [p for p in module.parameters() if p.requires_grad][::-1]
        groups, cur, filled = [], [], 0
        for p in trainable:
            cur.append(p)
            filled += p.nbytes
            if filled >= bucket_cap_bytes:
                groups.append(cur)
                cur, filled = [], 0
        groups += [cur] if cur else []
        self.groups = groups
        self.buffers_ = [torch.zeros(sum(p.numel() for p in g), dtype=g[0].dtype) for g in groups]
        self.where = {}
        for b, g in enumerate(groups):
            offset = 0
            for p in g:
                self.where[id(p)] = (b, offset)
                offset += p.numel()
        self.missing = [len(g) for g in groups]
        self.works = {}
        for p in trainable:
            p.register_post_accumulate_grad_hook(self.on_grad)

    def on_grad(self, p):
        b, offset = self.where[id(p)]
        self.buffers_[b][offset:offset + p.numel()].copy_(p.grad.reshape(-1))
        self.missing[b] -= 1
        if self.missing[b] == 0:
            self.works[b] = dist.all_reduce(self.buffers_[b], async_op=True)

    def forward(self, x):
        return self.module(x)

    def finish_gradient_sync(self):
        world = dist.get_world_size()
        for b in sorted(self.works):
            self.works[b].wait()
            for p in self.groups[b]:
                _, offset = self.where[id(p)]
                p.grad = (self.buffers_[b][offset:offset + p.numel()] / world).view_as(p).clone()
        self.works = {}
        self.missing = [len(g) for g in self.groups]
'''),
    Variant("torch's flatten helpers, a set of ready parameters, divided after the wait", '''
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


class MiniDDP(nn.Module):
    def __init__(self, module, bucket_cap_bytes):
        super().__init__()
        self.module = module
        with torch.no_grad():
            for p in module.parameters():
                dist.broadcast(p.data, src=0)
            for b in module.buffers():
                dist.broadcast(b, src=0)
        order = [p for p in reversed(list(module.parameters())) if p.requires_grad]
        self.buckets = []
        while order:
            bucket, size = [], 0
            while order and size < bucket_cap_bytes:
                p = order.pop(0)
                bucket.append(p)
                size += p.numel() * p.element_size()
            self.buckets.append(bucket)
        self.ready, self.inflight = set(), []
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda param: self._ready(param))

    def _ready(self, param):
        self.ready.add(id(param))
        for bucket in self.buckets:
            ids = {id(q) for q in bucket}
            if id(param) in ids and ids <= self.ready:
                flat = _flatten_dense_tensors([q.grad for q in bucket])
                self.inflight.append((bucket, flat, dist.all_reduce(flat, op=dist.ReduceOp.SUM, async_op=True)))

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_sync(self):
        for bucket, flat, work in self.inflight:
            work.wait()
            flat /= dist.get_world_size()
            for q, g in zip(bucket, _unflatten_dense_tensors(flat, [q.grad for q in bucket])):
                q.grad.copy_(g)
        self.inflight, self.ready = [], set()
'''),
])

HOOK = ExerciseMutants("09.error_feedback_hook", NOTEBOOK, ("error_feedback_hook",), mutants=[
    Mutant("keeps the residual but never adds it back (plain bf16)",
           replace("        wanted += residual\n", "        pass\n"), expect="no better than plain bf16"),
    Mutant("subtracts the residual instead of adding it", replace("wanted += residual", "wanted -= residual"),
           expect="wrong sign"),
    Mutant("the residual measured against the all-reduced average",
           (sub(r"^    state\[bucket.index\(\)\] = wanted - compressed.*\n", ""),
            replace("        return buffer.copy_(fut.value()[0])",
                    "        state[bucket.index()] = wanted - fut.value()[0].to(wanted.dtype)\n"
                    "        return buffer.copy_(fut.value()[0])")),
           expect="not the difference from the all-reduced average"),
    Mutant("adds the residual kept under an index whatever its size (buckets rebuilt)",
           replace("if residual is not None and residual.shape == wanted.shape:", "if residual is not None:"),
           expect="rebuilds its buckets"),
    Mutant("sums instead of averaging", replace("wanted = buffer / dist.get_world_size()", "wanted = buffer.clone()"),
           expect="world_size times"),
    Mutant("returns the bfloat16 tensor", replace("return buffer.copy_(fut.value()[0])", "return fut.value()[0]"),
           expect=("bucket's dtype and shape", "torch.bfloat16")),
    Mutant("one residual for all buckets",
           (replace("state.get(bucket.index())", "state.get('residual')"),
            replace("state[bucket.index()] = wanted", "state['residual'] = wanted")),
           expect="under bucket.index()"),
    Mutant("sends float32 (no compression)",
           replace("compressed = wanted.to(torch.bfloat16)", "compressed = wanted.clone()"),
           expect="all_reduce of torch.float32"),
], variants=[
    Variant("residual in the gradient's own units, divided after the all-reduce", '''
def error_feedback_hook(state, bucket):
    grad = bucket.buffer()
    key = bucket.index()
    if key in state and state[key].numel() == grad.numel():
        corrected = grad + state[key]
    else:
        corrected = grad.clone()
    low = corrected.bfloat16()
    state[key] = corrected - low.float()
    world = dist.get_world_size()

    def back(fut):
        return (fut.value()[0].to(grad.dtype) / world).reshape(grad.shape)

    return dist.all_reduce(low, async_op=True).get_future().then(back)
'''),
    Variant("the group's size, a residual reset by pop, torch.sub", '''
def error_feedback_hook(state, bucket):
    buffer = bucket.buffer()
    group = dist.group.WORLD
    old = state.pop(bucket.index(), None)
    x = buffer.div(group.size())
    if old is not None and old.shape == x.shape:
        x.add_(old)
    sent = x.to(torch.bfloat16)
    state[bucket.index()] = torch.sub(x, sent.to(x.dtype))
    work = dist.all_reduce(sent, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0].to(buffer.dtype))
'''),
])

SPECS = [RING, MINI, HOOK]


@functools.cache
def namespace() -> dict:
    """The notebook's first cell (its imports), as every solution cell sees it."""
    ns: dict = {}
    exec(compile(prelude(NOTEBOOK), "<prelude 09>", "exec"), ns)
    return ns


test_mutant_fails_naming_its_bug, test_correct_variant_passes, test_every_exercise_has_five_mutants_and_two_variants = \
    mutant_tests(SPECS, "09", namespace, at_once=4)

"""Lesson 13's named mutants (learner bugs put into the solution's source) and correct variants."""
from __future__ import annotations

import functools

import pytest

from mgpu_lab.course.checks.l13.ranks import CACHE_ENV
from mutation import ExerciseMutants, Mutant, Variant, mutant_tests, prelude, replace, solution_cell

pytestmark = pytest.mark.timeout(600)
NOTEBOOK = "13_time_and_memory.ipynb"


@pytest.fixture(scope="module", autouse=True)
def recorded_once(tmp_path_factory):
    """The ranks record the traces 13.exposed_comm and 13.find_straggler are judged on once for all their mutants
    and variants (and for tests/course/checks/test_checks_13.py in the same session)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv(CACHE_ENV, str(tmp_path_factory.getbasetemp() / "l13-traces"))
        yield


EXPOSED = ExerciseMutants("13.exposed_comm", NOTEBOOK, ("exposed_comm",), mutants=[
    Mutant("adds up the communication durations", replace("    points = []\n", "    return sum(e['dur'] for e in comm) / 1000\n"),
           expect="added up the durations"),  # a loaded machine's numbers may fit other mistakes too
    Mutant("counts collectives in flight together once each",
           replace("exposed += ts - last", "exposed += (ts - last) * depth['comm']"), expect="counted once each"),
    Mutant("lets every thread's operators hide communication",
           replace('ops = [e for e in events if e["tid"] == rank_thread and', "ops = [e for e in events if"),
           expect="operators of other threads"),
    Mutant("counts labels (user annotations) as computing",
           replace('e.get("cat") == "cpu_op" and not is_comm(e)',
                   'e.get("cat") in ("cpu_op", "user_annotation") and not is_comm(e)'),
           expect="labels"),
    Mutant("counts time inside a collective call as computing",
           replace('computing = depth["op"] > 0 and depth["call"] == 0', 'computing = depth["op"] > 0'),
           expect="inside a communication call"),
    Mutant("only the c10d:: calls are communication",
           replace('startswith(("c10d::", "gloo:", "nccl:"))', 'startswith("c10d::")'), expect="backend's own events"),
    Mutant("returns microseconds", replace("return exposed / 1000", "return exposed"), expect="milliseconds"),
    Mutant("ignores rank_thread", replace("if rank_thread is None:", "if True:"), expect="rank_thread was ignored"),
], variants=[
    Variant("merged intervals, subtraction by walking two sorted lists", '''
def exposed_comm(trace, rank_thread=None):
    xs = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    comm_names = ("c10d::", "gloo:", "nccl:")
    if rank_thread is None:
        per_thread = {}
        for e in xs:
            if e.get("cat") == "cpu_op":
                per_thread[e["tid"]] = per_thread.get(e["tid"], 0.0) + e["dur"]
        rank_thread = max(per_thread, key=per_thread.get) if per_thread else None

    def merge(spans):
        merged = []
        for a, b in sorted(spans):
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        return merged

    def subtract(spans, holes):
        left = []
        for a, b in spans:
            pieces = [[a, b]]
            for h0, h1 in holes:
                pieces = [q for p in pieces for q in ([p[0], min(p[1], h0)], [max(p[0], h1), p[1]]) if q[0] < q[1]]
            left += pieces
        return left

    comm = merge((e["ts"], e["ts"] + e["dur"]) for e in xs if e["name"].startswith(comm_names))
    main = [e for e in xs if e["tid"] == rank_thread]
    ops = merge((e["ts"], e["ts"] + e["dur"]) for e in main if e.get("cat") == "cpu_op"
                and not e["name"].startswith(comm_names))
    calls = merge((e["ts"], e["ts"] + e["dur"]) for e in main if e["name"].startswith(comm_names))
    computing = merge(subtract(ops, calls))
    return sum(b - a for a, b in subtract(comm, computing)) / 1e3
'''),
    Variant("elementary segments between all boundaries, bisect on merged lists", '''
import bisect


def exposed_comm(trace, rank_thread=None):
    ev = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    is_comm = lambda e: any(e["name"].startswith(p) for p in ("c10d::", "gloo:", "nccl:"))
    if rank_thread is None:
        tids = collections.defaultdict(float)
        for e in ev:
            if e.get("cat") == "cpu_op":
                tids[e["tid"]] += e["dur"]
        rank_thread = max(tids.items(), key=lambda kv: kv[1])[0] if tids else None

    def covered(spans):
        starts, ends = [], []
        for a, b in sorted(spans):
            if ends and a <= ends[-1]:
                ends[-1] = max(ends[-1], b)
            else:
                starts.append(a)
                ends.append(b)
        return lambda t: (i := bisect.bisect_right(starts, t) - 1) >= 0 and t < ends[i]

    span = lambda e: (e["ts"], e["ts"] + e["dur"])
    in_comm = covered([span(e) for e in ev if is_comm(e)])
    in_op = covered([span(e) for e in ev if e["tid"] == rank_thread and e.get("cat") == "cpu_op" and not is_comm(e)])
    in_call = covered([span(e) for e in ev if e["tid"] == rank_thread and is_comm(e)])
    cuts = sorted({t for e in ev for t in span(e)})
    total = 0.0
    for a, b in zip(cuts, cuts[1:]):
        mid = (a + b) / 2
        if in_comm(mid) and not (in_op(mid) and not in_call(mid)):
            total += b - a
    return total / 1000
'''),
])

SAVED = ExerciseMutants("13.saved_bytes", NOTEBOOK, ("saved_bytes",), mutants=[
    Mutant("counts a storage every time it is saved",
           replace("if running[0] is not None and key not in seen:", "if running[0] is not None:"),
           expect=("counted more than once",)),
    Mutant("leaves out saved parameters",
           replace("        if running[0] is not None and key not in seen:",
                   "        if key in {p.untyped_storage().data_ptr() for p in model.parameters()}:\n"
                   "            return t\n"
                   "        if running[0] is not None and key not in seen:"),
           expect=("missing", "parameter")),
    Mutant("counts a view's own bytes, not its storage's",
           replace("counted[running[0]] += storage.nbytes()", "counted[running[0]] += t.numel() * t.element_size()"),
           expect="whole storage"),
    Mutant("assumes 4 bytes per element",
           replace("counted[running[0]] += storage.nbytes()",
                   "counted[running[0]] += storage.nbytes() // t.element_size() * 4"),
           expect="2 bytes"),
    Mutant("tells storages apart by the tensor's address, not the storage's",
           replace("key = storage.data_ptr()", "key = t.data_ptr()"), expect="counted more than once"),
    Mutant("names the module after it ran (a forward hook, not a pre-hook)",
           replace("child.register_forward_pre_hook(enter(name))", "child.register_forward_hook(enter(name))"),
           expect="missing"),
    Mutant("lists only the modules that saved something",
           (replace("counted = {name: 0 for name, _ in model.named_children()}", "counted = {}"),
            replace("counted[running[0]] += storage.nbytes()",
                    "counted[running[0]] = counted.get(running[0], 0) + storage.nbytes()")),
           expect="one key per top-level module"),
], variants=[
    Variant("a stack of module names from pre- and post-hooks, storages kept until the end", '''
def saved_bytes(model, x):
    children = dict(model.named_children())
    owner = {}          # storage address -> (module name, bytes), for the first module that saves it
    stack = []
    hooks = []
    for name, child in children.items():
        hooks.append(child.register_forward_pre_hook(lambda m, a, name=name: stack.append(name)))
        hooks.append(child.register_forward_hook(lambda m, a, o: stack.pop() and None))  # None: output kept

    def pack(t):
        s = t.untyped_storage()
        if stack and s.data_ptr() not in owner:
            owner[s.data_ptr()] = (stack[-1], s.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    for h in hooks:
        h.remove()
    totals = dict.fromkeys(children, 0)
    for name, n in owner.values():
        totals[name] += n
    return totals
'''),
    Variant("each child run on its own, the storages of earlier children remembered", '''
def saved_bytes(model, x):
    seen, totals, current = set(), {}, {"name": None}

    def pack(t):
        st = t.untyped_storage()
        if current["name"] is not None and st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            totals[current["name"]] += st.nbytes()
        return t

    def wrap(name, module):
        original = module.forward

        def forward(*args, **kwargs):
            current["name"] = name
            return original(*args, **kwargs)
        return forward

    for name, module in model.named_children():
        totals[name] = 0
        module.forward = wrap(name, module)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            result = model(x)
    finally:
        for name, module in model.named_children():
            del module.forward
    return totals
'''),
])

CKPT = ExerciseMutants("13.checkpoint_under", NOTEBOOK, ("checkpoint_under",), mutants=[
    Mutant("checkpoints the last blocks first", replace("sorted(gains, reverse=True)", "sorted(gains, key=lambda g: -g[1])"),
           expect="not the fewest"),
    Mutant("checkpoints the block that saves least first", replace("sorted(gains, reverse=True)", "sorted(gains)"),
           expect="not the fewest"),
    Mutant("checkpoints blocks in order, first to last", replace("sorted(gains, reverse=True)", "gains"),
           expect="not the fewest"),
    Mutant("reentrant checkpoint", replace("use_reentrant=False", "use_reentrant=True"),
           expect=("no gradient", "use_reentrant=False", "looked met only because reentrant checkpointing")),
    Mutant("no ValueError for a budget that cannot be met",
           replace("    if now > budget_bytes:\n        raise", "    if False:\n        raise"), expect="returned a model"),
    Mutant("the ValueError names the budget, not the smallest reachable size",
           replace('f"{now} bytes are still saved"', '"it is too small"'), expect="smallest reachable"),
    Mutant("a budget met exactly is not met (< instead of <=)",
           (replace("if now <= budget_bytes:", "if now < budget_bytes:"),
            replace("if now > budget_bytes:", "if now >= budget_bytes:")),
           expect="not the fewest"),
    Mutant("checkpoints every block", replace("        if now <= budget_bytes:\n            break\n", ""),
           expect="not the fewest"),
    Mutant("returns a checkpointed copy, the model passed in unchanged",
           (replace("    full = total()\n", "    model = copy.deepcopy(model)\n    full = total()\n"),),
           expect="in place"),
], variants=[
    Variant("every subset tried, the chosen blocks wrapped with torch's checkpoint_wrapper", '''
import itertools

from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper


def checkpoint_under(model, x, budget_bytes):
    n = len(model.blocks)

    def saved_with(chosen):
        trial = copy.deepcopy(model)
        for i in chosen:
            trial.blocks[i] = checkpoint_wrapper(trial.blocks[i])
        return sum(saved_bytes(trial, x).values())

    for k in range(n + 1):
        for chosen in itertools.combinations(range(n), k):
            if saved_with(chosen) <= budget_bytes:
                for i in chosen:
                    model.blocks[i] = checkpoint_wrapper(model.blocks[i])
                return model
    raise ValueError(f"cannot fit {budget_bytes} bytes; the least is {saved_with(range(n))} bytes")
'''),
    Variant("gains from one count per block, a checkpointing module around each chosen block", '''
class Checkpointed(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, h):
        return checkpoint(self.inner, h, use_reentrant=False)


def checkpoint_under(model, x, budget_bytes):
    total = sum(saved_bytes(model, x).values())
    gains = {}
    for i in range(len(model.blocks)):
        block = model.blocks[i]
        model.blocks[i] = Checkpointed(block)
        gains[i] = total - sum(saved_bytes(model, x).values())
        model.blocks[i] = block
    order = sorted(gains, key=gains.get, reverse=True)
    chosen = []
    while total - sum(gains[i] for i in chosen) > budget_bytes and len(chosen) < len(order):
        chosen.append(order[len(chosen)])
    left = total - sum(gains[i] for i in chosen)
    if left > budget_bytes:
        raise ValueError(f"{budget_bytes} bytes is below the smallest reachable: {left} bytes saved with every "
                         "block checkpointed")
    for i in chosen:
        model.blocks[i] = Checkpointed(model.blocks[i])
    return model
'''),
])

STRAGGLER = ExerciseMutants("13.find_straggler", NOTEBOOK, ("find_straggler",), mutants=[
    Mutant("names the rank with the longest step",
           (replace('min(range(len(rows)), key=lambda r: rows[r]["waiting"])',
                    'max(range(len(rows)), key=lambda r: rows[r]["step"])'),
            replace('if -beyond_others("waiting") <', 'if beyond_others("step") <')),
           expect="a step's length does not tell the ranks apart"),
    Mutant("names the rank that waits longest",
           (replace('min(range(len(rows)), key=lambda r: rows[r]["waiting"])',
                    'max(range(len(rows)), key=lambda r: rows[r]["waiting"])'),
            replace('if -beyond_others("waiting") <', 'if beyond_others("waiting") <')),
           expect="ready before the others"),
    Mutant("always names a rank (no threshold)",
           replace('if -beyond_others("waiting") < typical_step / 3:', "if False:"), expect="a third"),
    Mutant("reads the waiting from the training thread's c10d:: calls",
           replace('waiting = exposed_comm({"traceEvents": inside}, main)',
                   'waiting = on_main(lambda n: n.startswith("c10d::"))'),
           expect=("c10d:: calls", "gloo:all_reduce")),
    Mutant("compares only the loaders",
           (replace('min(range(len(rows)), key=lambda r: rows[r]["waiting"])',
                    'max(range(len(rows)), key=lambda r: rows[r]["data"])'),
            replace('if -beyond_others("waiting") <', 'if beyond_others("data") <')),
           expect="only the loaders were compared"),
    Mutant("names the rank with the longest forward and backward labels (waits inside)",
           (replace('min(range(len(rows)), key=lambda r: rows[r]["waiting"])',
                    'max(range(len(rows)), key=lambda r: rows[r]["compute"] + rows[r]["waiting"])'),
            replace('if -beyond_others("waiting") <', 'if beyond_others("compute") + beyond_others("waiting") <')),
           expect="backward label"),
    Mutant("gives the other cause",
           replace('"data" if beyond_others("data") > beyond_others("compute") else "compute"',
                   '"compute" if beyond_others("data") > beyond_others("compute") else "data"'),
           expect="the other cause"),
], variants=[
    Variant("the rank whose own work (its step minus its idle time in backward) is largest", '''
def find_straggler(traces):
    import statistics

    def union(spans):
        out = []
        for a, b in sorted(spans):
            if out and a <= out[-1][1]:
                out[-1][1] = max(out[-1][1], b)
            else:
                out.append([a, b])
        return sum(b - a for a, b in out)

    table = []
    for path in traces:
        with open(path) as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
        main = next(e["tid"] for e in events if e["name"].startswith("ProfilerStep#"))
        mine = [e for e in events if e["tid"] == main]
        steps = []
        for back in (e for e in mine if e["name"] == "backward"):
            a, b = back["ts"], back["ts"] + back["dur"]
            busy = union((e["ts"], e["ts"] + e["dur"]) for e in mine if e.get("cat") == "cpu_op" and a <= e["ts"] < b)
            step = next(e for e in mine if e["name"].startswith("ProfilerStep#") and e["ts"] <= a < e["ts"] + e["dur"])
            s0, s1 = step["ts"], step["ts"] + step["dur"]
            load = sum(e["dur"] for e in mine if e["name"].startswith("enumerate(DataLoader)") and s0 <= e["ts"] < s1)
            fwd = sum(e["dur"] for e in mine if e["name"] == "forward" and s0 <= e["ts"] < s1)
            idle = back["dur"] - busy
            steps.append((step["dur"], step["dur"] - idle, load, fwd + back["dur"] - idle))
        table.append([statistics.median(column) for column in zip(*steps)])
    work = [row[1] for row in table]
    worst = work.index(max(work))
    rest = [row for r, row in enumerate(table) if r != worst]
    extra = [table[worst][i] - statistics.median(row[i] for row in rest) for i in (1, 2, 3)]
    if extra[0] < statistics.median(row[0] for row in table) / 3:
        return {"rank": None, "cause": None}
    return {"rank": worst, "cause": "data" if extra[1] > extra[2] else "compute"}
'''),
    Variant("the waiting as the stretches of backward (over a millisecond) without an operator, added up; loading as "
            "the time before forward",
            '''
def find_straggler(traces):
    import statistics

    rows = []
    for path in traces:
        with open(path) as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and "dur" in e]
        per = collections.defaultdict(list)
        for step in (e for e in events if e["name"].startswith("ProfilerStep#")):
            inside = [e for e in events if step["ts"] <= e["ts"] < step["ts"] + step["dur"]]
            forward = next(e for e in inside if e["name"] == "forward")
            backward = next(e for e in inside if e["name"] == "backward")
            end = backward["ts"] + backward["dur"]
            ops = sorted((e["ts"], e["ts"] + e["dur"]) for e in inside if e.get("cat") == "cpu_op"
                         and e["tid"] == step["tid"] and backward["ts"] <= e["ts"] < end)
            waited, reached = 0.0, backward["ts"]
            for a, b in ops + [(end, end)]:  # DDP waits bucket by bucket: an operator between two of the waits
                if a - reached > 1000:
                    waited += a - reached
                reached = max(reached, b)
            per["step"].append(step["dur"])
            per["wait"].append(waited)
            per["data"].append(forward["ts"] - step["ts"])
            per["compute"].append(forward["dur"] + backward["dur"] - waited)
        rows.append({k: statistics.median(v) for k, v in per.items()})
    typical = statistics.median(r["step"] for r in rows)
    order = sorted(range(len(rows)), key=lambda r: rows[r]["wait"])
    s, others = order[0], [rows[r] for r in order[1:]]
    gap = {k: rows[s][k] - statistics.median(o[k] for o in others) for k in ("wait", "data", "compute")}
    if -gap["wait"] >= typical / 3:
        return {"rank": s, "cause": max(("data", "compute"), key=gap.get)}
    return {"rank": None, "cause": None}
'''),
])

SPECS = [EXPOSED, SAVED, CKPT, STRAGGLER]


@functools.cache
def namespace() -> dict:
    """The notebook's first cell (its imports), the solution's saved_bytes, which checkpoint_under uses, and its
    exposed_comm, which find_straggler uses."""
    ns: dict = {}
    exec(compile(prelude(NOTEBOOK), "<prelude 13>", "exec"), ns)
    exec(compile(solution_cell(NOTEBOOK, "def saved_bytes"), "<saved_bytes 13>", "exec"), ns)
    exec(compile(solution_cell(NOTEBOOK, "def exposed_comm"), "<exposed_comm 13>", "exec"), ns)
    return ns


test_mutant_fails_naming_its_bug, test_correct_variant_passes, test_every_exercise_has_five_mutants_and_two_variants = \
    mutant_tests(SPECS, "13", namespace)

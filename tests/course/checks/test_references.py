"""Tripwires on reference implementations (mgpu_lab.course.checks._references), in this process."""
from __future__ import annotations

import sys
import threading
import types

import pytest

from mgpu_lab.course.checks import _references as refs
from mgpu_lab.course.checks._references import ReferenceCalled, allowed, armed, resolve


@pytest.fixture
def module(monkeypatch):
    """A module with a plain function, a closure, a class and a method, importable as `refmod`."""
    mod = types.ModuleType("refmod")
    exec(
        "def plain(x):\n    return x + 1\n"
        "def make():\n    k = 10\n    def inner(x):\n        return x + k\n    return inner\n"
        "closure = make()\n"
        "class Opt:\n    def __init__(self, lr):\n        self.lr = lr\n    def step(self):\n        return self.lr\n",
        mod.__dict__)
    monkeypatch.setitem(sys.modules, "refmod", mod)
    return mod


def test_every_alias_of_an_armed_function_raises_and_all_comes_back_after(module):
    alias = module.plain  # as `from refmod import plain as alias` would bind it
    with armed(["refmod:plain", "refmod:closure", "refmod:Opt", "refmod:Opt.step"]):
        for call in (lambda: alias(1), lambda: module.closure(1), lambda: module.Opt(0.1)):
            with pytest.raises(ReferenceCalled, match="your code calls refmod"):
                call()
        opt = object.__new__(module.Opt)
        with pytest.raises(ReferenceCalled, match="refmod.Opt.step"):
            opt.step()
    assert alias(1) == 2 and module.closure(1) == 11 and module.Opt(0.5).step() == 0.5


def test_a_caught_call_is_still_on_record_and_a_thread_cannot_slip_through(module):
    before = len(refs.calls())
    seen = []

    def in_a_thread():
        try:
            module.plain(1)
        except ReferenceCalled as exc:
            seen.append(str(exc))

    with armed(["refmod:plain"]):
        try:
            module.plain(1)
        except ReferenceCalled:
            pass  # an answer that swallows the error is still caught: calls() keeps it
        thread = threading.Thread(target=in_a_thread)
        thread.start()
        thread.join()
    assert refs.calls()[before:] == ["refmod:plain", "refmod:plain"] and len(seen) == 1


def test_allowed_lifts_the_tripwires_for_the_checker_s_own_use(module):
    with armed(["refmod:plain"]):
        with allowed():
            assert module.plain(1) == 2
        with pytest.raises(ReferenceCalled):
            module.plain(1)
    assert module.plain(1) == 2


def test_a_reference_this_torch_release_lacks_is_skipped_and_the_others_stay_armed(module):
    with armed(["refmod:missing", "no_such_module_here:f", "refmod:plain"]):
        with pytest.raises(ReferenceCalled):
            module.plain(1)
    assert module.plain(1) == 2


def test_names_that_are_no_python_function_are_refused_with_the_form_to_use(module):
    with pytest.raises(ValueError, match="must look like 'package.module:function'"):
        resolve("refmod.plain")
    with pytest.raises(ValueError, match="no Python function"):
        resolve("builtins:len")
    with pytest.raises(AttributeError):
        resolve("refmod:missing")


# -- through a check: the learner's code runs armed, in a fresh process and in real ranks -------------------
from mgpu_lab import check  # noqa: E402
from mgpu_lab.course.checks import exercise  # noqa: E402


def _in_ranks(encode, value):
    return encode(value)


@exercise("98.encode", points=2, description="encode(x): x as JSON text", references=("json:dumps",))
def _encode(t, encode):
    with t.case("encode([1, 2]) is '[1, 2]'", hint="a list in brackets, items joined by ', '"):
        t.equal(t.call(encode, [1, 2]), "[1, 2]")
    with t.case("in 2 ranks too"):
        t.equal(t.ranks(_in_ranks, 2, encode, [3]), ["[3]", "[3]"])


def own(x):
    return "[" + ", ".join(str(v) for v in x) + "]"


def calls_the_reference(x):
    import json as renamed

    return renamed.dumps(x)


def hides_the_call(x):
    from json import dumps

    try:
        return dumps(x)
    except Exception:  # noqa: BLE001 - swallowing the tripwire does not help
        return own(x)


def test_an_answer_that_calls_a_reference_fails_every_case_naming_it_and_an_own_answer_passes():
    assert check("98.encode", own).status == "passed"
    for answer in (calls_the_reference, hides_the_call):
        result = check("98.encode", answer)
        assert [c.passed for c in result.cases] == [False, False], result.cases
        assert all("your code calls json.dumps" in c.got for c in result.cases), result.cases


def test_a_reference_must_be_named_module_colon_function():
    with pytest.raises(ValueError, match="must be a tuple of 'package.module:function' names"):
        exercise("98.bad", points=1, description="x", references=("json.dumps",))
    with pytest.raises(ValueError, match="must be a tuple"):
        exercise("98.bad", points=1, description="x", references="json:dumps")


# -- no answer in sight: a lesson's imports reach none of its exercises' references --------------------------
import json as _json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
from pathlib import Path  # noqa: E402

import reach  # noqa: E402  (tests/course/checks/reach.py)

from mgpu_lab.course.checks import exercises  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
NOTEBOOKS = sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))


def test_the_walk_finds_a_function_through_modules_and_classes_and_not_elsewhere(module):
    pkg = types.ModuleType("mgpu_lab.fake")
    pkg.inner = types.ModuleType("mgpu_lab.fake.inner")
    pkg.inner.Holder = type("Holder", (), {"__module__": "mgpu_lab.fake.inner", "make": staticmethod(module.plain)})
    outside = types.ModuleType("elsewhere")
    outside.hidden = module.closure
    found = reach.reachable({"fake": pkg, "elsewhere": outside}, {"refmod:plain", "refmod:make.<locals>.inner"})
    assert found == {"refmod:plain": "fake.inner.Holder.make"}  # not into modules that are not the package's


@pytest.fixture(scope="module")
def reach_server(tmp_path_factory):
    """One ``reach.py --serve`` process for the notebooks below: torch imported once, a fresh fork per notebook.
    Its errors go to a file (a pipe nobody reads while it runs could fill and stop it); ``.errors`` reads it."""
    errors = tmp_path_factory.mktemp("reach") / "stderr.txt"
    with errors.open("w") as err:
        # MGPU_LAB_PREWARM=0: a notebook's `import mgpu_lab.launcher...` would start a forkserver that imports torch
        # afresh in every child (about 8 s of CPU each, 14 notebooks), and nothing here launches ranks
        proc = subprocess.Popen([sys.executable, str(Path(reach.__file__)), "--serve"], cwd=ROOT, text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                env={**os.environ, "MGPU_LAB_PREWARM": "0"})
    proc.errors = lambda: errors.read_text()[-2000:]
    yield proc
    proc.stdin.close()
    try:
        proc.wait(timeout=60)
    finally:
        proc.kill()


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_reference_of_a_lesson_is_reachable_from_its_notebook_s_imports(notebook, reach_server):
    lesson = notebook.name[:2]
    refs = sorted({r for e in exercises(lesson) for r in e.references if r.startswith("mgpu_lab")})
    assert refs, f"lesson {lesson} names no reference implementation of the package"
    reach_server.stdin.write(_json.dumps([str(notebook), *refs]) + "\n")
    reach_server.stdin.flush()
    for line in iter(reach_server.stdout.readline, ""):  # the imports may print lines of their own first
        if line.startswith(reach.ANSWER):
            break
    else:
        raise AssertionError(f"reach.py --serve ended: {reach_server.errors()}")
    found = _json.loads(line[len(reach.ANSWER):])
    assert "error" not in found, found.get("error")
    assert not found, f"lesson {lesson}'s imports reach the answers of its exercises: {found}"


def _answer_names() -> dict[str, str]:
    """Every name a solution notebook hands to ``check`` (the learner's function or class) -> its exercise."""
    import ast

    import nbformat

    names = {}
    for notebook in NOTEBOOKS:
        for cell in nbformat.read(notebook, as_version=4).cells:
            if cell.cell_type != "code":
                continue
            try:
                tree = ast.parse("\n".join(line for line in cell.source.splitlines()
                                           if not line.lstrip().startswith(("%", "!"))))
            except SyntaxError:
                continue
            for node in ast.walk(tree):
                if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "check" and node.args
                        and isinstance(node.args[0], ast.Constant)):
                    names.update({a.id: node.args[0].value for a in node.args[1:] if isinstance(a, ast.Name)})
    return names


def test_the_package_defines_no_exercise_answer_under_the_learner_s_name():
    """CONTRIBUTING, "No answer in sight": ``from mgpu_lab.<anything> import <the exercise's name>`` finds nothing.
    The checks' own answers are ``reference_<name>``; the library's version of an idea is named for its role."""
    import ast

    answers = _answer_names()
    assert len(answers) >= 30, answers  # the walk of the notebooks found the check calls
    found = []
    for path in sorted((ROOT / "mgpu_lab").rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined = [node.name]
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                defined = [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
            elif isinstance(node, ast.ImportFrom):
                defined = [a.asname or a.name for a in node.names]
            else:
                continue
            found += [f"{path.relative_to(ROOT)}:{node.lineno} {name} (the answer to {answers[name]})"
                      for name in defined if name in answers]
    assert not found, "mgpu_lab defines exercise answers under the learner's names:\n" + "\n".join(found)


# -- no signposts: docstrings name modules by their role; a notebook names a file that answers an exercise only
# after that exercise's check cell (GUIDE, convention 7) ------------------------------------------------------
import ast  # noqa: E402
import re  # noqa: E402

SIGNPOST = re.compile(r"\bexercises?\b|\breferences? (?:of|for)\b|\breference implementation|"
                      r"\blibrary's (?:own )?(?:versions?|answers?)\b", re.IGNORECASE)


def signposts(text: str, ids=frozenset()) -> list[str]:
    """The phrases of ``text`` that point at an exercise's answer: "the reference of", "exercise", an exercise id."""
    found = [m.group(0) for m in SIGNPOST.finditer(text)]
    return found + sorted(i for i in ids if i in text)


def _docstrings(path: Path):
    tree = ast.parse(path.read_text())
    for node in [tree, *ast.walk(tree)]:
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            text = ast.get_docstring(node, clean=False)
            if text:
                yield getattr(node, "name", "module"), node.lineno if hasattr(node, "lineno") else 1, text


def test_the_signpost_scan_finds_the_phrases_it_exists_for():
    ids = {"07.torchrun_command"}
    assert signposts("Lessons 03 (:mod:`.data_parallel`, the reference of its exercises)") == ["reference of",
                                                                                             "exercises"]
    assert signposts("Lesson 07's reference for 07.torchrun_command", ids) == ["reference for", "07.torchrun_command"]
    assert signposts("The library's versions of lesson 10's work; a reference implementation") == [
        "library's versions", "reference implementation"]
    assert signposts("reference_train: one process with the global batch; scripts/ddp_train.py runs it", ids) == []


def test_no_docstring_of_the_library_points_at_an_exercise_s_answer():
    """The modules a notebook imports (everything but the course's own machinery: checks, grading) describe
    themselves by their role: never "the reference of exercise N", "the library's version of", an exercise id."""
    ids = frozenset(e.id for lesson in {p.name[:2] for p in NOTEBOOKS} for e in exercises(lesson))
    assert len(ids) >= 30, ids
    found = []
    for path in sorted((ROOT / "mgpu_lab").rglob("*.py")):
        if "course" in path.relative_to(ROOT / "mgpu_lab").parts:
            continue
        for name, line, text in _docstrings(path):
            found += [f"{path.relative_to(ROOT)}:{line} ({name}): {hit!r}" for hit in signposts(text, ids)]
    assert not found, "docstrings that signpost an exercise's answer:\n" + "\n".join(found)


def _answer_files(exercise) -> set[str]:
    """How a text names a file that answers ``exercise``: its references' modules (dotted and as paths) and
    the scripts that import one of them."""
    modules = {r.split(":")[0] for r in exercise.references if r.startswith("mgpu_lab.") and ".course." not in r}
    names = set(modules) | {m.replace(".", "/") + ".py" for m in modules}
    for script in sorted((ROOT / "scripts").glob("*.py")):
        imported = set()
        for node in ast.walk(ast.parse(script.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                imported |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                imported |= {a.name for a in node.names}
        if imported & modules:
            names.add(f"scripts/{script.name}")
    return names


def _before_its_check(notebook: Path):
    """(exercise, markdown cells before its check cell) for every exercise of the notebook."""
    import nbformat

    cells = nbformat.read(notebook, as_version=4).cells
    for exercise in exercises(notebook.name[:2]):
        call = re.compile(r'\bcheck\(\s*"%s"' % re.escape(exercise.id))
        at = next((i for i, c in enumerate(cells) if c.cell_type == "code" and call.search(c.source)), None)
        assert at is not None, f"{notebook.name} has no check cell for {exercise.id}"
        yield exercise, [(i, c.source) for i, c in enumerate(cells[:at]) if c.cell_type == "markdown"]


def test_the_answer_files_of_an_exercise_are_its_modules_and_the_scripts_that_import_them():
    ddp_train = next(e for e in exercises("04") if e.id == "04.ddp_train")
    assert {"mgpu_lab.parallel.ddp", "mgpu_lab/parallel/ddp.py", "scripts/ddp_train.py"} <= _answer_files(ddp_train)


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_markdown_names_a_file_that_answers_an_exercise_before_its_check(notebook):
    """A notebook names a script or module that answers an exercise only after the exercise's check cell (and
    says so: "the script does what you wrote in exercise 2"); the docstring scan above covers the modules."""
    found = []
    for exercise, cells in _before_its_check(notebook):
        names = _answer_files(exercise)
        found += [f"cell {i} names {name} before the check of {exercise.id}"
                  for i, text in cells for name in sorted(names) if name in text]
        found += [f"cell {i}: {hit!r} before the check of {exercise.id}"
                  for i, text in cells for hit in re.findall(r"\breferences? (?:of|for)\b|\blibrary's versions?\b",
                                                             text, re.IGNORECASE)]
    assert not found, f"{notebook.name}:\n" + "\n".join(found)

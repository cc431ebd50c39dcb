"""Mutation testing of the checkers: named wrong answers made from the solution's own source.

A check is only as good as the wrong answers it rejects. For every exercise,
``tests/mutants/test_mutants_NN.py`` lists

* **mutants**: the solution cell's source with one learner bug put in by an
  edit (:func:`replace`, :func:`drop_method`, :func:`drop_statement`), each named
  for the bug and with the words the failing case must say about it, and
* **variants**: correct answers written differently, which must pass.

The edits work on the solution notebook's text, so a changed solution changes
its mutants with it, and an edit that no longer applies fails loudly instead of
testing the unchanged solution. A new exercise gets its mutants by listing
edits, not by copying the solution.

Example:
    >>> m = Mutant("labels never moved", drop_method(".to", inside="y"), expect="labels")
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import nbformat

ROOT = Path(__file__).resolve().parents[1]
Edit = Callable[[str], str]


class EditDidNotApply(AssertionError):
    """An edit found nothing to change: the mutant would be the solution itself."""


def replace(old: str, new: str, count: int = 1) -> Edit:
    """Replace ``old`` by ``new`` (exactly ``count`` occurrences must exist; 0 means all, at least one)."""

    def edit(src: str) -> str:
        found = src.count(old)
        if found == 0 or (count and found != count):
            raise EditDidNotApply(f"replace: {old!r} occurs {found} times in the solution, expected {count or '>=1'}")
        return src.replace(old, new)

    edit.__name__ = f"replace({old!r} -> {new!r})"
    return edit


def sub(pattern: str, new: str, count: int = 0) -> Edit:
    """Regular-expression substitution; at least one match must exist."""

    def edit(src: str) -> str:
        out, n = re.subn(pattern, new, src, count=count, flags=re.M)
        if n == 0:
            raise EditDidNotApply(f"sub: no match for {pattern!r} in the solution")
        return out

    edit.__name__ = f"sub({pattern!r} -> {new!r})"
    return edit


class _DropMethod(ast.NodeTransformer):
    def __init__(self, method: str, inside: str | None):
        self.method, self.inside, self.dropped = method, inside, 0

    def visit_Call(self, node: ast.Call):
        self.generic_visit(node)
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr == self.method:
            if self.inside is None or self.inside in ast.unparse(func.value):
                self.dropped += 1
                return func.value
        return node


def drop_method(method: str, inside: str | None = None) -> Edit:
    """Turn every ``obj.method(...)`` into ``obj`` (e.g. drop ``.to(device)``), optionally only
    where the receiver's source contains ``inside``."""
    method = method.lstrip(".")

    def edit(src: str) -> str:
        tree = ast.parse(src)
        dropper = _DropMethod(method, inside)
        tree = dropper.visit(tree)
        if not dropper.dropped:
            raise EditDidNotApply(f"drop_method: no .{method}(...) call" + (f" on {inside!r}" if inside else ""))
        return ast.unparse(ast.fix_missing_locations(tree))

    edit.__name__ = f"drop_method(.{method}" + (f" on {inside!r})" if inside else ")")
    return edit


def drop_statement(containing: str) -> Edit:
    """Replace every statement whose source contains ``containing`` by ``pass``."""

    class Dropper(ast.NodeTransformer):
        dropped = 0

        def generic_visit(self, node):
            super().generic_visit(node)
            for name in ("body", "orelse", "finalbody"):
                stmts = getattr(node, name, None)
                if isinstance(stmts, list) and stmts and isinstance(stmts[0], ast.stmt):
                    kept = []
                    for s in stmts:
                        # compound statements are searched inside, simple ones dropped whole
                        if not hasattr(s, "body") and containing in ast.unparse(s):
                            Dropper.dropped += 1
                            continue
                        kept.append(s)
                    setattr(node, name, kept or [ast.Pass()])
            return node

    def edit(src: str) -> str:
        Dropper.dropped = 0
        tree = Dropper().visit(ast.parse(src))
        if not Dropper.dropped:
            raise EditDidNotApply(f"drop_statement: no statement contains {containing!r}")
        return ast.unparse(ast.fix_missing_locations(tree))

    edit.__name__ = f"drop_statement({containing!r})"
    return edit


@dataclass
class Mutant:
    """A learner's bug: ``edits`` applied to the solution source; the check must fail
    and some failed case (its hint, or what it got) must contain every word of ``expect``."""

    name: str
    edits: Edit | tuple[Edit, ...]
    expect: str | tuple[str, ...]

    def apply(self, src: str) -> str:
        for edit in (self.edits if isinstance(self.edits, tuple) else (self.edits,)):
            src = edit(src)
        return src

    @property
    def words(self) -> tuple[str, ...]:
        return (self.expect,) if isinstance(self.expect, str) else self.expect


@dataclass
class Variant:
    """A correct answer written differently from the solution: it must get full marks."""

    name: str
    source: str


@dataclass
class ExerciseMutants:
    """The mutants and variants of one exercise, and where its solution lives."""

    exercise: str
    notebook: str                  # e.g. "01_devices.ipynb" in solutions/
    names: tuple[str, ...]         # the objects check() takes, in order
    mutants: list[Mutant] = field(default_factory=list)
    variants: list[Variant] = field(default_factory=list)
    cell_marker: str | None = None  # text that picks the solution cell (default: defines names[0])
    # the words of a case this machine cannot earn (a real run it cannot make, said so by the check), or "":
    # a variant may lose exactly those cases here; called per judgement (e.g. "" as root)
    unpaid_here: Callable[[], str] | None = None


def solution_cell(notebook: str, marker: str) -> str:
    """The source of the solution cell (one with ``### BEGIN SOLUTION``) that contains ``marker``."""
    cells = [c.source for c in nbformat.read(ROOT / "solutions" / notebook, as_version=4).cells
             if c.cell_type == "code" and "### BEGIN SOLUTION" in c.source and marker in c.source]
    if len(cells) != 1:
        raise AssertionError(f"{notebook}: {len(cells)} solution cells contain {marker!r}, expected 1")
    return cells[0]


def prelude(notebook: str) -> str:
    """The notebook's first code cell (its imports), which every solution cell relies on."""
    return next(c.source for c in nbformat.read(ROOT / "solutions" / notebook, as_version=4).cells
                if c.cell_type == "code")


def define(source: str, names: tuple[str, ...], namespace: dict, filename: str = "<answer>") -> list:
    """Execute ``source`` in ``namespace`` (a copy) and return the named objects."""
    ns = dict(namespace)
    exec(compile(source, filename, "exec"), ns)
    return [ns[n] for n in names]


def failure_text(result) -> str:
    """Everything a learner reads about the failed cases of a result, lower-cased."""
    return " ".join([result.note.lower(), _failed_text(result.cases)])


def _failed_text(cases: list) -> str:
    return " ".join(part for c in cases if not c.passed for part in (c.name, c.hint, c.got, c.expected)).lower()


def caught_saying(cases: list, words) -> bool:
    """Whether some of ``cases`` failed and the failed ones say every one of ``words`` (what
    :func:`assert_caught` asks of a mutant's result, on these cases alone)."""
    text = _failed_text(cases)
    return any(not c.passed for c in cases) and all(w.lower() in text for w in words)


def cell_of(spec: ExerciseMutants) -> str:
    marker = spec.cell_marker or spec.names[0]
    for prefix in ("def ", "class "):
        try:
            return solution_cell(spec.notebook, prefix + marker)
        except AssertionError:
            continue
    return solution_cell(spec.notebook, marker)


def params(specs: list[ExerciseMutants], kind: str) -> list:
    """pytest params ``(spec, mutant-or-variant)`` with ids like ``01.train_step/labels left on the CPU``."""
    import pytest

    return [pytest.param(spec, item, id=f"{spec.exercise}/{item.name}")
            for spec in specs for item in getattr(spec, kind)]


def judge_mutant(spec: ExerciseMutants, mutant: Mutant, namespace: dict):
    """Check the mutant; it must fail, and its failed cases must name the bug."""
    from mgpu_lab.course.checks import check

    source = mutant.apply(cell_of(spec))
    result = check(spec.exercise, *define(source, spec.names, namespace, f"<mutant {mutant.name}>"))
    assert_caught(spec, mutant, result)
    return result


def assert_caught(spec: ExerciseMutants, mutant: Mutant, result) -> None:
    """A mutant's result failed, and its failed cases say every word of the mutant's ``expect``."""
    assert result.status == "failed", f"mutant {mutant.name!r} of {spec.exercise} was not caught:\n{result}"
    missing = [w for w in mutant.words if w.lower() not in failure_text(result)]
    assert not missing, f"mutant {mutant.name!r}: the failure does not say {missing}:\n{result}"


def judge_variant(spec: ExerciseMutants, variant: Variant, namespace: dict):
    """Check a correct variant: full marks."""
    from mgpu_lab.course.checks import check

    result = check(spec.exercise, *define(variant.source, spec.names, namespace, f"<variant {variant.name}>"))
    assert_full_marks(spec, variant, result)
    return result


def assert_full_marks(spec: ExerciseMutants, variant: Variant, result) -> None:
    """A correct variant's result has every point, but those of the cases the spec's ``unpaid_here()`` names
    (a case this machine cannot pay, failing saying so): their points, not one per case, are excused."""
    unpaid = spec.unpaid_here() if spec.unpaid_here else ""
    lost = [c for c in result.cases if not c.passed and not (unpaid and unpaid in c.hint)]
    excused = sum(c.points for c in result.cases if not c.passed) - sum(c.points for c in lost)
    assert not lost and result.points == result.max_points - excused, \
        f"correct variant {variant.name!r} of {spec.exercise} lost points:\n{result}"


def mutant_tests(specs: list[ExerciseMutants], lesson: str, namespace: dict | Callable[[], dict], *,
                 before: Callable | None = None, after: Callable | None = None, at_once: int = 1) -> tuple:
    """The three tests of every ``tests/mutants/test_mutants_NN.py``, for the module to bind by name::

        test_mutant_fails_naming_its_bug, test_correct_variant_passes, test_every_exercise_has_five_mutants_and_two_variants = \\
            mutant_tests(SPECS, "01", NAMESPACE)

    ``namespace`` is what the solution cell sees (a dict, or a function that makes one, called
    per test). ``before(mutant)`` runs before a mutant is judged (it may ``pytest.skip``);
    ``after(mutant, result)`` adds assertions on the failed result.

    ``at_once > 1``: a lesson whose checks mostly *wait* (a guard's deadline, a replayed deadlock's
    receive timeout, a real torchrun restart) has every answer of the file judged by ``check()``
    in that many threads at once, started by the file's first test; each test then takes its own
    answer's verdict, or its error, as it would have had it alone. The checks are the same; only
    their waits overlap.
    """
    import functools
    from concurrent.futures import ThreadPoolExecutor

    import pytest

    def names() -> dict:
        return namespace() if callable(namespace) else namespace

    def mutant_verdict(spec, mutant):
        if before is not None:
            before(mutant)  # a pytest.skip here reaches the test through the future
        return judge_mutant(spec, mutant, names())

    @functools.cache
    def running() -> dict:
        pool = ThreadPoolExecutor(at_once, thread_name_prefix=f"judge-{lesson}")
        futures = {}
        for spec in specs:  # the file's order: its slowest answers are listed where they are
            futures.update({("mutant", spec.exercise, m.name): pool.submit(mutant_verdict, spec, m)
                            for m in spec.mutants})
            futures.update({("variant", spec.exercise, v.name): pool.submit(judge_variant, spec, v, names())
                            for v in spec.variants})
        pool.shutdown(wait=False)
        return futures

    @pytest.mark.parametrize("spec, mutant", params(specs, "mutants"))
    def test_mutant_fails_naming_its_bug(spec, mutant):
        if at_once > 1:
            result = running()[("mutant", spec.exercise, mutant.name)].result()
        else:
            result = mutant_verdict(spec, mutant)
        if after is not None:
            after(mutant, result)

    @pytest.mark.parametrize("spec, variant", params(specs, "variants"))
    def test_correct_variant_passes(spec, variant):
        if at_once > 1:
            running()[("variant", spec.exercise, variant.name)].result()
        else:
            judge_variant(spec, variant, names())

    def test_every_exercise_has_five_mutants_and_two_variants():
        from mgpu_lab.course.checks import exercises

        counts = {spec.exercise: (len(spec.mutants), len(spec.variants)) for spec in specs}
        assert sorted(counts) == sorted(e.id for e in exercises(lesson)), counts
        for spec in specs:
            assert len(spec.mutants) >= 5 and len(spec.variants) >= 2, f"{spec.exercise}: {counts[spec.exercise]}"
            assert len({m.name for m in spec.mutants}) == len(spec.mutants), f"{spec.exercise}: two mutants share a name"

    return test_mutant_fails_naming_its_bug, test_correct_variant_passes, test_every_exercise_has_five_mutants_and_two_variants

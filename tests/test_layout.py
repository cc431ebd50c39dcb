"""The package's layout: parts a newcomer can tell apart, code found from a lesson's title, short functions, layers.

From the bottom: the base (``dist``, ``devices``, ``core/``), ``launcher/`` (start
ranks), one package per topic (``data/``, ``parallel/``, ``pipelining/``, ``sharding/``, ``comm/``,
``failures/``, ``profiling/``, ``long_context/``, and ``devices/``' lesson-01 modules), each naming its lessons;
``cluster/`` (simulated nodes, SLURM), ``course/`` (checks, assign, grade), and the
command line (``cli``, ``doctor``) on top. These tests read the source with
``ast`` (nothing is imported), so a cycle or a layer crossed shows as a failure
that names the modules.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mgpu_lab"
MAX_BODY = 60  # the guide's "functions short (about 60 lines)": body lines, the docstring not counted
PARTS = ("launcher", "course", "cluster")
TOPICS = ("data", "parallel", "pipelining", "sharding", "comm", "failures", "devices", "tensor_parallel", "profiling",
          "long_context", "experts")
TOP_LEVEL = {"__init__", "__main__", "cli", "dist", "doctor", "doctor_probes"}  # everything else lives in a package
BASE = {"mgpu_lab.dist", "mgpu_lab.devices", "mgpu_lab.core.compat", "mgpu_lab.core", "mgpu_lab.core.libc",
        "mgpu_lab.core.procenv"}
APPS = {"mgpu_lab.cli", "mgpu_lab.doctor", "mgpu_lab.__main__"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Every mgpu_lab module that ``name`` imports, at module level or inside functions."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base if is_package else base[:-1]
                base = base[: len(base) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            # `from pkg import sub` imports the module pkg.sub when there is one
            targets = [f"{stem}.{alias.name}" if f"{stem}.{alias.name}" in known else stem for alias in node.names]
        else:
            continue
        for target in targets:
            if target.startswith("mgpu_lab") and target not in known:
                raise ImportError(f"{name} (line {node.lineno}) imports {target}, which is no module of the package")
            while target and target not in known:  # mgpu_lab.x.attr -> mgpu_lab.x
                target = target.rpartition(".")[0]
            if target.startswith("mgpu_lab") and target != name and target != "mgpu_lab":
                found.add(target)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports_of(name, path, set(mods)) for name, path in mods.items()}


def part(name: str) -> str:
    pieces = name.split(".")
    return pieces[1] if len(pieces) > 1 and pieces[1] in PARTS else "top"


def topic(name: str) -> str | None:
    pieces = name.split(".")
    return pieces[1] if len(pieces) > 1 and pieces[1] in TOPICS and name not in BASE else None


def test_the_three_parts_exist_and_say_what_they_hold():
    for name in PARTS:
        init = PACKAGE / name / "__init__.py"
        assert init.is_file(), f"mgpu_lab/{name}/ is not a package"
        assert ast.get_docstring(ast.parse(init.read_text())), f"mgpu_lab/{name}/__init__.py has no docstring"


def test_every_topic_package_names_its_lessons():
    for name in TOPICS:
        init = PACKAGE / name / "__init__.py"
        assert init.is_file(), f"mgpu_lab/{name}/ is not a package"
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert re.search(r"\b[Ll]essons? \d\d", doc), f"mgpu_lab/{name}/__init__.py's docstring names no lesson"


def test_no_topic_module_sits_flat_in_the_package():
    flat = {p.stem for p in PACKAGE.glob("*.py")} - TOP_LEVEL
    assert not flat, f"modules at the top of mgpu_lab/ (put each in its topic's package): {sorted(flat)}"


def test_topic_packages_build_only_on_the_base_the_launcher_and_each_other(graph):
    allowed = lambda dep: dep in BASE or part(dep) == "launcher" or topic(dep) is not None  # noqa: E731
    bad = {name: sorted(d for d in deps if not allowed(d)) for name, deps in graph.items() if topic(name)}
    assert not {k: v for k, v in bad.items() if v}, f"topic modules import the course, cluster or the CLI: {bad}"


def test_the_checks_have_one_shape_per_lesson():
    checks = PACKAGE / "course" / "checks"
    lessons = sorted(p for p in checks.iterdir() if p.is_dir() and re.fullmatch(r"l\d\d", p.name))
    assert [p.name for p in lessons] == [f"l{n:02d}" for n in range(1, len(lessons) + 1)] and len(lessons) >= 10
    for lesson in lessons:
        assert sorted(p.name for p in lesson.glob("*.py")) == ["__init__.py", "checkers.py", "judges.py", "ranks.py"]
    flat = sorted(p.stem for p in checks.glob("*.py") if not p.stem.startswith("_"))  # the framework is _*.py
    assert flat == [], f"lesson code outside lNN/ and sim/: {flat}"


def body_lines(node) -> int:
    """Lines of a function's body, its docstring not counted."""
    body = node.body
    if len(body) > 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    return node.end_lineno - body[0].lineno + 1


def long_functions(path: Path) -> dict[str, int]:
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    return {f"{where}:{node.lineno} {node.name}": n
            for node in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (n := body_lines(node)) > MAX_BODY}


def test_every_function_is_about_60_lines_at_most():
    too_long = {k: v for p in PACKAGE.rglob("*.py") for k, v in long_functions(p).items()}
    assert not too_long, f"functions over {MAX_BODY} body lines (split along a seam): {too_long}"


def test_the_function_length_reader_counts_the_body_without_the_docstring(tmp_path):
    src = tmp_path / "m.py"
    src.write_text('def f():\n    """Doc.\n\n    More.\n    """\n' + "    x = 1\n" * MAX_BODY
                   + "\n\ndef g():\n" + "    y = 2\n" * (MAX_BODY + 1))
    assert list(long_functions(src).values()) == [MAX_BODY + 1]


def test_no_import_cycles(graph):
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(name: str) -> None:
        state[name] = 1
        stack.append(name)
        for dep in sorted(graph.get(name, ())):
            if state.get(dep) == 1:
                cycle = stack[stack.index(dep):] + [dep]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        stack.pop()
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)


def test_the_launcher_needs_only_the_base(graph):
    crossed = {name: sorted(d for d in deps if part(d) != "launcher" and d not in BASE)
               for name, deps in graph.items() if part(name) == "launcher"}
    assert not {k: v for k, v in crossed.items() if v}, f"launcher modules import outside the base: {crossed}"


def test_the_base_imports_no_part(graph):
    bad = {name: sorted(deps) for name in BASE if (deps := {d for d in graph[name] if part(d) != "top"})}
    assert not bad, f"dist/devices must stay at the bottom: {bad}"


def test_only_the_course_and_the_command_line_use_the_course(graph):
    bad = {name: sorted(d for d in deps if part(d) == "course") for name, deps in graph.items()
           if part(name) != "course" and name not in APPS | {"mgpu_lab"}}
    assert not {k: v for k, v in bad.items() if v}, f"course code imported from below: {bad}"


def test_nothing_imports_the_command_line(graph):
    bad = {name: sorted(deps & APPS) for name, deps in graph.items() if name not in APPS and deps & APPS}
    assert not bad, f"cli/doctor are the top layer: {bad}"


def test_every_import_of_the_package_names_a_module_that_exists(graph):
    # The graph fixture raises ImportError naming the module and line otherwise.
    assert "mgpu_lab.launcher.launch" in graph["mgpu_lab.course.checks._core"]


def test_the_import_reader_resolves_relative_imports_and_rejects_missing_ones(tmp_path):
    # The rules above are only as good as this reader.
    known = set(modules())
    assert "mgpu_lab.launcher.procs" in imports_of("mgpu_lab.launcher.job", PACKAGE / "launcher" / "job.py", known)
    wrong = tmp_path / "fake.py"
    wrong.write_text("def f():\n    from .dist import is_main_process\n")  # mgpu_lab.launcher.dist: none
    with pytest.raises(ImportError, match="mgpu_lab.launcher.dist"):
        imports_of("mgpu_lab.launcher.fake", wrong, known)


def test_no_two_test_modules_share_a_name_outside_a_package():
    """pytest imports a test file outside a package under its bare name, and a rank unpickles a test's function by
    that name: two ``test_record.py`` in folders without ``__init__.py`` make one of them fail to collect and the
    other's ranks load the wrong module (CI, stop 48)."""
    seen: dict[str, Path] = {}
    clashes = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        if path.name == "conftest.py" or (path.parent / "__init__.py").exists():
            continue
        if path.stem in seen:
            clashes.append(f"{seen[path.stem].relative_to(ROOT)} and {path.relative_to(ROOT)}")
        seen.setdefault(path.stem, path)
    assert not clashes, "test modules outside a package share a name (rename one): " + "; ".join(clashes)

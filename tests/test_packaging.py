"""Packaging consistency: pyproject.toml, environment.yml and constraints.txt.

The pip path (`make lab`, `make test`, CI) reads pyproject.toml and
constraints.txt; the conda path reads environment.yml. These tests keep the
three from drifting apart: same dependency names, same torch/torchvision pins,
and the `mgpu-lab` command declared.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: tomllib arrived in 3.11.
    try:
        import tomli as tomllib
    except ModuleNotFoundError:
        from pip._vendor import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PINS = {"torch": "2.14.1", "torchvision": "0.29.1", "cloudpickle": "3.1.3"}
# The oldest torch claimed (pyproject.toml's floor), tested by `make test-torch2.11`.
OLDEST = {"torch": "2.11.0", "torchvision": "0.26.0", "cloudpickle": "3.1.1"}

# Names that are tooling rather than dependencies of the project.
IGNORED_NAMES = {"python", "pip"}


def dependency_name(spec: str) -> str | None:
    """Return the normalised project name of a requirement, or None.

    Lowercases, maps `_` and `.` to `-` (PEP 503), and drops extras, version
    specifiers (pip's `==`, `>=` and conda's `=`) and markers. Pip options
    such as `-e .` have no name and give None.

    Example:
        >>> dependency_name("Jupyter_Client>=8; python_version>'3.9'")
        'jupyter-client'
    """
    spec = spec.strip()
    if not spec or spec.startswith("-"):
        return None
    match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", spec)
    if match is None:
        raise ValueError(f"cannot read a package name from requirement {spec!r}")
    return re.sub(r"[-_.]+", "-", match.group(0)).lower()


def dependency_names(specs: list[str]) -> set[str]:
    """Normalised names of `specs`, without pip options and IGNORED_NAMES."""
    names = {dependency_name(spec) for spec in specs}
    return {name for name in names if name and name not in IGNORED_NAMES}


def parse_environment_dependencies(text: str) -> tuple[list[str], list[str]]:
    """Read the `dependencies:` list of a conda environment file.

    A small reader for the one shape environment.yml uses (PyYAML is not a
    dependency): a top-level `dependencies:` key holding `- item` lines and at
    most one `- pip:` entry with its own indented `- item` lines.

    Args:
        text: the contents of environment.yml.

    Returns:
        (conda_specs, pip_specs), each a list of requirement strings as written.

    Raises:
        ValueError: no `dependencies:` key, or a line in it that is neither a
            list item nor the `pip:` sublist.

    Example:
        >>> parse_environment_dependencies("dependencies:\\n  - numpy\\n  - pip:\\n    - torch==2.4\\n")
        (['numpy'], ['torch==2.4'])
    """
    conda: list[str] = []
    pip: list[str] = []
    in_dependencies = False
    found = False
    item_indent: int | None = None
    in_pip = False
    for number, raw in enumerate(text.splitlines(), start=1):
        line = re.sub(r"(^|\s)#.*$", "", raw).rstrip()
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        stripped = line.strip()
        if indent == 0:
            in_dependencies = stripped == "dependencies:"
            found = found or in_dependencies
            item_indent, in_pip = None, False
            continue
        if not in_dependencies:
            continue
        if not stripped.startswith("- "):
            raise ValueError(f"environment.yml line {number}: expected a '- item' under dependencies:, got {raw!r}")
        item = stripped[2:].strip()
        if item_indent is None:
            item_indent = indent
        if indent == item_indent:
            in_pip = item == "pip:"
            if not in_pip:
                if item.endswith(":"):
                    raise ValueError(f"environment.yml line {number}: only a 'pip:' sublist is understood, got {raw!r}")
                conda.append(item)
        elif indent > item_indent and in_pip:
            pip.append(item)
        else:
            raise ValueError(f"environment.yml line {number}: unexpected indentation in {raw!r}")
    if not found:
        raise ValueError("environment.yml has no top-level 'dependencies:' key")
    return conda, pip


def compare_dependency_names(pyproject_specs: list[str], environment_specs: list[str]) -> list[str]:
    """Describe how two dependency lists differ by name; [] when they agree.

    Example:
        >>> compare_dependency_names(["torch>=2.4"], ["torch==2.14.1", "scipy"])
        ['in environment.yml but not in pyproject.toml: scipy']
    """
    ours = dependency_names(pyproject_specs)
    theirs = dependency_names(environment_specs)
    problems = []
    if ours - theirs:
        problems.append(f"in pyproject.toml but not in environment.yml: {', '.join(sorted(ours - theirs))}")
    if theirs - ours:
        problems.append(f"in environment.yml but not in pyproject.toml: {', '.join(sorted(theirs - ours))}")
    return problems


def read_pins(text: str) -> dict[str, str]:
    """Map name -> version for the `name==version` lines of a constraints file."""
    pins = {}
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep:
            raise ValueError(f"constraints.txt: {raw!r} is not an exact 'name==version' pin")
        pins[dependency_name(name)] = version.strip()
    return pins


@pytest.fixture(scope="module")
def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


@pytest.fixture(scope="module")
def environment() -> tuple[list[str], list[str]]:
    return parse_environment_dependencies((ROOT / "environment.yml").read_text())


def all_pyproject_specs(pyproject: dict) -> list[str]:
    specs = list(pyproject["project"]["dependencies"])
    for extra in pyproject["project"].get("optional-dependencies", {}).values():
        specs.extend(extra)
    return specs


def test_environment_yml_names_the_same_dependencies_as_pyproject(pyproject, environment):
    conda, pip = environment
    problems = compare_dependency_names(all_pyproject_specs(pyproject), conda + pip)
    assert not problems, "; ".join(problems)


def test_compare_reports_a_mismatch_in_both_directions():
    problems = compare_dependency_names(
        ["torch>=2.4", "numpy", "tqdm"],
        ["torch==2.14.1", "numpy", "scipy"],
    )
    assert problems == [
        "in pyproject.toml but not in environment.yml: tqdm",
        "in environment.yml but not in pyproject.toml: scipy",
    ]


def test_compare_ignores_spelling_versions_python_pip_and_editable_install():
    assert compare_dependency_names(
        ["jupyter_client>=8", "Torch>=2.4", "pytest[testing]; python_version>'3.9'"],
        ["python=3.11", "pip", "jupyter-client", "torch==2.14.1", "pytest=8", "-e ."],
    ) == []


@pytest.mark.parametrize(
    "spec, name",
    [
        ("torch>=2.4", "torch"),
        ("torch==2.14.1", "torch"),
        ("python=3.11", "python"),
        ("jupyter_client", "jupyter-client"),
        ("Zope.Interface ~= 5.0", "zope-interface"),
        ("nbval[extra]>=0.10", "nbval"),
        ("-e .", None),
        ("--extra-index-url https://example.org/simple", None),
    ],
)
def test_dependency_name(spec, name):
    assert dependency_name(spec) == name


def test_parser_reads_conda_and_pip_lists_and_skips_comments():
    text = """\
name: demo  # a comment
channels:
  - conda-forge
dependencies:
  # tooling
  - python=3.11
  - numpy  # inline comment
  - pip:
      - torch==2.14.1
      - -e .
variables:
  FOO: bar
"""
    assert parse_environment_dependencies(text) == (["python=3.11", "numpy"], ["torch==2.14.1", "-e ."])


@pytest.mark.parametrize(
    "text, message",
    [
        ("name: demo\nchannels:\n  - conda-forge\n", "no top-level 'dependencies:'"),
        ("dependencies:\n  numpy: 1\n", "expected a '- item'"),
        ("dependencies:\n  - conda:\n    - numpy\n", "only a 'pip:' sublist"),
        ("dependencies:\n  - numpy\n    - scipy\n", "unexpected indentation"),
    ],
)
def test_parser_rejects_shapes_it_does_not_understand(text, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_environment_dependencies(text)


def test_console_script_points_to_cli_main(pyproject):
    scripts = pyproject["project"].get("scripts", {})
    assert scripts.get("mgpu-lab") == "mgpu_lab.cli:main", f"[project.scripts] is {scripts}"


def test_package_discovery_includes_subpackages(pyproject):
    find = pyproject["tool"]["setuptools"]["packages"]["find"]
    assert find["include"] == ["mgpu_lab*"]


def test_pins_file_pins_the_tested_torch_pair():
    assert read_pins((ROOT / "constraints.txt").read_text()) == PINS


def test_read_pins_rejects_a_loose_pin():
    with pytest.raises(ValueError, match="not an exact"):
        read_pins("torch>=2.4\n")


def test_environment_yml_uses_the_same_pins(environment):
    _, pip = environment
    pinned = {dependency_name(spec): spec.partition("==")[2] for spec in pip if "==" in spec}
    assert pinned == PINS


def test_pyproject_keeps_torch_loose(pyproject):
    # GPU machines often bring their own torch build; only the Makefile/CI pin it.
    specs = {dependency_name(spec): spec for spec in pyproject["project"]["dependencies"]}
    assert "==" not in specs["torch"] and "==" not in specs["torchvision"], specs


def test_the_torch_floor_is_the_oldest_tested_torch(pyproject):
    # The package claims only what a test run has passed on: pyproject's floor is constraints-torch2.11.txt's torch.
    assert read_pins((ROOT / "constraints-torch2.11.txt").read_text()) == OLDEST
    specs = {dependency_name(spec): spec for spec in pyproject["project"]["dependencies"]}
    assert specs["torch"] == "torch>=" + OLDEST["torch"].removesuffix(".0"), specs["torch"]
    assert "test-torch2.11:" in (ROOT / "Makefile").read_text()


def test_pytest_markers_are_declared(pyproject):
    markers = pyproject["tool"]["pytest"]["ini_options"]["markers"]
    assert {marker.split(":", 1)[0] for marker in markers} >= {"gpu", "slow", "root"}


# -- what a learner installs: the wheel (setup.py's build hook, MANIFEST.in, .ci/wheel_check.py) ----------------
import importlib.util  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import zipfile  # noqa: E402

COURSE = "mgpu_lab/_course/"


def _wheel_check():
    spec = importlib.util.spec_from_file_location("wheel_check", ROOT / ".ci" / "wheel_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built from a copy of this checkout (solutions/ and tests/ included: they must stay out)."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", ".venv*", "build", "dist", "*.egg-info",
                                                                "__pycache__", ".pytest_cache", "artifacts"))
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                           "--wheel-dir", str(tmp / "dist"), str(source)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (built,) = (tmp / "dist").glob("mgpu_lab-*.whl")
    return built


def test_the_wheel_holds_the_student_notebooks_and_scripts_and_no_answer(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    notebooks = sorted(n.removeprefix(COURSE + "notebooks/") for n in names if n.startswith(COURSE + "notebooks/"))
    assert notebooks == sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb")) and len(notebooks) >= 14
    assert COURSE + "scripts/ddp_train.py" in names and "mgpu_lab/course/checks/__init__.py" in names
    assert not [n for n in names if "solution" in n.lower() or "mutant" in n.lower() or n.startswith("tests/")]
    assert _wheel_check().problems(wheel, ROOT) == []


def test_the_wheel_check_names_an_answer_a_test_and_a_missing_or_stale_notebook(wheel, tmp_path):
    bad = tmp_path / wheel.name
    with zipfile.ZipFile(wheel) as zin, zipfile.ZipFile(bad, "w") as zout:
        for name in zin.namelist():
            if name.endswith("/01_devices.ipynb"):
                continue  # missing
            data = zin.read(name)
            zout.writestr(name, data + b" " if name.endswith("/02_data_loading.ipynb") else data)  # stale
        zout.writestr(COURSE + "notebooks/99_extra.ipynb", (ROOT / "solutions" / "03_data_parallel.ipynb").read_bytes())
        zout.writestr("tests/mutants/test_mutants_01.py", "")
    found = "\n".join(_wheel_check().problems(bad, ROOT))
    for expected in ("notebooks/01_devices.ipynb is missing", "notebooks/02_data_loading.ipynb differs",
                     "99_extra.ipynb: holds answers (03_data_parallel.ipynb)", "tests/mutants/test_mutants_01.py: "
                     "outside the package", "test_mutants_01.py: a solution, a test or a mutant"):
        assert expected in found, found


def test_the_wheel_check_passes_over_the_bytecode_python_left_beside_the_scripts(wheel, tmp_path):
    # a test that ran a script with bytecode writing on (no PYTHONDONTWRITEBYTECODE) leaves scripts/__pycache__
    clone = tmp_path / "clone"
    for folder in ("notebooks", "scripts", "solutions"):
        shutil.copytree(ROOT / folder, clone / folder, ignore=shutil.ignore_patterns("__pycache__"))
    (clone / "scripts" / "__pycache__").mkdir()
    (clone / "scripts" / "__pycache__" / "ddp_train.cpython-311.pyc").write_bytes(b"\0")
    assert _wheel_check().problems(wheel, clone) == []


def test_the_sdist_keeps_the_answers_out_and_the_course_s_files_in():
    manifest = (ROOT / "MANIFEST.in").read_text().split()
    assert {"prune", "solutions", "tests", "graft", "notebooks", "scripts"} <= set(manifest)
    assert "cmdclass" in (ROOT / "setup.py").read_text()


@pytest.mark.parametrize("torch_kind", ["default", "cpu"])
def test_make_install_with_torch_cpu_installs_the_cpu_wheels_before_the_package(torch_kind, tmp_path):
    # `make lab TORCH=cpu` (README): PyTorch's CPU-only index first; the package's install then keeps that torch.
    venv = tmp_path / "venv"
    done = subprocess.run(["make", "-n", "install", f"TORCH={torch_kind}", f"VENV={venv}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    installs = [line for line in done.stdout.splitlines() if " -m pip install " in line]
    cpu = f"{venv}/bin/python -m pip install -c constraints.txt --index-url https://download.pytorch.org/whl/cpu torch torchvision"
    assert installs == ([cpu] if torch_kind == "cpu" else []) + [f"{venv}/bin/python -m pip install -c constraints.txt -e '.[dev]'"]

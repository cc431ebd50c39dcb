"""nbformat as the grader's runner and assign import it: without jsonschema's IRI grammar (1.8 s a process)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_notebooks_read_and_validate_without_the_iri_grammar_which_stays_importable():
    out = _run(
        "import sys\n"
        "from mgpu_lab.course.nbio import nbformat\n"
        "nb = nbformat()\n"
        "import nbclient, jsonschema\n"
        "book = nb.read('solutions/01_devices.ipynb', as_version=4)\n"
        "nb.validate(book)\n"
        "print(len(book.cells) > 10, 'rfc3987_syntax' in sys.modules)\n"
        "import rfc3987_syntax\n"
        "print(rfc3987_syntax.is_valid_syntax('iri', 'http://example.org/ä'))\n")
    assert out.split() == ["True", "False", "True"]


def test_the_grading_runner_and_assign_import_nbformat_through_it():
    out = _run(
        "import sys\n"
        "import mgpu_lab.course.assign\n"
        "from mgpu_lab.course import runner\n"
        "print('nbformat' in sys.modules, 'rfc3987_syntax' in sys.modules)\n")
    assert out.split() == ["True", "False"]
    source = (ROOT / "mgpu_lab" / "course" / "runner.py").read_text()
    assert source.index("import_nbformat()") < source.index("from nbclient import")

"""Check a built wheel holds what a learner needs and none of the answers: ``python wheel_check.py WHEEL CLONE``.

What must be inside: the package, every student notebook of CLONE's ``notebooks/`` byte for
byte (``mgpu_lab/_course/notebooks/``) and its ``scripts/`` (``mgpu_lab/_course/scripts/``).
What must not: a solution notebook (CLONE's ``solutions/``, or any notebook with a solution
marker), a test, a mutant, anything outside the package and its metadata. Prints what it found;
exits 1 naming every problem. CI's learner-install step and tests/test_packaging.py run it.
"""
from __future__ import annotations

import re
import sys
import zipfile
from pathlib import Path

COURSE = "mgpu_lab/_course/"
MARKER = b"### BEGIN SOLUTION"


def problems(wheel: Path, clone: Path) -> list[str]:
    """Every way ``wheel`` differs from what a learner's install must hold; [] when it holds exactly that."""
    with zipfile.ZipFile(wheel) as zf:
        files = {name: zf.read(name) for name in zf.namelist() if not name.endswith("/")}
    found = []
    for folder, pattern in (("notebooks", "[0-9][0-9]_*.ipynb"), ("scripts", "*")):
        for path in sorted((clone / folder).glob(pattern)):
            if path.name == "__pycache__":  # what Python writes beside a script it ran (a test's): no wheel holds it
                continue
            inside = files.get(f"{COURSE}{folder}/{path.name}")
            if inside is None:
                found.append(f"{folder}/{path.name} is missing (expected {COURSE}{folder}/{path.name})")
            elif inside != path.read_bytes():
                found.append(f"{COURSE}{folder}/{path.name} differs from the clone's {folder}/{path.name}")
    solutions = {path.read_bytes(): path.name for path in (clone / "solutions").glob("*.ipynb")}
    for name, data in sorted(files.items()):
        top = name.split("/", 1)[0]
        if top != "mgpu_lab" and not re.fullmatch(r"mgpu_lab-[^/]+\.dist-info", top):
            found.append(f"{name}: outside the package")
        if re.search(r"(^|/)(solutions|tests)/|mutant", name, re.IGNORECASE):
            found.append(f"{name}: a solution, a test or a mutant")
        if name.endswith(".ipynb") and (MARKER in data or data in solutions):
            found.append(f"{name}: holds answers ({solutions.get(data, 'a solution marker')})")
    return found


def main(wheel: str, clone: str) -> int:
    wheel_path, clone_path = Path(wheel), Path(clone)
    with zipfile.ZipFile(wheel_path) as zf:
        names = zf.namelist()
    shipped = [n for n in names if n.startswith(COURSE)]
    print(f"wheel_check: {wheel_path.name}: {len(names)} files, {len(shipped)} of the course's "
          f"({sum(n.endswith('.ipynb') for n in shipped)} notebooks)")
    found = problems(wheel_path, clone_path)
    for line in found:
        print(f"wheel_check: {line}")
    print("wheel_check: " + ("FAILED" if found else "no solution notebook, test or mutant inside; every "
                             "student notebook and script inside, as in the clone"))
    return 1 if found else 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    sys.exit(main(*sys.argv[1:]))

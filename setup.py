"""Build hook: a wheel carries the student notebooks and the scripts as package data.

Everything else about the package is in pyproject.toml. ``build_py`` copies
``notebooks/*.ipynb`` (the student copies, no answers) and ``scripts/`` into
``mgpu_lab/_course/`` of the build, where :mod:`mgpu_lab.core.shipped` finds them in an
installed wheel. ``solutions/`` and ``tests/`` (the answers and the mutants) never enter
a wheel: tests/test_packaging.py builds one and looks.
"""
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
SHIPPED = {"notebooks": "*.ipynb", "scripts": "*"}  # folder of the repository -> the files the wheel carries


class build_py_with_course(build_py):
    """setuptools' build_py, then the course's notebooks and scripts into mgpu_lab/_course/."""

    def run(self):
        super().run()
        for folder, pattern in SHIPPED.items():
            files = sorted(p for p in (HERE / folder).glob(pattern) if p.is_file())
            if not files:
                raise RuntimeError(f"{HERE / folder} holds no {pattern}: a wheel without the course's {folder} "
                                   "is no use to a learner; build from a clone or a complete sdist")
            target = Path(self.build_lib) / "mgpu_lab" / "_course" / folder
            target.mkdir(parents=True, exist_ok=True)
            for path in files:
                shutil.copy2(path, target / path.name)


setup(cmdclass={"build_py": build_py_with_course})

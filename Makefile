# One command each: `make run` (the small local study) and `make test` (everything CI runs);
# `make bench` measures every method against ddp and the plain training loop.
# Both create .venv and install the project into it when missing or stale.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.PHONY: run test faults soak lint bench report clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(PY) -m harness.run experiment=smoke

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest $(PYTEST_ARGS)

faults: $(STAMP)  # every fault of tests/test_faults.py with every kind of method (~15 min)
	$(PY) -m pytest -m faults tests/test_faults.py $(PYTEST_ARGS)

soak: $(STAMP)  # 200 local, 56 emulated and 50 verify runs in a row, all must succeed (~100 min)
	$(PY) -m tests.soak --local 200 --emulated 50 --verify 50

lint: $(STAMP)
	$(PY) -m ruff check .

bench: $(STAMP)
	$(PY) -m harness.methodbench

report: $(STAMP)
	$(PY) -m harness.report

clean:
	rm -rf results/*.parquet plots/*

# One command each: `make run` (the small local study) and `make test` (everything CI runs);
# `make bench` measures every method against ddp, the plain training loop and Horovod.
# All create .venv and install the project (with its dev and ucx extras: the tests of
# cluster.ps_wire=ucx run in CI) into it when missing or stale; `make test` and
# `make bench` also build Horovod into it (`make horovod`, engine=horovod).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
HOROVOD_STAMP := $(VENV)/.horovod-stamp
PYTEST_ARGS ?=
LANES ?= 2

.PHONY: run test faults soak lint bench report clean horovod

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev,ucx]'
	touch $(STAMP)

# Horovod 0.28.1 from source against the venv's torch (harness/install_horovod.py: about
# 5 minutes on 2 cores; a no-op once built). On a GPU cluster: HOROVOD_GPU_OPERATIONS=NCCL.
$(HOROVOD_STAMP): $(STAMP) harness/install_horovod.py harness/config/engine.py
	$(PY) -m harness.install_horovod
	touch $(HOROVOD_STAMP)

horovod: $(STAMP)
	$(PY) -m harness.install_horovod
	touch $(HOROVOD_STAMP)

run: $(STAMP)  # the small study, then its figures, tables and page (plots/index.html)
	$(PY) -m harness.run experiment=smoke
	$(PY) -m harness.report

# compileall: each of the suite's processes loads the project's bytecode rather than compiling
# it again (under PYTHONDONTWRITEBYTECODE nothing else writes it). The suite runs in $(LANES)
# lanes, a test file each at a time (one lane's runs fill the other's waits), then the tests
# that read the whole machine alone (-m serial). Exit code 5 is "no test selected", which a
# PYTEST_ARGS of one file makes of one of the two.
test: $(HOROVOD_STAMP)
	$(PY) -m ruff check .
	$(PY) -m compileall -q harness methods models tests > /dev/null
	$(PY) -m pytest -n $(LANES) --dist loadfile -m 'not faults and not serial' $(PYTEST_ARGS) \
		|| test $$? -eq 5
	$(PY) -m pytest -m 'serial and not faults' $(PYTEST_ARGS) || test $$? -eq 5

faults: $(STAMP)  # every fault of tests/test_faults.py with every kind of method (~15 min)
	$(PY) -m pytest -m faults tests/test_faults.py $(PYTEST_ARGS)

soak: $(STAMP)  # whole rounds of every method: ~200 local, ~50 emulated, 50 verify runs (~100 min)
	$(PY) -m tests.soak --local 200 --emulated 50 --verify 50

lint: $(STAMP)
	$(PY) -m ruff check .

bench: $(HOROVOD_STAMP)
	$(PY) -m harness.methodbench

report: $(STAMP)
	$(PY) -m harness.report

clean:
	rm -rf results/*.parquet plots/*

# Two commands: `make bench` (the main job) and `make test`; each installs its environment on first
# use (.venv, .venv-test). `make setup` makes .venv alone, for `.venv/bin/python -m models.train`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Pick the jax flavour for the machine we are on: a CUDA GPU, a Cloud TPU VM, or the CPU.
ACCEL := $(shell if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then echo cuda; \
           elif ls /dev/accel0 /dev/vfio/0 >/dev/null 2>&1; then echo tpu; else echo cpu; fi)
COMMA := ,
BENCH_EXTRAS := bench$(if $(filter-out cpu,$(ACCEL)),$(COMMA)$(ACCEL))

.PHONY: setup bench test clean

$(VENV)/.bench-$(ACCEL): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[$(BENCH_EXTRAS)]"
	touch $@

# The tests' own environment: the `test` extra brings libtpu (the TPU compiles), whose banner
# every CPU run of the CLI and bench printed when it shared .venv.
TEST_VENV ?= .venv-test
TEST_PY := $(TEST_VENV)/bin/python

$(TEST_VENV)/.test: pyproject.toml
	$(PYTHON) -m venv $(TEST_VENV)
	$(TEST_PY) -m pip install -q --upgrade pip
	$(TEST_PY) -m pip install -q -e ".[test]"
	touch $@

setup: $(VENV)/.bench-$(ACCEL)

bench: $(VENV)/.bench-$(ACCEL)
	$(PY) -m bench $(ARGS)

test: $(TEST_VENV)/.test
	JAX_PLATFORMS=cpu $(TEST_PY) -m pytest -q -rs -n auto --maxprocesses=4 --dist worksteal $(ARGS)

clean:
	rm -rf $(VENV) $(TEST_VENV)

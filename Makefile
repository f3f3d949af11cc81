# Two commands do all set-up on a fresh Python 3.11 CPU machine:
#   make demo   - the main job on its CPU default
#   make test   - the test suite (what CI runs)
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint venv clean

$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU build of torch from local disk; never a plain `torch` (that pulls a CUDA build).
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q 'megatron-core>=0.16,<0.17' -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/charm-megatron demo

# Two workers (pytest-xdist): one runs while the other waits on a timeout or a rank pool.
test: $(STAMP)
	$(PY) -m ruff check charm_megatron tests
	$(PY) -m pytest -q -n 2 tests

lint: $(STAMP)
	$(PY) -m ruff check charm_megatron tests

clean:
	rm -rf $(VENV) build *.egg-info

# Quick start: `make demo` and `make test` do every set-up step themselves.
#   CUDA=1 make build   also builds ggml's CUDA backend (needs nvcc and cuBLAS)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
CUDA   ?= 0

.PHONY: all build test test-all demo doctor clean distclean

all: build

$(VENV)/.deps: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel cffi
	touch $@

build: $(VENV)/.deps
	PYTRAIN_CUDA=$(CUDA) $(PY) native/build.py
	$(PY) -m pip install -q --no-build-isolation -e '.[test]'

test: build
	$(PY) -m pytest -q

demo: build
	$(PY) -m pytrain doctor
	$(PY) scripts/demo.py

# the masking experiments (README "Masking experiments"): runs in experiments/, tables, plots
# and JSON copied to experiments_results/
.PHONY: experiments
experiments: build
	$(PY) scripts/masking_experiments.py --out experiments --results experiments_results

doctor: build
	$(PY) -m pytrain doctor

clean:
	rm -rf pytrain/_native/lib pytrain/_native/_ggml* pytrain/_native/build_info.json build *.egg-info

distclean: clean
	rm -rf $(VENV)

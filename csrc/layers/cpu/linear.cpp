// y = x w^T for a few rows (verispec/layers/linear.h): one read of each weight row serves up to
// kLinearRowBlock rows of x; the N dimension is split between threads.
//
// Every output element runs the same float sequence, whatever the blocking: a vector of
// lane sums, one FMA per vector-width chunk of k in order, the K tail as one masked
// chunk (zeros in the unused lanes), then one fixed horizontal sum. The row block, the
// number of weight rows in flight (R), the thread split and the strides only decide
// which elements are computed together, never how one is computed.
#include "verispec/layers/linear.h"

#include "linear_tiles.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include <dlfcn.h>
#include <link.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(_M_X64)
#define VERISPEC_X86 1
#include <immintrin.h>
#endif

#ifndef VERISPEC_LINEAR_PREFETCH
#define VERISPEC_LINEAR_PREFETCH 1024
#endif
#ifndef VERISPEC_LINEAR_PREFETCH_ROWS
#define VERISPEC_LINEAR_PREFETCH_ROWS 16
#endif

namespace verispec {
namespace {

// ---- the worker pool ---------------------------------------------------------------
//
// A few persistent threads for the N split. A verify pass calls the kernel ~4 times a
// layer with ~50-100 us of other work in between, so workers spin for a while after a
// job before sleeping on a condition variable (a futex wake costs more than the work of
// a small call). One job at a time; the caller runs part 0 itself.

inline void cpu_relax() {
#if VERISPEC_X86
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

class WorkerPool {
 public:
  using Fn = void (*)(void* ctx, int part);

  // The process's pool; a forked child gets a new one (the parent's threads are not
  // there), the old one is leaked on purpose.
  static WorkerPool& instance() {
    static std::mutex mu;
    static WorkerPool* pool = nullptr;
    std::lock_guard<std::mutex> lock(mu);
    if (pool == nullptr || pool->pid_ != getpid()) pool = new WorkerPool();
    return *pool;
  }

  void run(int parts, Fn fn, void* ctx) {
    if (parts <= 1) {
      fn(ctx, 0);
      return;
    }
    std::lock_guard<std::mutex> job(run_mu_);
    ensure_workers(parts - 1);
    // A seqlock: the epoch is odd while the job is written, even once it is published.
    // Workers read the job between two even, equal epochs (worker_loop).
    epoch_.fetch_add(1);
    fn_.store(fn);
    ctx_.store(ctx);
    parts_.store(parts);
    remaining_.store(parts - 1);
    epoch_.fetch_add(1);
    if (sleepers_.load() > 0) {
      { std::lock_guard<std::mutex> lock(mu_); }
      cv_.notify_all();
    }
    fn(ctx, 0);
    // Parts 1.. must all run before the next job may overwrite the fields they read.
    while (remaining_.load() != 0) cpu_relax();
  }

 private:
  WorkerPool() : pid_(getpid()) {}

  void ensure_workers(int n) {
    while (static_cast<int>(workers_started_) < n) {
      const int index = static_cast<int>(++workers_started_);  // workers run parts 1..
      std::thread([this, index] { worker_loop(index); }).detach();
    }
  }

  void worker_loop(int index) {
    uint64_t seen = 0;  // a worker started for a job sees that job's epoch as new
    for (;;) {
      int spins = 0;
      uint64_t e;
      while ((e = epoch_.load()) == seen || (e & 1u) != 0) {
        if (++spins < kSpinIterations) {
          cpu_relax();
          continue;
        }
        std::unique_lock<std::mutex> lock(mu_);
        sleepers_.fetch_add(1);
        cv_.wait(lock, [&] {
          const uint64_t now = epoch_.load();
          return now != seen && (now & 1u) == 0;
        });
        sleepers_.fetch_sub(1);
        spins = 0;
      }
      const Fn fn = fn_.load();
      void* const ctx = ctx_.load();
      const int parts = parts_.load();
      if (epoch_.load() != e) continue;  // a newer job was being written: read again
      seen = e;
      // Only parts 1..parts-1 are waited for, so their fields cannot change under them;
      // a worker outside the job only records that it saw it.
      if (index < parts) {
        fn(ctx, index);
        remaining_.fetch_sub(1);
      }
    }
  }

  // ~100-200 us of pause instructions before a worker sleeps.
  static constexpr int kSpinIterations = 4000;

  const pid_t pid_;
  std::mutex run_mu_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<uint64_t> epoch_{0};
  std::atomic<int> remaining_{0};
  std::atomic<int> sleepers_{0};
  unsigned workers_started_ = 0;
  std::atomic<Fn> fn_{nullptr};
  std::atomic<void*> ctx_{nullptr};
  std::atomic<int> parts_{0};
};

// ---- the process's OpenMP runtime ------------------------------------------------------
//
// torch runs its CPU ops on an OpenMP thread team (the libgomp it ships). Threads of our
// own next to that team oversubscribe the cores: after each of torch's parallel ops its
// workers spin, our workers get descheduled, and a split product ends up slower than one
// thread (measured in a SmolLM2 decode: 2.3x slower). So when the process has loaded an
// OpenMP runtime, the N split runs on that runtime's team through the GOMP entry point
// every OpenMP runtime on Linux exports (libgomp, LLVM's libomp, Intel's libiomp5); the
// module links none, it looks the loaded one up. Without one, the WorkerPool above runs it.

struct OpenMp {
  void (*parallel)(void (*fn)(void*), void* data, unsigned num_threads, unsigned flags) = nullptr;
  int (*thread_num)() = nullptr;
  int (*num_threads)() = nullptr;
};

int find_openmp_in(struct dl_phdr_info* info, size_t, void* out) {
  const char* name = info->dlpi_name;
  if (name == nullptr || name[0] == '\0') return 0;
  const std::string path(name);
  const size_t slash = path.rfind('/');
  const std::string base = slash == std::string::npos ? path : path.substr(slash + 1);
  if (base.rfind("libgomp", 0) != 0 && base.rfind("libiomp", 0) != 0 && base.rfind("libomp", 0) != 0)
    return 0;
  void* handle = dlopen(name, RTLD_LAZY | RTLD_NOLOAD);
  if (handle == nullptr) return 0;
  OpenMp found;
  found.parallel = reinterpret_cast<decltype(found.parallel)>(dlsym(handle, "GOMP_parallel"));
  found.thread_num = reinterpret_cast<int (*)()>(dlsym(handle, "omp_get_thread_num"));
  found.num_threads = reinterpret_cast<int (*)()>(dlsym(handle, "omp_get_num_threads"));
  // The reference from RTLD_NOLOAD is dropped; the library stays (it was loaded already).
  dlclose(handle);
  if (found.parallel == nullptr || found.thread_num == nullptr || found.num_threads == nullptr)
    return 0;
  *static_cast<OpenMp*>(out) = found;
  return 1;  // the first one found (torch's, in a torch process)
}

// The loaded OpenMP runtime, looked up at the first parallel call (when a tensor has
// reached us, torch and its runtime are loaded); nullptr if there is none.
const OpenMp* openmp() {
  static const OpenMp runtime = [] {
    OpenMp r;
    dl_iterate_phdr(&find_openmp_in, &r);
    return r;
  }();
  return runtime.parallel != nullptr ? &runtime : nullptr;
}

struct OpenMpJob {
  void (*fn)(void*, int);
  void* ctx;
  int parts;
  const OpenMp* omp;
};

void openmp_body(void* data) {
  const OpenMpJob& job = *static_cast<const OpenMpJob*>(data);
  // The runtime may give fewer threads than asked (nesting, thread limits): stride.
  const int team = job.omp->num_threads();
  for (int part = job.omp->thread_num(); part < job.parts; part += team) job.fn(job.ctx, part);
}

// Runs fn(ctx, part) for every part in [0, parts), in parallel.
void parallel_parts(int parts, void (*fn)(void*, int), void* ctx, bool own_threads) {
  if (parts <= 1) {
    fn(ctx, 0);
    return;
  }
  const OpenMp* omp = own_threads ? nullptr : openmp();
  if (omp != nullptr) {
    OpenMpJob job{fn, ctx, parts, omp};
    omp->parallel(&openmp_body, &job, static_cast<unsigned>(parts), 0);
    return;
  }
  WorkerPool::instance().run(parts, fn, ctx);
}

// ---- kernels -------------------------------------------------------------------------
//
// block<MB, R>: y[0..MB) x [0..R) of one tile. x, w, y point at the tile's first row /
// weight row / output; strides in elements.

struct Tile {
  const float* x;
  const float* w;
  float* y;
  int64_t ldx, ldw, ldy, k;
};

// Scalar: 8 lane sums (as a 256-bit vector would hold), std::fma per element.
constexpr int kScalarLanes = 8;

template <int MB, int R>
void block_scalar(const Tile& t) {
  float acc[MB][R][kScalarLanes] = {};
  for (int64_t kk = 0; kk < t.k; ++kk) {
    const int lane = static_cast<int>(kk % kScalarLanes);
    for (int m = 0; m < MB; ++m) {
      const float xv = t.x[m * t.ldx + kk];
      for (int r = 0; r < R; ++r)
        acc[m][r][lane] = std::fma(xv, t.w[r * t.ldw + kk], acc[m][r][lane]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) {
      const float* a = acc[m][r];
      t.y[m * t.ldy + r] = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
    }
}

struct TileKN {
  const float* x;
  const float* w;  // w[0, first column]; row k at w + k * ldw
  float* y;
  int64_t ldx, ldw, ldy, k;
  int cols;  // columns of this tile for a masked tile (< the vector width), else >= it
  bool accumulate;  // continue the sums already in y (a later block of k), else start at 0
};

// Scalar: one std::fma chain per output, as the vector kernels do it lane-wise.
constexpr int kScalarColumns = 16;

template <int MB, int R>
void kn_scalar(const TileKN& t) {
  const int cols = std::min(t.cols, kScalarColumns * R);
  for (int m = 0; m < MB; ++m)
    for (int c = 0; c < cols; ++c) {
      float acc = t.accumulate ? t.y[m * t.ldy + c] : 0.0f;
      for (int64_t kk = 0; kk < t.k; ++kk) acc = std::fma(t.x[m * t.ldx + kk], t.w[kk * t.ldw + c], acc);
      t.y[m * t.ldy + c] = acc;
    }
}

#if VERISPEC_X86

// Software prefetch distance along a weight row. The weights stream from memory once
// per call; with several rows of x the loop is slow enough that the hardware prefetcher
// alone leaves it waiting on memory (measured: 4.5x slower per weight at 6 rows than at
// 1 row without it). A prefetch past the end of a row lands in the next rows, which the
// following tiles read (torch keeps a Linear's weight rows contiguous).
constexpr int64_t kPrefetchFloats = VERISPEC_LINEAR_PREFETCH;

__attribute__((target("avx2,fma"))) inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 0x55));
  return _mm_cvtss_f32(s);
}

template <int MB, int R>
__attribute__((target("avx2,fma"))) void block_avx2(const Tile& t) {
  __m256 acc[MB][R];
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[m][r] = _mm256_setzero_ps();
  int64_t kk = 0;
  for (; kk + 8 <= t.k; kk += 8) {
    __m256 wv[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      if ((kk & 15) == 0)
        _mm_prefetch(reinterpret_cast<const char*>(t.w + r * t.ldw + kk + kPrefetchFloats), _MM_HINT_T0);
      wv[r] = _mm256_loadu_ps(t.w + r * t.ldw + kk);
    }
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      const __m256 xv = _mm256_loadu_ps(t.x + m * t.ldx + kk);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[m][r] = _mm256_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  if (kk < t.k) {
    const int rest = static_cast<int>(t.k - kk);
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(rest), lanes);
    __m256 wv[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) wv[r] = _mm256_maskload_ps(t.w + r * t.ldw + kk, mask);
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      const __m256 xv = _mm256_maskload_ps(t.x + m * t.ldx + kk, mask);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[m][r] = _mm256_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) t.y[m * t.ldy + r] = hsum256(acc[m][r]);
}

// A fixed tree over the 16 lanes: lane i + lane i + 8, then hsum256 of those 8. Through
// memory: GCC 12's 512-bit shuffle/extract intrinsics trip -Wuninitialized in its own
// headers.
__attribute__((target("avx512f,avx2,fma"))) inline float hsum512(__m512 v) {
  alignas(64) float a[16];
  _mm512_store_ps(a, v);
  return hsum256(_mm256_add_ps(_mm256_load_ps(a), _mm256_load_ps(a + 8)));
}

__attribute__((target("avx512f,avx2,fma"))) float reduce_avx512(const float* lanes) {
  return hsum512(_mm512_loadu_ps(lanes));
}

template <int MB, int R>
__attribute__((target("avx512f,avx2,fma"))) void block_avx512(const Tile& t) {
  __m512 acc[MB][R];
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  int64_t kk = 0;
  for (; kk + 16 <= t.k; kk += 16) {
    __m512 wv[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(t.w + r * t.ldw + kk + kPrefetchFloats), _MM_HINT_T0);
      wv[r] = _mm512_loadu_ps(t.w + r * t.ldw + kk);
    }
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      const __m512 xv = _mm512_loadu_ps(t.x + m * t.ldx + kk);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  if (kk < t.k) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (t.k - kk)) - 1u);
    __m512 wv[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) wv[r] = _mm512_maskz_loadu_ps(mask, t.w + r * t.ldw + kk);
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, t.x + m * t.ldx + kk);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) t.y[m * t.ldy + r] = hsum512(acc[m][r]);
}

// ---- weights stored [K, N] (w^T row-major: a column-major Linear weight) -----------------
//
// kn_*<MB, R>: y[0..MB) x R vectors of columns. Each output is one FMA chain over k in
// order (acc = fma(x[m, k], w[k, n], acc)), so every instruction set, tile and split gives
// the same bits. A tile reads R vectors from each of the K weight rows; the rows are a
// stride apart, which the hardware prefetcher does not follow: prefetch kPrefetchRowsKN
// rows ahead. `cols` < vector width marks a masked last tile (R = 1).

constexpr int64_t kPrefetchRowsKN = VERISPEC_LINEAR_PREFETCH_ROWS;

template <int MB, int R>
__attribute__((target("avx512f,avx2,fma"))) void kn_avx512(const TileKN& t) {
  const __mmask16 mask = t.cols >= 16 ? static_cast<__mmask16>(0xFFFF)
                                      : static_cast<__mmask16>((1u << t.cols) - 1u);
  __m512 acc[MB][R];
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
      acc[m][r] = !t.accumulate ? _mm512_setzero_ps()
                  : R == 1      ? _mm512_maskz_loadu_ps(mask, t.y + m * t.ldy)
                                : _mm512_loadu_ps(t.y + m * t.ldy + 16 * r);
  for (int64_t kk = 0; kk < t.k; ++kk) {
    const float* wr = t.w + kk * t.ldw;
    __m512 wv[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(wr + kPrefetchRowsKN * t.ldw + 16 * r), _MM_HINT_T0);
      wv[r] = R == 1 ? _mm512_maskz_loadu_ps(mask, wr) : _mm512_loadu_ps(wr + 16 * r);
    }
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      const __m512 xb = _mm512_set1_ps(t.x[m * t.ldx + kk]);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_fmadd_ps(xb, wv[r], acc[m][r]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) {
      if (R == 1)
        _mm512_mask_storeu_ps(t.y + m * t.ldy, mask, acc[m][0]);
      else
        _mm512_storeu_ps(t.y + m * t.ldy + 16 * r, acc[m][r]);
    }
}

template <int MB, int R>
__attribute__((target("avx2,fma"))) void kn_avx2(const TileKN& t) {
  const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(t.cols >= 8 ? 8 : t.cols),
                                          _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  __m256 acc[MB];
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m)
    acc[m] = t.accumulate ? _mm256_maskload_ps(t.y + m * t.ldy, mask) : _mm256_setzero_ps();
  for (int64_t kk = 0; kk < t.k; ++kk) {
    const float* wr = t.w + kk * t.ldw;
    _mm_prefetch(reinterpret_cast<const char*>(wr + kPrefetchRowsKN * t.ldw), _MM_HINT_T0);
    const __m256 wv = _mm256_maskload_ps(wr, mask);
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m)
      acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(t.x[m * t.ldx + kk]), wv, acc[m]);
  }
  for (int m = 0; m < MB; ++m) _mm256_maskstore_ps(t.y + m * t.ldy, mask, acc[m]);
}

bool cpu_has(const char* feature) {
  __builtin_cpu_init();
  if (feature[0] == 'a' && feature[3] == '2') {  // "avx2": with fma
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }
  return __builtin_cpu_supports("avx512f");
}

#endif  // VERISPEC_X86

using BlockFn = void (*)(const Tile&);

// The tile functions of one instruction set: [MB - 1] for R = wide and R = 1.
using BlockKnFn = void (*)(const TileKN&);

struct IsaKernels {
  int wide;  // weight rows in flight in the main loop
  BlockFn wide_fn[kLinearRowBlock];
  BlockFn one_fn[kLinearRowBlock];
  // [K, N] weights: vectors of `width` columns, `kn_wide` of them per wide tile
  int width;
  int kn_wide;
  BlockKnFn kn_wide_fn[kLinearRowBlock];
  BlockKnFn kn_one_fn[kLinearRowBlock];
};

template <template <int, int> class Maker, int R, int Width, int RKn, size_t... I>
constexpr IsaKernels make_kernels(std::index_sequence<I...>) {
  return IsaKernels{R, {Maker<static_cast<int>(I) + 1, R>::fn...},
                    {Maker<static_cast<int>(I) + 1, 1>::fn...},
                    Width, RKn, {Maker<static_cast<int>(I) + 1, RKn>::kn...},
                    {Maker<static_cast<int>(I) + 1, 1>::kn...}};
}

template <int MB, int R>
struct ScalarMaker {
  static constexpr BlockFn fn = &block_scalar<MB, R>;
  static constexpr BlockKnFn kn = &kn_scalar<MB, R>;
};
constexpr IsaKernels kScalar =
    make_kernels<ScalarMaker, 2, kScalarColumns, 1>(std::make_index_sequence<kLinearRowBlock>{});

#if VERISPEC_X86
template <int MB, int R>
struct Avx2Maker {
  static constexpr BlockFn fn = &block_avx2<MB, R>;
  static constexpr BlockKnFn kn = &kn_avx2<MB, R>;
};
// 16 ymm registers: 8 rows x 1 weight row of sums (+ w + x); R = 2 would spill at MB 8.
constexpr IsaKernels kAvx2 = make_kernels<Avx2Maker, 1, 8, 1>(std::make_index_sequence<kLinearRowBlock>{});

template <int MB, int R>
struct Avx512Maker {
  static constexpr BlockFn fn = &block_avx512<MB, R>;
  static constexpr BlockKnFn kn = &kn_avx512<MB, R>;
};
// 32 zmm registers: 8 rows x 3 weight rows of sums + 3 w + 1 x = 28.
// [K, N]: 8 rows x 3 vectors of 16 columns of sums + 3 w + 1 broadcast x.
constexpr IsaKernels kAvx512 =
    make_kernels<Avx512Maker, 3, 16, 3>(std::make_index_sequence<kLinearRowBlock>{});
#endif

const IsaKernels& kernels_for(LinearIsa isa) {
#if VERISPEC_X86
  if (isa == LinearIsa::kAvx512) return kAvx512;
  if (isa == LinearIsa::kAvx2) return kAvx2;
#endif
  (void)isa;
  return kScalar;
}

// One job: the caller's arguments, split over the N dimension.
struct Job {
  const LinearArgs* args;
  const IsaKernels* kernels;
  int64_t cols_per_part;
};

// [K, N] weights are read in panels of kPanelTiles wide tiles x kBlockRows rows: the
// tiles of a panel read neighbouring pieces of the same weight rows one after another,
// where one tile walking all K rows reads 192 bytes a row, each row a stride apart
// (measured on SmolLM2's shapes, 6 rows: 45 ms per forward's products unblocked, 34 ms
// with 16 x 32; 4-64 tiles and 8-128 rows tried). The sums of a tile continue across
// blocks through y (a float store and load are exact, so the chain is unchanged).
constexpr int64_t kPanelTiles = 16;
constexpr int64_t kBlockRows = 32;

void run_part_kn(const Job& job, int64_t n0, int64_t n1) {
  const LinearArgs& a = *job.args;
  const IsaKernels& kern = *job.kernels;
  const int64_t wide = static_cast<int64_t>(kern.width) * kern.kn_wide;
  for (int64_t p0 = n0; p0 < n1; p0 += wide * kPanelTiles) {
    const int64_t p1 = std::min(n1, p0 + wide * kPanelTiles);
    int64_t k0 = 0;
    do {  // at least once: k = 0 still writes the zero sums
      const int64_t kb = std::min(kBlockRows, a.k - k0);
      const float* w_block = a.w + k0 * a.ldw;
      // Every block of kLinearRowBlock rows of x takes the panel's block of weights while
      // it is in cache (rows past the first block no longer stream the weights again).
      for (int64_t m0 = 0; m0 < a.m; m0 += kLinearRowBlock) {
        const int mb = static_cast<int>(std::min<int64_t>(kLinearRowBlock, a.m - m0));
        TileKN t{a.x + m0 * a.ldx + k0, nullptr, nullptr, a.ldx, a.ldw, a.ldy, kb, kern.width,
                 k0 > 0};
        int64_t n = p0;
        for (; n + wide <= p1; n += wide) {
          t.w = w_block + n;
          t.y = a.y + m0 * a.ldy + n;
          t.cols = static_cast<int>(wide);
          kern.kn_wide_fn[mb - 1](t);
        }
        for (; n < p1; n += kern.width) {
          t.w = w_block + n;
          t.y = a.y + m0 * a.ldy + n;
          t.cols = static_cast<int>(std::min<int64_t>(kern.width, p1 - n));
          kern.kn_one_fn[mb - 1](t);
        }
      }
      k0 += kb;
    } while (k0 < a.k);
  }
}

void run_part(void* ctx, int part) {
  const Job& job = *static_cast<const Job*>(ctx);
  const LinearArgs& a = *job.args;
  const int64_t n0 = part * job.cols_per_part;
  const int64_t n1 = std::min(a.n, n0 + job.cols_per_part);
  if (a.weight_kn) {
    run_part_kn(job, n0, n1);
    return;
  }
  // Weight rows outside, blocks of kLinearRowBlock rows of x inside: a tile's weight rows
  // are read from memory once, for the first block, and from L1 for the others (x's
  // blocks outside streamed the weights once per block: a 9-row product cost ~1.4x an
  // 8-row one). Each output's sum is the tile function's whatever the loop order.
  const int wide = job.kernels->wide;
  Tile t{a.x, nullptr, nullptr, a.ldx, a.ldw, a.ldy, a.k};
  const auto tile = [&](int64_t n, const BlockFn* fns) {
    for (int64_t m0 = 0; m0 < a.m; m0 += kLinearRowBlock) {
      const int mb = static_cast<int>(std::min<int64_t>(kLinearRowBlock, a.m - m0));
      t.x = a.x + m0 * a.ldx;
      t.w = a.w + n * a.ldw;
      t.y = a.y + m0 * a.ldy + n;
      fns[mb - 1](t);
    }
  };
  int64_t n = n0;
  for (; n + wide <= n1; n += wide) tile(n, job.kernels->wide_fn);
  for (; n < n1; ++n) tile(n, job.kernels->one_fn);
}

// The most threads read_stream splits a read over.
constexpr int kMaxReadParts = 256;

// Below this many multiply-adds a call runs on one thread (waking a worker costs more).
constexpr int64_t kMinWorkPerThread = int64_t{1} << 16;

bool overlaps(const void* a, int64_t a_bytes, const void* b, int64_t b_bytes) {
  const auto pa = reinterpret_cast<uintptr_t>(a), pb = reinterpret_cast<uintptr_t>(b);
  return pa < pb + static_cast<uintptr_t>(b_bytes) && pb < pa + static_cast<uintptr_t>(a_bytes);
}

}  // namespace

namespace linear_detail {

int tile_rows(LinearIsa isa) { return kernels_for(isa).wide; }

void tile_f32(LinearIsa isa, int mb, int rows, const float* x, int64_t ldx, const float* w,
              int64_t ldw, float* y, int64_t ldy, int64_t k) {
  const IsaKernels& kern = kernels_for(isa);
  const Tile t{x, w, y, ldx, ldw, ldy, k};
  (rows == 1 ? kern.one_fn : kern.wide_fn)[mb - 1](t);
}

void run_parallel(int parts, void (*fn)(void*, int), void* ctx, bool own_threads) {
  parallel_parts(parts, fn, ctx, own_threads);
}

float reduce_avx512_lanes(const float* lanes) {
#if VERISPEC_X86
  return reduce_avx512(lanes);  // callers run AVX-512 code already
#else
  (void)lanes;
  return NAN;  // never called without AVX-512
#endif
}

LinearIsa resolve_isa(LinearIsa isa) { return isa == LinearIsa::kAuto ? linear_best_isa() : isa; }

}  // namespace linear_detail

bool linear_isa_supported(LinearIsa isa) {
  switch (isa) {
    case LinearIsa::kAuto:
    case LinearIsa::kScalar:
      return true;
#if VERISPEC_X86
    case LinearIsa::kAvx2:
      return cpu_has("avx2");
    case LinearIsa::kAvx512:
      return cpu_has("avx512f");
#endif
    default:
      return false;
  }
}

LinearIsa linear_best_isa() {
  static const LinearIsa best = [] {
    if (linear_isa_supported(LinearIsa::kAvx512)) return LinearIsa::kAvx512;
    if (linear_isa_supported(LinearIsa::kAvx2)) return LinearIsa::kAvx2;
    return LinearIsa::kScalar;
  }();
  return best;
}

const char* linear_threads_name() { return openmp() != nullptr ? "openmp" : "verispec"; }

const char* linear_isa_name(LinearIsa isa) {
  switch (isa) {
    case LinearIsa::kAuto: return "auto";
    case LinearIsa::kScalar: return "scalar";
    case LinearIsa::kAvx2: return "avx2";
    case LinearIsa::kAvx512: return "avx512";
  }
  return "unknown";
}

namespace {

struct ReadJob {
  const uint64_t* words;
  int64_t count, per;
  uint64_t parts[kMaxReadParts];
};

// Eight independent XOR chains over the part's words (the compiler's vector loads do the
// rest): far more reads in flight than memory can answer, on any x86-64 or AArch64 core.
void read_part(void* ctx, int part) {
  ReadJob& j = *static_cast<ReadJob*>(ctx);
  const int64_t w0 = part * j.per, w1 = std::min(j.count, w0 + j.per);
  uint64_t acc[8] = {};
  int64_t w = w0;
  for (; w + 8 <= w1; w += 8)
    for (int i = 0; i < 8; ++i) acc[i] ^= j.words[w + i];
  for (; w < w1; ++w) acc[0] ^= j.words[w];
  j.parts[part] = ((acc[0] ^ acc[1]) ^ (acc[2] ^ acc[3])) ^ ((acc[4] ^ acc[5]) ^ (acc[6] ^ acc[7]));
}

}  // namespace

uint64_t read_stream(const void* p, int64_t bytes, int num_threads) {
  ReadJob job{};
  job.words = static_cast<const uint64_t*>(p);
  job.count = std::max<int64_t>(bytes, 0) / 8;
  if (job.count == 0) return 0;
  const int parts = static_cast<int>(std::clamp<int64_t>(num_threads, 1, kMaxReadParts));
  job.per = (job.count + parts - 1) / parts;
  job.per = (job.per + 7) / 8 * 8;  // whole 64-byte lines a part
  const int used = static_cast<int>((job.count + job.per - 1) / job.per);
  parallel_parts(used, &read_part, &job, /*own_threads=*/false);
  uint64_t x = 0;
  for (int i = 0; i < used; ++i) x ^= job.parts[i];
  return x;
}

std::string linear_f32(const LinearArgs& a) {
  if (a.m < 0 || a.n < 0 || a.k < 0)
    return "sizes must be >= 0, got m = " + std::to_string(a.m) + ", n = " + std::to_string(a.n) +
           ", k = " + std::to_string(a.k);
  const int64_t w_row = a.weight_kn ? a.n : a.k;  // elements of one row of w
  if (a.ldx < a.k || a.ldw < w_row || a.ldy < a.n)
    return "row strides must cover a row: ldx = " + std::to_string(a.ldx) + " (>= k = " +
           std::to_string(a.k) + "), ldw = " + std::to_string(a.ldw) + " (>= " +
           (a.weight_kn ? "n = " : "k = ") + std::to_string(w_row) + "), ldy = " +
           std::to_string(a.ldy) + " (>= n = " + std::to_string(a.n) + ")";
  if (a.num_threads < 1) return "num_threads must be >= 1, got " + std::to_string(a.num_threads);
  if (!linear_isa_supported(a.isa))
    return std::string("instruction set ") + linear_isa_name(a.isa) + " is not supported by this CPU";
  if (a.m == 0 || a.n == 0) return "";
  const int64_t y_bytes = ((a.m - 1) * a.ldy + a.n) * 4;
  if (overlaps(a.y, y_bytes, a.x, ((a.m - 1) * a.ldx + a.k) * 4) ||
      overlaps(a.y, y_bytes, a.w,
               (a.weight_kn ? (a.k - 1) * a.ldw + a.n : (a.n - 1) * a.ldw + a.k) * 4))
    return "the output must not overlap x or w";

  const LinearIsa isa = a.isa == LinearIsa::kAuto ? linear_best_isa() : a.isa;
  const IsaKernels& kernels = kernels_for(isa);
  const int64_t work = a.m * a.n * std::max<int64_t>(a.k, 1);
  int64_t parts = std::min<int64_t>(a.num_threads, std::max<int64_t>(1, work / kMinWorkPerThread));
  const int64_t tile = a.weight_kn ? int64_t{kernels.width} * kernels.kn_wide : kernels.wide;
  parts = std::min<int64_t>(parts, (a.n + tile - 1) / tile);
  // Whole wide tiles per part, so only the last part has a remainder.
  int64_t per = (a.n + parts - 1) / parts;
  per = (per + tile - 1) / tile * tile;
  parts = (a.n + per - 1) / per;
  Job job{&a, &kernels, per};
  parallel_parts(static_cast<int>(parts), &run_part, &job, a.own_threads);
  return "";
}

}  // namespace verispec

// A host simulation of the CUDA features the kernels use (cuda/block_ops.cuh,
// cuda/row_kernels.cuh), so their device code runs and is tested on a machine without a
// GPU. Every simulated thread of a block is a fiber on the calling thread;
// __syncthreads parks a fiber until every thread of the block has arrived, a warp shuffle
// exchanges through a buffer between two barriers of the warp. At each release the
// waiting fibers resume in a fresh pseudo-random order (fixed seed), so a read of shared
// memory that is missing its barrier sees a stale value in some rounds instead of always
// running after the write. A barrier that can never be released (a thread returned while
// the others wait, or a warp split at a shuffle) aborts with a message rather than hang.
// It checks logic, not speed or the memory ordering of a real GPU. The CUB stand-ins are
// in cub_stand_in.h, the CUDA runtime's (the launchers of ops.cu run here whole) in
// cuda_runtime.h.
//
// The device passes: __CUDA_ARCH__ is defined, so the shared headers compile their
// device-only branches (sampling_math.h's __float2ull_rz, __umul64hi, __fmul_rn, ...),
// and the intrinsics below are host twins of what CUDA defines them to compute. Those
// branches are then what the simulation checks against the CPU, not the host's. The
// functions both backends share (VERISPEC_HD, verispec/host_device.h) carry an ABI tag
// here, so that their device versions are symbols of their own and never stand in for
// the host versions the CPU launchers of the same program call. A file that includes
// this header must not include CPU kernel code (kernels/cpu/): it compares with the CPU
// launchers of the library.
//
// Shared memory: every __shared__ object of the device code starts each block filled with
// garbage (a different byte each block), as a GPU's shared memory holds whatever the last
// block left: a read before the block's own write shows.
#pragma once

#define __CUDA_ARCH__ 900
#define VERISPEC_CUDA_SIM 1

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>

#include <elf.h>
#include <fcntl.h>
#include <link.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#define CUDA_SIM_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define CUDA_SIM_ASAN 1
#endif
#endif
#ifdef CUDA_SIM_ASAN
#include <sanitizer/common_interface_defs.h>
#endif

namespace cuda_sim {

// ---- context switch: a fiber's registers and stack ------------------------------------
// x86-64: a switch of the callee-saved registers and the stack pointer (no system call;
// glibc's swapcontext saves the signal mask with one, which cost most of the time).
// Elsewhere: ucontext.
#if defined(__x86_64__) && !defined(CUDA_SIM_UCONTEXT)  // the define: test the fallback
extern "C" void cuda_sim_switch(void** save_sp, void* load_sp);
extern "C" void cuda_sim_trampoline();
// Weak symbols: every file of a program that includes this header assembles them, and the
// linker keeps one. cuda_sim_switch: push the callee-saved registers and the x87/SSE control words, save
// rsp, load the other rsp, pop the same. cuda_sim_trampoline: the first return of a new
// fiber lands here with its entry function in r12 and the argument in rbx.
asm(R"(
  .text
  .weak cuda_sim_switch
  .type cuda_sim_switch, @function
cuda_sim_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size cuda_sim_switch, .-cuda_sim_switch

  .weak cuda_sim_trampoline
  .type cuda_sim_trampoline, @function
cuda_sim_trampoline:
  movq %rbx, %rdi
  callq *%r12
  ud2
  .size cuda_sim_trampoline, .-cuda_sim_trampoline
)");

struct Context {
  void* sp = nullptr;
};

// A context that starts fn(arg) on the stack [stack, stack + bytes).
inline void make_context(Context* c, char* stack, size_t bytes, void (*fn)(void*), void* arg) {
  auto top = reinterpret_cast<uintptr_t>(stack + bytes) & ~uintptr_t{15};
  auto* frame = reinterpret_cast<uint64_t*>(top - 80);  // 16-aligned after the pops and ret
  frame[0] = 0x1F80 | (uint64_t{0x037F} << 32);         // default MXCSR, x87 control word
  frame[1] = 0;                                         // r15
  frame[2] = 0;                                         // r14
  frame[3] = 0;                                         // r13
  frame[4] = reinterpret_cast<uint64_t>(fn);            // r12
  frame[5] = reinterpret_cast<uint64_t>(arg);           // rbx
  frame[6] = 0;                                         // rbp
  frame[7] = reinterpret_cast<uint64_t>(&cuda_sim_trampoline);
  c->sp = frame;
}

inline void jump(Context* from, Context* to) { cuda_sim_switch(&from->sp, to->sp); }
#else
}  // namespace cuda_sim
#include <ucontext.h>
namespace cuda_sim {
struct Context {
  ucontext_t uc;
};

inline void make_context(Context* c, char* stack, size_t bytes, void (*fn)(void*), void* arg) {
  getcontext(&c->uc);
  c->uc.uc_stack.ss_sp = stack;
  c->uc.uc_stack.ss_size = bytes;
  c->uc.uc_link = nullptr;
  // makecontext passes int arguments only: the pointer goes in two halves, the function
  // through a static (every fiber starts the same one, Block::entry).
  const auto a = reinterpret_cast<uintptr_t>(arg);
  static void (*target)(void*) = nullptr;
  target = fn;
  makecontext(&c->uc, reinterpret_cast<void (*)()>(+[](unsigned lo, unsigned hi) {
                target(reinterpret_cast<void*>((static_cast<uintptr_t>(hi) << 32) | lo));
              }), 2, static_cast<unsigned>(a & 0xffffffffu), static_cast<unsigned>(a >> 32));
}

inline void jump(Context* from, Context* to) { swapcontext(&from->uc, &to->uc); }
#endif

}  // namespace cuda_sim

#define __device__
#define __host__
#define __forceinline__ inline
#define __global__
#define __launch_bounds__(...)
// Shared memory: one object per kernel for every simulated thread (they all run on the
// calling OS thread). Blocks run one after another (run_grid), so a block has it to
// itself, as on the GPU. thread_local marks the objects as shared memory in the program's
// symbol table (STT_TLS; a section attribute would be dropped by GCC in templates), where
// Block::run finds them to fill with garbage before each block (shared_objects).
#define __shared__ static thread_local

// ---- host twins of the device intrinsics -------------------------------------------------
// What the CUDA Math API and PTX define each to compute, on the host. Float arithmetic
// is IEEE binary32 with round to nearest even on both (the simulation's programs build
// with -ffp-contract=off, so no product here is fused with an add).
inline unsigned int __float_as_uint(float x) {
  unsigned int u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}
inline float __uint_as_float(unsigned int u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
// cvt.rzi.u64.f32: truncation toward zero, saturated to [0, 2^64 - 1]; NaN gives 0.
inline unsigned long long __float2ull_rz(float x) {
  if (!(x > 0.0f)) return 0;
  if (x >= 18446744073709551616.0f) return ~0ull;
  return static_cast<unsigned long long>(x);
}
// cvt.rn.f32.u64: the nearest float, ties to even.
inline float __ull2float_rn(unsigned long long x) { return static_cast<float>(x); }
// The high halves of the full products.
inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
  return static_cast<unsigned long long>((static_cast<unsigned __int128>(a) * b) >> 64);
}
inline unsigned int __umulhi(unsigned int a, unsigned int b) {
  return static_cast<unsigned int>((static_cast<unsigned long long>(a) * b) >> 32);
}

namespace cuda_sim {

struct Dim3 {
  unsigned x = 0, y = 0, z = 0;
};

enum class State { kRunnable, kAtBlockBarrier, kAtWarpBarrier, kDone };

struct Fiber {
  Context context;
  std::unique_ptr<char[]> stack;
  State state = State::kRunnable;
};

// The fibers of one block and the scheduler that runs them.
class Block {
 public:
  static constexpr size_t kStackBytes = 256 * 1024;  // debug + ASan frames are large

  explicit Block(int threads) : threads_(threads), fibers_(static_cast<size_t>(threads)),
                                exchange_(static_cast<size_t>(threads)) {
    for (auto& f : fibers_) f.stack.reset(new char[kStackBytes]);
  }

  // Runs fn() on every thread of block `block_index` until all have returned.
  void run(const std::function<void()>& fn, unsigned block_index);

  // Called by the running fiber.
  void wait_block() { park(State::kAtBlockBarrier); }
  void wait_warp() { park(State::kAtWarpBarrier); }
  int threads() const { return threads_; }
  uint64_t* exchange() { return exchange_.data(); }
  int or_pending = 0;   // __syncthreads_or: predicates of this round
  int or_released = 0;  // ... and of the last released round

 private:
  static void entry(void* block);
  void park(State s);
  void switch_to_scheduler();
  bool release();  // releases what can be; false if nothing could (deadlock)

  int threads_;
  std::vector<Fiber> fibers_;
  std::vector<uint64_t> exchange_;  // one slot per thread for shuffles
  Context scheduler_;
  int current_ = -1;
  const std::function<void()>* fn_ = nullptr;
  std::mt19937 order_rng_{12345};
#ifdef CUDA_SIM_ASAN
  const void* scheduler_stack_bottom_ = nullptr;
  size_t scheduler_stack_size_ = 0;
#endif
};

inline Block* current_block = nullptr;

// Runs fn() on `threads` simulated threads of block `block_index` (blockIdx.x).
inline void run_block(int threads, const std::function<void()>& fn, unsigned block_index = 0);

// Runs the blocks 0 .. grid - 1 of a launch one after another.
inline void run_grid(unsigned grid, int threads, const std::function<void()>& fn);

}  // namespace cuda_sim

// One OS thread runs every fiber, and the scheduler sets these before resuming one.
inline cuda_sim::Dim3 threadIdx;
inline cuda_sim::Dim3 blockIdx;

namespace cuda_sim {

// Global-memory traffic of the buffers a test watches, per row of each buffer: the bytes
// read and written, and the blocks of each launch that touched the row. Device code
// counts through ld / st (cuda/block_ops.cuh), which call read / write here because this
// header defines CUDA_SIM_TRAFFIC; on a GPU they are plain accesses. The counts stand in
// for speed where there is no GPU: passes over the logits, blocks a row is spread over.
class Traffic {
 public:
  struct Row {
    uint64_t read = 0, written = 0;
    std::set<std::pair<unsigned, unsigned>> blocks;  // (launch, blockIdx.x)
  };
  struct Buffer {
    std::string name;
    uintptr_t begin = 0, end = 0;
    size_t row_bytes = 0;
    std::vector<Row> rows;
  };

  // Counts accesses to [base, base + rows * row_bytes) from now on, row by row.
  void watch(const std::string& name, const void* base, size_t rows, size_t row_bytes) {
    Buffer b;
    b.name = name;
    b.begin = reinterpret_cast<uintptr_t>(base);
    b.end = b.begin + rows * row_bytes;
    b.row_bytes = row_bytes;
    b.rows.resize(rows);
    buffers_.push_back(std::move(b));
  }
  void clear() { buffers_.clear(); }
  const Buffer& buffer(const std::string& name) const {
    for (const Buffer& b : buffers_) {
      if (b.name == name) return b;
    }
    std::fprintf(stderr, "cuda_sim: no watched buffer %s\n", name.c_str());
    std::abort();
  }
  // A launch begins (run_grid): the blocks of different launches are told apart.
  void next_launch() { ++launch_; }

  void read(const void* p, size_t bytes) { note(p, bytes, false); }
  void write(const void* p, size_t bytes) { note(p, bytes, true); }

  // What one buffer saw: the most bytes read (written) of any row over its row size (the
  // passes over that row), and the most blocks of one launch that touched any row.
  double max_read_passes(const std::string& name) const { return max_passes(name, false); }
  double max_write_passes(const std::string& name) const { return max_passes(name, true); }
  size_t max_blocks_per_row(const std::string& name) const {
    size_t most = 0;
    for (const Row& r : buffer(name).rows) {
      std::set<unsigned> launches;
      for (const auto& lb : r.blocks) launches.insert(lb.first);
      for (unsigned l : launches) {
        size_t n = 0;
        for (const auto& lb : r.blocks) n += lb.first == l;
        most = std::max(most, n);
      }
    }
    return most;
  }

 private:
  double max_passes(const std::string& name, bool written) const {
    const Buffer& b = buffer(name);
    uint64_t most = 0;
    for (const Row& r : b.rows) most = std::max(most, written ? r.written : r.read);
    return static_cast<double>(most) / static_cast<double>(b.row_bytes);
  }
  void note(const void* p, size_t bytes, bool written);

  std::vector<Buffer> buffers_;
  unsigned launch_ = 0;
};

inline Traffic traffic;

}  // namespace cuda_sim

#define CUDA_SIM_TRAFFIC 1

inline void cuda_sim::Traffic::note(const void* p, size_t bytes, bool written) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  for (Buffer& b : buffers_) {
    if (a < b.begin || a >= b.end) continue;
    Row& r = b.rows[(a - b.begin) / b.row_bytes];
    (written ? r.written : r.read) += bytes;
    r.blocks.insert({launch_, blockIdx.x});
    return;
  }
}

inline void __syncthreads() { cuda_sim::current_block->wait_block(); }

inline int __syncthreads_or(int predicate) {
  cuda_sim::Block* b = cuda_sim::current_block;
  if (predicate) b->or_pending = 1;
  b->wait_block();  // the release moves or_pending to or_released
  return b->or_released;
}

namespace cuda_sim {
// A warp shuffle: every lane of the calling thread's warp offers `value` and reads the
// one lane `src` offers (its own value where src is past the warp's end, as on the GPU).
template <typename T>
T shuffle_from(T value, unsigned src) {
  static_assert(sizeof(T) <= sizeof(uint64_t), "shuffle of a wide type");
  Block* b = current_block;
  const unsigned self = threadIdx.x;
  const unsigned warp = self / 32;
  const unsigned warp_size = static_cast<unsigned>(std::min(32, b->threads() - 32 * static_cast<int>(warp)));
  uint64_t slot = 0;
  std::memcpy(&slot, &value, sizeof(T));
  b->exchange()[self] = slot;
  b->wait_warp();
  T out = value;
  if (src < warp_size) std::memcpy(&out, &b->exchange()[32 * warp + src], sizeof(T));
  b->wait_warp();
  return out;
}
}  // namespace cuda_sim

// Every lane takes part in the kernels' shuffles: the masks are not checked.
template <typename T>
T __shfl_down_sync(unsigned, T value, unsigned delta) {
  return cuda_sim::shuffle_from(value, threadIdx.x % 32 + delta);
}

template <typename T>
T __shfl_xor_sync(unsigned, T value, int lane_mask) {
  return cuda_sim::shuffle_from(value, (threadIdx.x % 32) ^ static_cast<unsigned>(lane_mask));
}


inline int atomicAdd(int* address, int value) {
  const int old = *address;  // fibers: no other thread runs meanwhile
  // wraps on overflow, as the GPU's does (garbage in a histogram must fail a comparison,
  // not stop the program)
  *address = static_cast<int>(static_cast<unsigned>(old) + static_cast<unsigned>(value));
  return old;
}

inline unsigned long long atomicAdd(unsigned long long* address, unsigned long long value) {
  const unsigned long long old = *address;
  *address = old + value;
  return old;
}

inline unsigned long long atomicMin(unsigned long long* address, unsigned long long value) {
  const unsigned long long old = *address;  // fibers: no other thread runs meanwhile
  if (value < old) *address = value;
  return old;
}

using std::min;

namespace cuda_sim {

inline void Block::entry(void* block) {
  Block* self = static_cast<Block*>(block);
#ifdef CUDA_SIM_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &self->scheduler_stack_bottom_,
                                  &self->scheduler_stack_size_);
#endif
  (*self->fn_)();
  self->fibers_[static_cast<size_t>(self->current_)].state = State::kDone;
  self->switch_to_scheduler();  // never returns: the fiber is not resumed
}

inline void Block::switch_to_scheduler() {
  Fiber& f = fibers_[static_cast<size_t>(current_)];
#ifdef CUDA_SIM_ASAN
  void* fake_stack = nullptr;
  const bool done = f.state == State::kDone;
  __sanitizer_start_switch_fiber(done ? nullptr : &fake_stack, scheduler_stack_bottom_,
                                 scheduler_stack_size_);
  jump(&f.context, &scheduler_);
  __sanitizer_finish_switch_fiber(fake_stack, &scheduler_stack_bottom_, &scheduler_stack_size_);
#else
  jump(&f.context, &scheduler_);
#endif
}

inline void Block::park(State s) {
  fibers_[static_cast<size_t>(current_)].state = s;
  switch_to_scheduler();
}

inline bool Block::release() {
  bool released = false;
  // A warp whose every lane waits at a shuffle goes on.
  for (int w = 0; w * 32 < threads_; ++w) {
    const int end = std::min(threads_, 32 * (w + 1));
    bool all = true;
    for (int t = 32 * w; t < end; ++t) all &= fibers_[static_cast<size_t>(t)].state == State::kAtWarpBarrier;
    if (!all) continue;
    for (int t = 32 * w; t < end; ++t) fibers_[static_cast<size_t>(t)].state = State::kRunnable;
    released = true;
  }
  if (released) return true;
  // The block barrier: every thread, none returned.
  for (const Fiber& f : fibers_) {
    if (f.state != State::kAtBlockBarrier) return false;
  }
  for (Fiber& f : fibers_) f.state = State::kRunnable;
  or_released = or_pending;
  or_pending = 0;
  return true;
}

// The __shared__ objects of the program: the thread-local statics of functions of the
// device code (namespace verispec::kernels::cuda) and of the simulation's own test kernels
// (namespace cuda_sim), read from the executable's symbol table, at their addresses in
// this thread's TLS block. Host code declares no thread_local there.
struct SharedObject {
  char* at;
  size_t bytes;
};

inline const std::vector<SharedObject>& shared_objects() {
  static const std::vector<SharedObject> objects = [] {
    std::vector<SharedObject> found;
    char* tls = nullptr;  // the executable (the first module) and its TLS block
    dl_iterate_phdr(
        [](dl_phdr_info* info, size_t, void* out) {
          *static_cast<char**>(out) = static_cast<char*>(info->dlpi_tls_data);
          return 1;
        },
        &tls);
    const int fd = open("/proc/self/exe", O_RDONLY);
    struct stat st {};
    if (tls == nullptr || fd < 0 || fstat(fd, &st) != 0) {
      std::fprintf(stderr, "cuda_sim: cannot find the __shared__ objects\n");
      std::abort();
    }
    void* map = mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    const auto* base = static_cast<const char*>(map);
    const auto* eh = reinterpret_cast<const Elf64_Ehdr*>(base);
    const auto* sh = reinterpret_cast<const Elf64_Shdr*>(base + eh->e_shoff);
    for (int i = 0; i < eh->e_shnum; ++i) {
      if (sh[i].sh_type != SHT_SYMTAB) continue;
      const auto* sym = reinterpret_cast<const Elf64_Sym*>(base + sh[i].sh_offset);
      const char* names = base + sh[sh[i].sh_link].sh_offset;
      for (size_t j = 0; j < sh[i].sh_size / sizeof(Elf64_Sym); ++j) {
        const char* name = names + sym[j].st_name;
        if (ELF64_ST_TYPE(sym[j].st_info) != STT_TLS || sym[j].st_size == 0 ||
            sym[j].st_shndx == SHN_UNDEF) {
          continue;
        }
        if (std::strncmp(name, "_ZZN8verispec7kernels4cuda", 26) == 0 ||
            std::strncmp(name, "_ZZN8cuda_sim", 13) == 0) {
          found.push_back(SharedObject{tls + sym[j].st_value, sym[j].st_size});
        }
      }
    }
    munmap(map, static_cast<size_t>(st.st_size));
    return found;
  }();
  return objects;
}

// Garbage in every __shared__ object before a block runs: a byte that changes from block
// to block (never 0, which would pass for a cleared histogram or sum).
inline void poison_shared_memory() {
  static unsigned round = 0;
  static const unsigned char kBytes[] = {0xa5, 0xff, 0x7f, 0x81, 0x3c, 0xc3, 0x01, 0xfe};
  const unsigned char byte = kBytes[round++ % sizeof kBytes];
  for (const SharedObject& o : shared_objects()) std::memset(o.at, byte, o.bytes);
}

inline void Block::run(const std::function<void()>& fn, unsigned block_index) {
  poison_shared_memory();
  fn_ = &fn;
  blockIdx.x = block_index;
  or_pending = or_released = 0;
  for (Fiber& f : fibers_) {
    make_context(&f.context, f.stack.get(), kStackBytes, &Block::entry, this);
    f.state = State::kRunnable;
  }
  Block* outer = current_block;
  current_block = this;
  std::vector<int> order(static_cast<size_t>(threads_));
  for (;;) {
    order.clear();
    for (int t = 0; t < threads_; ++t) {
      if (fibers_[static_cast<size_t>(t)].state == State::kRunnable) order.push_back(t);
    }
    if (order.empty()) {
      bool all_done = true;
      for (const Fiber& f : fibers_) all_done &= f.state == State::kDone;
      if (all_done) break;
      if (!release()) {
        std::fprintf(stderr, "cuda_sim: block %u deadlocks: a barrier that not every thread "
                             "reaches (a thread returned, or a warp split at a shuffle)\n",
                     block_index);
        std::abort();
      }
      continue;
    }
    std::shuffle(order.begin(), order.end(), order_rng_);
    for (int t : order) {
      current_ = t;
      threadIdx.x = static_cast<unsigned>(t);
      Fiber& f = fibers_[static_cast<size_t>(t)];
#ifdef CUDA_SIM_ASAN
      void* fake_stack = nullptr;
      __sanitizer_start_switch_fiber(&fake_stack, f.stack.get(), kStackBytes);
      jump(&scheduler_, &f.context);
      __sanitizer_finish_switch_fiber(fake_stack, nullptr, nullptr);
#else
      jump(&scheduler_, &f.context);
#endif
    }
  }
  current_block = outer;
  current_ = -1;
}

inline void run_block(int threads, const std::function<void()>& fn, unsigned block_index) {
  Block block(threads);
  block.run(fn, block_index);
}

// The fibers' stacks of a block size, allocated once for the program.
inline Block& block_of(int threads) {
  static std::vector<std::unique_ptr<Block>> blocks;
  for (auto& b : blocks) {
    if (b->threads() == threads) return *b;
  }
  blocks.push_back(std::make_unique<Block>(threads));
  return *blocks.back();
}

inline void run_grid(unsigned grid, int threads, const std::function<void()>& fn) {
  traffic.next_launch();
  Block& block = block_of(threads);
  for (unsigned b = 0; b < grid; ++b) block.run(fn, b);
}

}  // namespace cuda_sim

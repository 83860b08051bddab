// A host simulation of the CUDA features the block kernels use (cuda/block_ops.cuh), so
// their device code runs and is tested on a machine without a GPU: every simulated thread
// of a block is a std::thread; __syncthreads is a barrier of the block, warp shuffles
// exchange through a buffer between two barriers of the warp. Slow (a barrier costs tens
// of microseconds) and meant for small blocks; it checks logic, not speed or memory
// ordering on a real GPU. The CUB stand-ins are in cub_stand_in.h.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#define __device__
#define __host__
#define __forceinline__ inline

namespace cuda_sim {

// A reusable barrier for a fixed number of threads.
class Barrier {
 public:
  explicit Barrier(int count) : count_(count) {}
  void wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    const uint64_t generation = generation_;
    if (++arrived_ == count_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return;
    }
    cv_.wait(lock, [&] { return generation_ != generation; });
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  const int count_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
};

struct Block {
  explicit Block(int threads)
      : threads(threads), block_barrier(threads), exchange(static_cast<size_t>(threads)) {
    for (int w = 0; w < (threads + 31) / 32; ++w) {
      warp_barriers.emplace_back(new Barrier(std::min(32, threads - 32 * w)));
    }
  }
  ~Block() {
    for (Barrier* b : warp_barriers) delete b;
  }
  int threads;
  Barrier block_barrier;
  std::vector<Barrier*> warp_barriers;
  std::vector<uint64_t> exchange;  // one slot per thread for shuffles
  int or_flag = 0;                 // __syncthreads_or
};

struct Dim3 {
  unsigned x = 0, y = 0, z = 0;
};

inline thread_local Block* current_block = nullptr;

// Runs fn() on `threads` simulated threads of one block; returns when all have finished.
inline void run_block(int threads, const std::function<void()>& fn);

}  // namespace cuda_sim

inline thread_local cuda_sim::Dim3 threadIdx;

inline void __syncthreads() { cuda_sim::current_block->block_barrier.wait(); }

inline int __syncthreads_or(int predicate) {
  cuda_sim::Block* b = cuda_sim::current_block;
  b->block_barrier.wait();  // the previous use of or_flag is over
  if (threadIdx.x == 0) b->or_flag = 0;
  b->block_barrier.wait();
  if (predicate) {
    static std::mutex m;
    std::lock_guard<std::mutex> lock(m);
    b->or_flag = 1;
  }
  b->block_barrier.wait();
  return b->or_flag;
}

template <typename T>
T __shfl_down_sync(unsigned mask, T value, unsigned delta) {
  static_assert(sizeof(T) <= sizeof(uint64_t), "shuffle of a wide type");
  (void)mask;  // every lane takes part in the kernels' shuffles
  cuda_sim::Block* b = cuda_sim::current_block;
  const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const unsigned warp_size = static_cast<unsigned>(std::min(32, b->threads - 32 * static_cast<int>(warp)));
  uint64_t slot = 0;
  std::memcpy(&slot, &value, sizeof(T));
  b->exchange[threadIdx.x] = slot;
  b->warp_barriers[warp]->wait();
  T out = value;  // a lane past the warp's end reads its own value, as on the GPU
  if (lane + delta < warp_size) std::memcpy(&out, &b->exchange[threadIdx.x + delta], sizeof(T));
  b->warp_barriers[warp]->wait();
  return out;
}

inline unsigned long long atomicMin(unsigned long long* address, unsigned long long value) {
  static std::mutex m;
  std::lock_guard<std::mutex> lock(m);
  const unsigned long long old = *address;
  if (value < old) *address = value;
  return old;
}

using std::min;

inline void cuda_sim::run_block(int threads, const std::function<void()>& fn) {
  Block block(threads);
  std::vector<std::thread> pool;
  pool.reserve(static_cast<size_t>(threads));
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&block, &fn, t] {
      current_block = &block;
      threadIdx.x = static_cast<unsigned>(t);
      fn();
    });
  }
  for (auto& th : pool) th.join();
}

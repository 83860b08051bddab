// Stand-ins for the two CUB block classes the kernels use (cub::BlockReduce and
// cub::BlockScan), for the host simulation of cuda_sim.h: the same interface as far as
// the kernels use it. cub/block/block_reduce.cuh and block_scan.cuh, found first on the
// simulation's include path, bring this file in instead of CUB.
#pragma once

#include "cuda_sim.h"

namespace cub {

// One value per thread, exchanged through "shared memory".
template <typename T, int BLOCK>
class BlockExchange {
 public:
  struct TempStorage {
    T values[BLOCK];
  };
  explicit BlockExchange(TempStorage& storage) : s_(storage) {}

 protected:
  TempStorage& s_;
};

template <typename T, int BLOCK>
class BlockReduce : public BlockExchange<T, BLOCK> {
 public:
  using BlockExchange<T, BLOCK>::BlockExchange;
  // The result is valid in thread 0 only, as in CUB.
  template <typename Op>
  T Reduce(T value, Op op) {
    this->s_.values[threadIdx.x] = value;
    __syncthreads();
    if (threadIdx.x != 0) return value;
    T acc = this->s_.values[0];
    for (int t = 1; t < BLOCK; ++t) acc = op(acc, this->s_.values[t]);
    return acc;
  }
  T Sum(T value) {
    return Reduce(value, [](const T& a, const T& b) { return a + b; });
  }
};

template <typename T, int BLOCK>
class BlockScan : public BlockExchange<T, BLOCK> {
 public:
  using BlockExchange<T, BLOCK>::BlockExchange;
  // output: the sum of the inputs of the threads before this one (0 in thread 0);
  // aggregate: the sum of all, in every thread.
  void ExclusiveSum(T input, T& output, T& aggregate) {
    this->s_.values[threadIdx.x] = input;
    __syncthreads();
    T before = T(0), all = T(0);
    for (int t = 0; t < BLOCK; ++t) {
      if (t == static_cast<int>(threadIdx.x)) before = all;
      all = all + this->s_.values[t];
    }
    output = before;
    aggregate = all;
  }
};

}  // namespace cub

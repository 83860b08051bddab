// Slot mapping on the device: one thread per token, a gather through the block table.
// Napkin math: 12 bytes read + 4 written per token; even 1e5 tokens is ~1.6 MB, so
// this kernel is launch-bound and exists to keep the mapping on the GPU next to the
// block tables instead of round-tripping through the host.
#include <cuda_runtime.h>

#include "verispec/slot_mapping.h"

namespace verispec {
namespace {

__global__ void slot_mapping_kernel(const int32_t* __restrict__ block_tables,
                                    int64_t batch, int64_t max_blocks, int64_t row_stride,
                                    const int32_t* __restrict__ row_index,
                                    const int32_t* __restrict__ positions,
                                    int64_t num_tokens, int64_t block_size,
                                    int32_t* __restrict__ out) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= num_tokens) return;
  const int32_t slot = table_slot(block_tables, batch, max_blocks, row_stride, row_index[t],
                                  positions[t], block_size);
  out[t] = slot < 0 ? -1 : slot;
}

}  // namespace

int slot_mapping_cuda(const int32_t* block_tables, int64_t batch, int64_t max_blocks,
                      int64_t row_stride, const int32_t* row_index,
                      const int32_t* positions, int64_t num_tokens, int64_t block_size,
                      int32_t* out, intptr_t stream) {
  if (num_tokens == 0) return static_cast<int>(cudaSuccess);
  constexpr int kThreads = 256;
  const int64_t blocks = (num_tokens + kThreads - 1) / kThreads;
  slot_mapping_kernel<<<static_cast<unsigned>(blocks), kThreads, 0,
                        reinterpret_cast<cudaStream_t>(stream)>>>(
      block_tables, batch, max_blocks, row_stride, row_index, positions, num_tokens,
      block_size, out);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace verispec

// Slot mapping from block tables: the index arithmetic between the allocator's
// block tables and the flat KV pools, as a batched kernel (CPU and CUDA).
//
// Convention (stated once, used everywhere): a slot id is
//   block * block_size + position % block_size,   block = table[row][position / block_size]
// and a negative slot id means padding: nothing is read or written for that token.
#pragma once

#include <cstdint>

#include "verispec/host_device.h"

namespace verispec {

// The slot of the token at `position` whose block (table[row][position / block_size])
// is `block` >= 0.
VERISPEC_HD inline int32_t slot_id(int32_t block, int64_t position, int64_t block_size) {
  return static_cast<int32_t>(static_cast<int64_t>(block) * block_size + position % block_size);
}

// What table_slot returns for a token whose row or block falls outside the table, or
// whose table entry is padding (an error: the token is not padding itself).
constexpr int32_t kSlotOutsideTable = -2;

// The slot of one token through the block tables (layout below): -1 for a padding token
// (row or position < 0), kSlotOutsideTable if it has no block, else slot_id().
VERISPEC_HD inline int32_t table_slot(const int32_t* block_tables, int64_t batch,
                                      int64_t max_blocks, int64_t row_stride, int64_t row,
                                      int64_t position, int64_t block_size) {
  if (row < 0 || position < 0) return -1;
  const int64_t col = position / block_size;
  const int32_t block =
      row < batch && col < max_blocks ? block_tables[row * row_stride + col] : -1;
  return block < 0 ? kSlotOutsideTable : slot_id(block, position, block_size);
}

// block_tables: [batch, max_blocks] int32, row stride `row_stride` (elements);
//               entries < 0 are padding.
// row_index:    [num_tokens] int32, the block-table row of each token (< 0: padding)
// positions:    [num_tokens] int32, the token's position in its sequence (< 0: padding)
// out:          [num_tokens] int32 slot ids.
// Tokens marked as padding get -1. Returns -1 on success, or the index of the first
// non-padding token whose row or position falls outside the table (its out entry is
// -1); every other token is still written.
int64_t slot_mapping_cpu(const int32_t* block_tables, int64_t batch, int64_t max_blocks,
                         int64_t row_stride, const int32_t* row_index,
                         const int32_t* positions, int64_t num_tokens, int64_t block_size,
                         int32_t* out);

// CUDA version of the same mapping; pointers are device memory, `stream` is a
// cudaStream_t passed as an integer (0 = legacy default stream). Out-of-table tokens
// are written as -1 (no error report: checking would synchronise the stream).
// Returns a cudaError_t value (0 = success). Only defined when built with CUDA.
int slot_mapping_cuda(const int32_t* block_tables, int64_t batch, int64_t max_blocks,
                      int64_t row_stride, const int32_t* row_index,
                      const int32_t* positions, int64_t num_tokens, int64_t block_size,
                      int32_t* out, intptr_t stream);

}  // namespace verispec

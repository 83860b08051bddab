#include "verispec/slot_mapping.h"

namespace verispec {

int64_t slot_mapping_cpu(const int32_t* block_tables, int64_t batch, int64_t max_blocks,
                         int64_t row_stride, const int32_t* row_index,
                         const int32_t* positions, int64_t num_tokens, int64_t block_size,
                         int32_t* out) {
  int64_t first_bad = -1;
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t row = row_index[t];
    const int64_t pos = positions[t];
    out[t] = -1;
    if (row < 0 || pos < 0) continue;  // padding
    const int64_t col = pos / block_size;
    const int32_t block = row < batch && col < max_blocks
                              ? block_tables[row * row_stride + col]
                              : -1;
    if (block < 0) {
      if (first_bad < 0) first_bad = t;
      continue;
    }
    out[t] = static_cast<int32_t>(static_cast<int64_t>(block) * block_size +
                                  pos % block_size);
  }
  return first_bad;
}

}  // namespace verispec

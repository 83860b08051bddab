#include "verispec/slot_mapping.h"

namespace verispec {

int64_t slot_mapping_cpu(const int32_t* block_tables, int64_t batch, int64_t max_blocks,
                         int64_t row_stride, const int32_t* row_index,
                         const int32_t* positions, int64_t num_tokens, int64_t block_size,
                         int32_t* out) {
  int64_t first_bad = -1;
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int32_t slot = table_slot(block_tables, batch, max_blocks, row_stride, row_index[t],
                                    positions[t], block_size);
    if (slot == kSlotOutsideTable && first_bad < 0) first_bad = t;
    out[t] = slot < 0 ? -1 : slot;
  }
  return first_bad;
}

}  // namespace verispec

#include "verispec/block_allocator.h"

#include <algorithm>
#include <limits>
#include <string>
#include <unordered_set>

#include "verispec/errors.h"
#include "verispec/slot_mapping.h"

namespace verispec {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

BlockAllocator::BlockAllocator(int64_t num_blocks, int64_t block_size)
    : block_size_(block_size) {
  if (num_blocks <= 0) {
    throw InvalidArgumentError("BlockAllocator: num_blocks must be > 0, got " +
                               std::to_string(num_blocks));
  }
  if (block_size <= 0) {
    throw InvalidArgumentError("BlockAllocator: block_size must be > 0, got " +
                               std::to_string(block_size));
  }
  // Slot ids are int32 (the slot-mapping convention), so the pool must fit.
  constexpr int64_t kMaxSlots = std::numeric_limits<int32_t>::max();
  if (num_blocks > kMaxSlots / block_size) {
    throw InvalidArgumentError(
        "BlockAllocator: num_blocks * block_size must be <= 2^31 - 1 (slot ids are "
        "int32), got " + std::to_string(num_blocks) + " * " +
        std::to_string(block_size));
  }
  refcount_.assign(static_cast<size_t>(num_blocks), 0);
  free_.reserve(static_cast<size_t>(num_blocks));
  // Stack order: block 0 is handed out first.
  for (int64_t b = num_blocks - 1; b >= 0; --b) free_.push_back(static_cast<int32_t>(b));
}

BlockAllocator::Sequence& BlockAllocator::get(int64_t seq) {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) {
    throw UnknownSequenceError("unknown sequence id " + std::to_string(seq));
  }
  return it->second;
}

const BlockAllocator::Sequence& BlockAllocator::get(int64_t seq) const {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) {
    throw UnknownSequenceError("unknown sequence id " + std::to_string(seq));
  }
  return it->second;
}

void BlockAllocator::check_count(const char* op, const char* arg, int64_t n) {
  if (n < 0) {
    throw InvalidArgumentError(std::string(op) + ": " + arg + " must be >= 0, got " +
                               std::to_string(n));
  }
}

int64_t BlockAllocator::add_sequence() {
  int64_t id = next_seq_id_++;
  seqs_.emplace(id, Sequence{});
  return id;
}

int32_t BlockAllocator::take_free_block() {
  // Callers check capacity first, so the free list is never empty here.
  int32_t b = free_.back();
  free_.pop_back();
  refcount_[static_cast<size_t>(b)] = 1;
  return b;
}

void BlockAllocator::release_block(int32_t block) {
  int32_t& rc = refcount_[static_cast<size_t>(block)];
  if (--rc == 0) free_.push_back(block);
}

int64_t BlockAllocator::blocks_needed(int64_t seq, int64_t n) const {
  check_count("append", "n", n);
  const Sequence& s = get(seq);
  if (n == 0) return 0;
  int64_t have = static_cast<int64_t>(s.blocks.size());
  int64_t need = ceil_div(s.length + n, block_size_) - have;
  bool tail_partial = s.length % block_size_ != 0;
  bool tail_shared = tail_partial && refcount_[static_cast<size_t>(s.blocks.back())] > 1;
  return need + (tail_shared ? 1 : 0);
}

void BlockAllocator::make_tail_private(Sequence& s) {
  int64_t used = s.length % block_size_;
  if (used == 0) return;  // full tail: nobody writes into it
  int32_t tail = s.blocks.back();
  if (refcount_[static_cast<size_t>(tail)] == 1) return;
  int32_t fresh = take_free_block();
  --refcount_[static_cast<size_t>(tail)];  // still > 0: another sequence holds it
  s.blocks.back() = fresh;
  pending_copies_.push_back(BlockCopy{tail, fresh, static_cast<int32_t>(used)});
}

void BlockAllocator::grow(Sequence& s, int64_t n, int32_t* slots_out) {
  if (n == 0) return;
  make_tail_private(s);
  int64_t target_blocks = ceil_div(s.length + n, block_size_);
  while (static_cast<int64_t>(s.blocks.size()) < target_blocks) {
    s.blocks.push_back(take_free_block());
  }
  if (slots_out != nullptr) {
    for (int64_t i = 0; i < n; ++i) {
      int64_t pos = s.length + i;
      slots_out[i] = slot_id(s.blocks[static_cast<size_t>(pos / block_size_)], pos, block_size_);
    }
  }
  s.length += n;
}

void BlockAllocator::append(int64_t seq, int64_t n, std::vector<int32_t>* slots) {
  int64_t need = blocks_needed(seq, n);  // validates seq and n
  if (need > num_free_blocks()) {
    throw CacheFullError("append: sequence " + std::to_string(seq) + " needs " +
                         std::to_string(need) + " free blocks for " +
                         std::to_string(n) + " tokens, only " +
                         std::to_string(num_free_blocks()) + " free");
  }
  Sequence& s = get(seq);
  if (slots != nullptr) {
    size_t base = slots->size();
    slots->resize(base + static_cast<size_t>(n));
    grow(s, n, slots->data() + base);
  } else {
    grow(s, n, nullptr);
  }
}

void BlockAllocator::append_batch(const int64_t* seqs, const int64_t* counts,
                                  int64_t batch, int32_t* slot_out,
                                  int64_t slot_out_size) {
  check_count("append_batch", "batch", batch);
  int64_t total_tokens = 0;
  int64_t total_blocks = 0;
  std::unordered_set<int64_t> seen;
  for (int64_t i = 0; i < batch; ++i) {
    if (!seen.insert(seqs[i]).second) {
      throw InvalidArgumentError("append_batch: seqs must be distinct, sequence " +
                                 std::to_string(seqs[i]) + " appears twice");
    }
    total_blocks += blocks_needed(seqs[i], counts[i]);  // validates both
    total_tokens += counts[i];
  }
  if (slot_out != nullptr && total_tokens > slot_out_size) {
    throw InvalidArgumentError("append_batch: slot_mapping must hold sum(counts) = " +
                               std::to_string(total_tokens) + " slots, got " +
                               std::to_string(slot_out_size));
  }
  if (total_blocks > num_free_blocks()) {
    throw CacheFullError("append_batch: needs " + std::to_string(total_blocks) +
                         " free blocks for " + std::to_string(total_tokens) +
                         " tokens, only " + std::to_string(num_free_blocks()) +
                         " free");
  }
  int64_t offset = 0;
  for (int64_t i = 0; i < batch; ++i) {
    grow(get(seqs[i]), counts[i], slot_out == nullptr ? nullptr : slot_out + offset);
    offset += counts[i];
  }
  if (slot_out != nullptr) std::fill(slot_out + offset, slot_out + slot_out_size, -1);
}

void BlockAllocator::rollback(int64_t seq, int64_t new_len) {
  Sequence& s = get(seq);
  if (new_len < 0 || new_len > s.length) {
    throw InvalidArgumentError("rollback: new_len must be in [0, " +
                               std::to_string(s.length) + "] for sequence " +
                               std::to_string(seq) + ", got " + std::to_string(new_len));
  }
  size_t keep = static_cast<size_t>(ceil_div(new_len, block_size_));
  while (s.blocks.size() > keep) {
    release_block(s.blocks.back());
    s.blocks.pop_back();
  }
  s.length = new_len;
}

int64_t BlockAllocator::fork(int64_t seq) {
  Sequence copy = get(seq);  // validates seq before anything changes
  for (int32_t b : copy.blocks) ++refcount_[static_cast<size_t>(b)];
  int64_t id = next_seq_id_++;
  seqs_.emplace(id, std::move(copy));
  return id;
}

void BlockAllocator::free(int64_t seq) {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) {
    throw UnknownSequenceError("free: unknown sequence id " + std::to_string(seq) +
                               " (never added, or already freed)");
  }
  for (auto b = it->second.blocks.rbegin(); b != it->second.blocks.rend(); ++b) {
    release_block(*b);
  }
  seqs_.erase(it);
}

int64_t BlockAllocator::length(int64_t seq) const { return get(seq).length; }

const std::vector<int32_t>& BlockAllocator::block_table(int64_t seq) const {
  return get(seq).blocks;
}

int32_t BlockAllocator::refcount(int64_t block) const {
  if (block < 0 || block >= num_blocks()) {
    throw InvalidArgumentError("refcount: block must be in [0, " +
                               std::to_string(num_blocks()) + "), got " +
                               std::to_string(block));
  }
  return refcount_[static_cast<size_t>(block)];
}

std::vector<int64_t> BlockAllocator::sequence_ids() const {
  std::vector<int64_t> ids;
  ids.reserve(seqs_.size());
  for (const auto& kv : seqs_) ids.push_back(kv.first);
  std::sort(ids.begin(), ids.end());
  return ids;
}

std::vector<BlockCopy> BlockAllocator::take_block_copies() {
  std::vector<BlockCopy> out;
  out.swap(pending_copies_);
  return out;
}

void BlockAllocator::fill_block_tables(const int64_t* seqs, int64_t batch, int32_t* out,
                                       int64_t max_blocks, int64_t row_stride) const {
  // Validate everything before writing, so a bad id leaves the buffer untouched.
  for (int64_t i = 0; i < batch; ++i) {
    int64_t nb = static_cast<int64_t>(get(seqs[i]).blocks.size());
    if (nb > max_blocks) {
      throw InvalidArgumentError(
          "fill_block_tables: block_tables has " + std::to_string(max_blocks) +
          " columns, sequence " + std::to_string(seqs[i]) + " needs " +
          std::to_string(nb));
    }
  }
  for (int64_t i = 0; i < batch; ++i) {
    const auto& blocks = get(seqs[i]).blocks;
    int32_t* row = out + i * row_stride;
    std::copy(blocks.begin(), blocks.end(), row);
    std::fill(row + blocks.size(), row + max_blocks, -1);
  }
}

void BlockAllocator::fill_context_lens(const int64_t* seqs, int64_t batch,
                                       int32_t* out) const {
  for (int64_t i = 0; i < batch; ++i) get(seqs[i]);
  for (int64_t i = 0; i < batch; ++i) {
    out[i] = static_cast<int32_t>(get(seqs[i]).length);
  }
}

void BlockAllocator::fill_slot_mapping(const int64_t* seqs, const int64_t* starts,
                                       const int64_t* counts, int64_t batch,
                                       int32_t* out, int64_t out_size) const {
  int64_t total = 0;
  for (int64_t i = 0; i < batch; ++i) {
    const Sequence& s = get(seqs[i]);
    check_count("fill_slot_mapping", "counts[i]", counts[i]);
    if (starts[i] < 0 || starts[i] + counts[i] > s.length) {
      throw InvalidArgumentError(
          "fill_slot_mapping: positions [" + std::to_string(starts[i]) + ", " +
          std::to_string(starts[i] + counts[i]) + ") of sequence " +
          std::to_string(seqs[i]) + " must lie in [0, " + std::to_string(s.length) +
          ")");
    }
    total += counts[i];
  }
  if (total > out_size) {
    throw InvalidArgumentError("fill_slot_mapping: slot_mapping must hold sum(counts) = " +
                               std::to_string(total) + " slots, got " +
                               std::to_string(out_size));
  }
  int64_t o = 0;
  for (int64_t i = 0; i < batch; ++i) {
    const Sequence& s = get(seqs[i]);
    for (int64_t pos = starts[i]; pos < starts[i] + counts[i]; ++pos) {
      out[o++] = slot_id(s.blocks[static_cast<size_t>(pos / block_size_)], pos, block_size_);
    }
  }
  std::fill(out + o, out + out_size, -1);
}

}  // namespace verispec

// Paged KV-cache block allocator: free list, per-block refcounts, and per sequence
// a block table and a token length. Pure C++: no CUDA, no Python.
//
//   block table of one sequence (block_size = 4, length = 10):
//
//     block:   [ b7 ][ b2 ][ b9 ]
//     slots:    0123  4567  89..        slot id = block * block_size + offset
//               full  full  tail (partly filled, 2 free slots)
//
// Invariants (checked by tests/test_allocator_stateful.py against a Python model):
//  - refcount[b] == number of block-table entries, over all sequences, equal to b;
//    a block is on the free list iff its refcount is 0.
//  - a sequence of length L holds exactly ceil(L / block_size) blocks.
//  - a block is written only by a sequence that owns it alone: before an append
//    writes into a shared tail block, the tail is copied to a fresh block
//    (copy-on-write) and the copy is queued for the caller to perform on the KV
//    tensors (take_block_copies).
//  - every operation either succeeds or throws leaving all state unchanged.
//  - rollback only lowers a length and releases whole trailing blocks: its cost is
//    the number of blocks released, never the length of the sequence.
#pragma once

#include <cstdint>
#include <unordered_map>
#include <utility>
#include <vector>

namespace verispec {

// A copy the caller must perform on every KV pool before writing new slots:
// block `dst` receives the first `num_tokens` slots of block `src`.
struct BlockCopy {
  int32_t src;
  int32_t dst;
  int32_t num_tokens;
};

class BlockAllocator {
 public:
  BlockAllocator(int64_t num_blocks, int64_t block_size);

  int64_t num_blocks() const { return static_cast<int64_t>(refcount_.size()); }
  int64_t block_size() const { return block_size_; }
  int64_t num_free_blocks() const { return static_cast<int64_t>(free_.size()); }
  int64_t num_sequences() const { return static_cast<int64_t>(seqs_.size()); }

  // New empty sequence; ids are never reused.
  int64_t add_sequence();
  // Reserves n more token slots of `seq`; appends their slot ids to *slots if given.
  // Throws CacheFullError (state unchanged) when the pool cannot hold them.
  void append(int64_t seq, int64_t n, std::vector<int32_t>* slots = nullptr);
  // Lowers the length of `seq` to new_len (<= length) and releases trailing blocks.
  void rollback(int64_t seq, int64_t new_len);
  // New sequence sharing all of seq's blocks (refcount + 1 each).
  int64_t fork(int64_t seq);
  // Releases the sequence and its references to blocks.
  void free(int64_t seq);

  int64_t length(int64_t seq) const;
  const std::vector<int32_t>& block_table(int64_t seq) const;
  int32_t refcount(int64_t block) const;
  std::vector<int64_t> sequence_ids() const;

  // Number of blocks that appending n slots to seq would take from the free list
  // (including a copy-on-write of a shared tail). Never throws for valid seq.
  int64_t blocks_needed(int64_t seq, int64_t n) const;

  // Appends counts[i] slots to seqs[i] for all i, atomically: either every
  // sequence grows or (CacheFullError) none does. New slot ids are written in
  // order to slot_out (size sum(counts)). A sequence may appear once only.
  void append_batch(const int64_t* seqs, const int64_t* counts, int64_t batch,
                    int32_t* slot_out, int64_t slot_out_size);

  // Copy-on-write copies queued by append since the last call, oldest first.
  std::vector<BlockCopy> take_block_copies();
  int64_t num_pending_block_copies() const {
    return static_cast<int64_t>(pending_copies_.size());
  }

  // --- batch reads into caller-provided int32 buffers ------------------------
  // block_tables: [batch, max_blocks] row-major with row stride `row_stride`;
  // entries past a sequence's table are -1 (negative means padding everywhere).
  void fill_block_tables(const int64_t* seqs, int64_t batch, int32_t* out,
                         int64_t max_blocks, int64_t row_stride) const;
  // context_lens: [batch]
  void fill_context_lens(const int64_t* seqs, int64_t batch, int32_t* out) const;
  // slot mapping for token positions [starts[i], starts[i] + counts[i]) of seqs[i],
  // concatenated; out has out_size >= sum(counts); the tail is filled with -1.
  void fill_slot_mapping(const int64_t* seqs, const int64_t* starts,
                         const int64_t* counts, int64_t batch, int32_t* out,
                         int64_t out_size) const;

 private:
  struct Sequence {
    std::vector<int32_t> blocks;
    int64_t length = 0;
  };
  Sequence& get(int64_t seq);
  const Sequence& get(int64_t seq) const;
  static void check_count(const char* op, const char* arg, int64_t n);
  int32_t take_free_block();
  void release_block(int32_t block);
  // Makes the partly filled tail block of s exclusively owned (copy-on-write).
  void make_tail_private(Sequence& s);
  void grow(Sequence& s, int64_t n, int32_t* slots_out);

  int64_t block_size_;
  std::vector<int32_t> refcount_;
  std::vector<int32_t> free_;  // stack of free block ids
  std::unordered_map<int64_t, Sequence> seqs_;
  int64_t next_seq_id_ = 0;
  std::vector<BlockCopy> pending_copies_;
};

}  // namespace verispec

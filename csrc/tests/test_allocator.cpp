// Native test of the block allocator, run under AddressSanitizer + UBSan in CI.
// Random interleavings of every operation (including ones that must fail), with the
// allocator's invariants re-derived from scratch after each step.
#include <cstdio>
#include <cstdlib>
#include <map>
#include <random>
#include <vector>

#include "native_check.h"
#include "verispec/block_allocator.h"
#include "verispec/errors.h"
#include "verispec/slot_mapping.h"

namespace {

using verispec::BlockAllocator;

// Refcounts and the free count derived from the block tables alone.
void check_invariants(const BlockAllocator& a) {
  std::vector<int32_t> rc(static_cast<size_t>(a.num_blocks()), 0);
  for (int64_t s : a.sequence_ids()) {
    const auto& t = a.block_table(s);
    const int64_t L = a.length(s);
    CHECK(static_cast<int64_t>(t.size()) == (L + a.block_size() - 1) / a.block_size());
    for (int32_t b : t) {
      CHECK(b >= 0 && b < a.num_blocks());
      ++rc[static_cast<size_t>(b)];
    }
  }
  int64_t used = 0;
  for (int64_t b = 0; b < a.num_blocks(); ++b) {
    CHECK(a.refcount(b) == rc[static_cast<size_t>(b)]);
    used += rc[static_cast<size_t>(b)] > 0;
  }
  CHECK(used + a.num_free_blocks() == a.num_blocks());
}

template <typename E, typename F>
bool throws(F&& f) {
  try {
    f();
  } catch (const E&) {
    return true;
  }
  return false;
}

void test_random_ops(uint32_t seed) {
  std::mt19937 rng(seed);
  BlockAllocator a(64, 4);
  std::vector<int64_t> live;
  auto pick = [&]() { return live[rng() % live.size()]; };
  for (int step = 0; step < 4000; ++step) {
    const int op = static_cast<int>(rng() % 7);
    if (op == 0 || live.empty()) {
      live.push_back(a.add_sequence());
    } else if (op == 1 || op == 2) {
      const int64_t s = pick();
      const int64_t n = rng() % 13;
      const int64_t free_before = a.num_free_blocks();
      const auto table_before = a.block_table(s);
      const int64_t len_before = a.length(s);
      std::vector<int32_t> slots;
      try {
        a.append(s, n, &slots);
        CHECK(static_cast<int64_t>(slots.size()) == n);
        CHECK(a.length(s) == len_before + n);
        for (size_t i = 0; i < slots.size(); ++i) {
          const int64_t pos = len_before + static_cast<int64_t>(i);
          CHECK(slots[i] == a.block_table(s)[static_cast<size_t>(pos / 4)] * 4 + pos % 4);
          CHECK(a.refcount(slots[i] / 4) == 1);  // never write a shared block
        }
      } catch (const verispec::CacheFullError&) {
        CHECK(a.num_free_blocks() == free_before);  // nothing changed
        CHECK(a.block_table(s) == table_before);
        CHECK(a.length(s) == len_before);
      }
    } else if (op == 3) {
      const int64_t s = pick();
      a.rollback(s, a.length(s) == 0 ? 0 : static_cast<int64_t>(rng() % (a.length(s) + 1)));
    } else if (op == 4) {
      live.push_back(a.fork(pick()));
    } else if (op == 5) {
      const size_t i = rng() % live.size();
      a.free(live[i]);
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
    } else {
      a.take_block_copies();
    }
    check_invariants(a);
  }
  for (int64_t s : live) a.free(s);
  CHECK(a.num_free_blocks() == a.num_blocks());
}

void test_errors() {
  CHECK(throws<verispec::InvalidArgumentError>([] { BlockAllocator(0, 4); }));
  CHECK(throws<verispec::InvalidArgumentError>([] { BlockAllocator(4, -1); }));
  CHECK(throws<verispec::InvalidArgumentError>([] { BlockAllocator(1 << 20, 1 << 12); }));
  BlockAllocator a(4, 4);
  const int64_t s = a.add_sequence();
  CHECK(throws<verispec::InvalidArgumentError>([&] { a.append(s, -1); }));
  CHECK(throws<verispec::UnknownSequenceError>([&] { a.append(s + 7, 1); }));
  a.append(s, 5);
  CHECK(throws<verispec::InvalidArgumentError>([&] { a.rollback(s, 6); }));
  CHECK(throws<verispec::InvalidArgumentError>([&] { a.rollback(s, -1); }));
  CHECK(throws<verispec::CacheFullError>([&] { a.append(s, 12); }));
  CHECK(a.length(s) == 5 && a.num_free_blocks() == 2);
  a.free(s);
  CHECK(throws<verispec::UnknownSequenceError>([&] { a.free(s); }));
  CHECK(throws<verispec::InvalidArgumentError>([&] { a.refcount(4); }));
}

void test_copy_on_write() {
  BlockAllocator a(8, 4);
  const int64_t p = a.add_sequence();
  a.append(p, 6);  // one full block + a tail with 2 tokens
  const int64_t c = a.fork(p);
  CHECK(a.block_table(c) == a.block_table(p));
  CHECK(a.blocks_needed(c, 1) == 1);  // the shared tail must be copied first
  std::vector<int32_t> slots;
  a.append(c, 1, &slots);
  const auto copies = a.take_block_copies();
  CHECK(copies.size() == 1);
  CHECK(copies[0].src == a.block_table(p)[1] && copies[0].dst == a.block_table(c)[1]);
  CHECK(copies[0].num_tokens == 2);
  CHECK(slots[0] == a.block_table(c)[1] * 4 + 2);
  CHECK(a.block_table(c)[0] == a.block_table(p)[0]);  // full block still shared
  // A rollback into the shared full block makes it a shared tail: copy again.
  a.rollback(p, 3);
  a.append(p, 1);
  CHECK(a.take_block_copies().size() == 1);
  check_invariants(a);
}

void test_batch_fills() {
  BlockAllocator a(16, 4);
  const int64_t s0 = a.add_sequence(), s1 = a.add_sequence();
  const int64_t seqs[2] = {s0, s1};
  const int64_t counts[2] = {5, 2};
  int32_t slots[9];
  a.append_batch(seqs, counts, 2, slots, 9);
  CHECK(slots[7] == -1 && slots[8] == -1);
  int32_t tables[2 * 3];
  a.fill_block_tables(seqs, 2, tables, 3, 3);
  CHECK(tables[0] == a.block_table(s0)[0] && tables[2] == -1 && tables[4] == -1);
  int32_t lens[2];
  a.fill_context_lens(seqs, 2, lens);
  CHECK(lens[0] == 5 && lens[1] == 2);
  const int64_t starts[2] = {3, 0};
  const int64_t cnt[2] = {2, 2};
  int32_t mapping[5];
  a.fill_slot_mapping(seqs, starts, cnt, 2, mapping, 5);
  for (int i = 0; i < 4; ++i) {
    const int64_t pos = i < 2 ? 3 + i : i - 2;
    CHECK(mapping[i] == (i < 2 ? slots[3 + i] : slots[5 + (i - 2)]));
    (void)pos;
  }
  CHECK(mapping[4] == -1);
  // The kernel form computes the same mapping from the filled tables.
  const int32_t rows[5] = {0, 0, 1, 1, -1};
  const int32_t positions[5] = {3, 4, 0, 1, 0};
  int32_t out[5];
  CHECK(verispec::slot_mapping_cpu(tables, 2, 3, 3, rows, positions, 5, 4, out) == -1);
  for (int i = 0; i < 5; ++i) CHECK(out[i] == mapping[i]);
  const int32_t bad_pos[1] = {12};
  CHECK(verispec::slot_mapping_cpu(tables, 2, 3, 3, rows, bad_pos, 1, 4, out) == 0);
  // Atomicity of the batch: one sequence too many and nobody grows.
  const int64_t big[2] = {1, 60};
  CHECK(throws<verispec::CacheFullError>([&] { a.append_batch(seqs, big, 2, nullptr, 0); }));
  CHECK(a.length(s0) == 5 && a.length(s1) == 2);
  const int64_t dup[2] = {s0, s0};
  CHECK(throws<verispec::InvalidArgumentError>([&] { a.append_batch(dup, counts, 2, nullptr, 0); }));
}

}  // namespace

int main() {
  test_errors();
  test_copy_on_write();
  test_batch_fills();
  for (uint32_t seed = 0; seed < 8; ++seed) test_random_ops(seed);
  return native_check::check_summary("test_allocator");
}

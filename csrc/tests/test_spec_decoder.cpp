// Native test of verispec::SpecDecoder, run under AddressSanitizer + UBSan in CI. The
// test is the caller: it drives begin_step / commit / cancel_step the way
// python/verispec/decoder.py does, with a tiny deterministic fake "model + verify" in
// plain C++. The fake models keep paged KV pools of (token, position) entries: a pass
// writes each input at its slot, and each logits row reads its whole prefix back
// through the block table and checks it against the tokens the row must see, so a
// wrong slot, block table, context length or a stale cache entry is caught. Expected
// values come from the header's documented rules and a plain greedy loop, never from
// the code under test.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "native_check.h"
#include "ngram_reference.h"
#include "verispec/errors.h"
#include "verispec/spec_decoder.h"

namespace {

using verispec::CacheFullError;
using verispec::DecoderConfig;
using verispec::FinishReason;
using verispec::InvalidArgumentError;
using verispec::ModelRole;
using verispec::PassLayout;
using verispec::SamplingParams;
using verispec::SequenceStats;
using verispec::SpecDecoder;
using verispec::StepInProgressError;
using verispec::StepPlan;
using verispec::StepTimes;
using verispec::StopParams;
using verispec::UnknownSequenceError;
using verispec::VerifyOutputs;
using Tokens = std::vector<int32_t>;

constexpr int32_t kV = 13;

using native_check::error_of;
using native_check::has;

// ---- the fake models ----------------------------------------------------------------

// The target's greedy next token after `last` at position `pos`: x -> 5x + 1 (mod 13)
// cycles 0 1 6 5 (n-gram lookup finds it), broken every 7th position.
int32_t target_next(int32_t last, int64_t pos) {
  return static_cast<int32_t>((5 * last + 1 + (pos % 7 == 3 ? 2 : 0)) % kV);
}
// The draft agrees with the target except at positions 2 (mod 5).
int32_t draft_next(int32_t last, int64_t pos) {
  const int32_t t = target_next(last, pos);
  return pos % 5 == 2 ? (t + 1) % kV : t;
}

struct Ref {
  Tokens gen;
  FinishReason reason = FinishReason::kNone;
};

// The plain greedy loop with the documented stop rules.
Ref greedy_reference(const Tokens& prompt, const StopParams& stop, int64_t max_context) {
  Tokens t = prompt;
  Ref r;
  for (;;) {
    const int32_t nx = target_next(t.back(), static_cast<int64_t>(t.size()) - 1);
    t.push_back(nx);
    r.gen.push_back(nx);
    if (std::find(stop.eos_ids.begin(), stop.eos_ids.end(), nx) != stop.eos_ids.end()) {
      r.reason = FinishReason::kEos;
      return r;
    }
    for (const Tokens& s : stop.stop_sequences) {
      if (r.gen.size() >= s.size() && std::equal(s.begin(), s.end(), r.gen.end() - static_cast<std::ptrdiff_t>(s.size()))) {
        r.reason = FinishReason::kStop;
        return r;
      }
    }
    if (static_cast<int64_t>(r.gen.size()) >= stop.max_new_tokens) {
      r.reason = FinishReason::kLength;
      return r;
    }
    if (static_cast<int64_t>(t.size()) >= max_context) {
      r.reason = FinishReason::kContext;
      return r;
    }
  }
}

using verispec_test::brute_propose;

// A paged KV pool of the fake model: (token, position) per slot.
struct FakeCache {
  int64_t bs;
  std::vector<int32_t> tok;
  std::vector<int64_t> pos;
  FakeCache(int64_t num_blocks, int64_t block_size)
      : bs(block_size),
        tok(static_cast<size_t>(num_blocks * block_size), -1),
        pos(static_cast<size_t>(num_blocks * block_size), -1) {}
  int64_t size() const { return static_cast<int64_t>(tok.size()); }
};

struct World {
  FakeCache target;
  std::unique_ptr<FakeCache> own_draft;
  FakeCache* draft;
  explicit World(const DecoderConfig& c)
      : target(c.target_num_blocks, c.block_size),
        own_draft(c.has_draft_model && !c.draft_shares_target_cache
                      ? std::make_unique<FakeCache>(c.draft_num_blocks, c.block_size)
                      : nullptr),
        draft(own_draft ? own_draft.get() : &target) {}
};

// Reads n values of T at byte offset `off` of the plan's buffer (memcpy, as a caller).
template <typename T>
std::vector<T> read(const StepPlan& plan, int64_t off, int64_t n) {
  const bool ok = off >= 0 && n >= 0 && off % 8 == 0 &&
                  static_cast<size_t>(off) + static_cast<size_t>(n) * sizeof(T) <= plan.inputs.size();
  CHECK(ok);
  std::vector<T> v(static_cast<size_t>(std::max<int64_t>(n, 0)), T(-7));
  if (ok && n > 0) std::memcpy(v.data(), plan.inputs.data() + off, static_cast<size_t>(n) * sizeof(T));
  return v;
}

// One pass's arrays, read out of the plan.
struct PassView {
  ModelRole role;
  int64_t B, T, M, R, P;
  std::vector<int64_t> ids, pos, qs, li, rows, draft_index, prev_index, fill_pos, fill_src;
  std::vector<int32_t> slots, bt, ctx;
};

PassView view_pass(const StepPlan& plan, size_t j) {
  const PassLayout& l = plan.passes[j];
  PassView p;
  p.role = l.role;
  p.B = l.num_rows;
  p.T = l.num_tokens;
  p.M = l.max_blocks;
  p.R = l.num_logits;
  p.P = l.num_fill;
  const bool draft = l.role == ModelRole::kDraft;
  p.ids = read<int64_t>(plan, l.input_ids, p.T);
  p.pos = read<int64_t>(plan, l.positions, p.T);
  p.qs = read<int64_t>(plan, l.query_start, p.B + 1);
  p.li = read<int64_t>(plan, l.logits_indices, p.R);
  p.rows = read<int64_t>(plan, l.rows, p.B);
  p.draft_index = read<int64_t>(plan, l.draft_index, draft ? p.B : 0);
  p.prev_index = read<int64_t>(plan, l.prev_index, draft && j > 0 ? p.B : 0);
  p.fill_pos = read<int64_t>(plan, l.fill_positions, p.P);
  p.fill_src = read<int64_t>(plan, l.fill_sources, p.P);
  p.slots = read<int32_t>(plan, l.slot_mapping, p.T);
  p.bt = read<int32_t>(plan, l.block_tables, p.B * p.M);
  p.ctx = read<int32_t>(plan, l.context_lens, p.B);
  return p;
}

// Runs a pass on `c`: writes every input (token, position) at its slot, then for each
// logits row reads the row's prefix back through its block table, compares it with
// expect[row] and returns fn(last token read, position). Returns one token per logits row.
Tokens forward(FakeCache& c, const PassView& p, const std::vector<int64_t>& ids,
               const std::vector<Tokens>& expect, int32_t (*fn)(int32_t, int64_t)) {
  bool slots_ok = true, prefix_ok = true;
  auto slot_of = [&](int64_t row, int64_t pos) -> int64_t {
    const int64_t bi = pos / c.bs;
    if (bi < 0 || bi >= p.M) return -1;
    const int32_t blk = p.bt[static_cast<size_t>(row * p.M + bi)];
    if (blk < 0) return -1;
    const int64_t s = blk * c.bs + pos % c.bs;
    return s < c.size() ? s : -1;
  };
  for (int64_t r = 0; r < p.B; ++r) {
    for (int64_t t = p.qs[static_cast<size_t>(r)]; t < p.qs[static_cast<size_t>(r + 1)]; ++t) {
      const int64_t s = slot_of(r, p.pos[static_cast<size_t>(t)]);
      if (s < 0 || s != p.slots[static_cast<size_t>(t)] || ids[static_cast<size_t>(t)] < 0) {
        slots_ok = false;
        continue;
      }
      c.tok[static_cast<size_t>(s)] = static_cast<int32_t>(ids[static_cast<size_t>(t)]);
      c.pos[static_cast<size_t>(s)] = p.pos[static_cast<size_t>(t)];
    }
  }
  Tokens out;
  for (int64_t i = 0; i < p.R; ++i) {
    const int64_t t = p.li[static_cast<size_t>(i)];
    int64_t r = 0;
    while (r < p.B && !(p.qs[static_cast<size_t>(r)] <= t && t < p.qs[static_cast<size_t>(r + 1)])) ++r;
    if (r == p.B) {
      slots_ok = false;
      out.push_back(0);
      continue;
    }
    const int64_t pos = p.pos[static_cast<size_t>(t)];
    const Tokens& want = expect[static_cast<size_t>(r)];
    if (pos >= p.ctx[static_cast<size_t>(r)] || pos >= static_cast<int64_t>(want.size())) prefix_ok = false;
    int32_t last = 0;
    for (int64_t q = 0; q <= pos && prefix_ok; ++q) {
      const int64_t s = slot_of(r, q);
      if (s < 0 || c.pos[static_cast<size_t>(s)] != q || c.tok[static_cast<size_t>(s)] != want[static_cast<size_t>(q)]) {
        prefix_ok = false;
        break;
      }
      last = c.tok[static_cast<size_t>(s)];
    }
    out.push_back(fn(last, pos));
  }
  CHECK(slots_ok);
  CHECK(prefix_ok);
  return out;
}

// What the caller hands to commit.
struct Outputs {
  Tokens tokens, emitted, accepted, drafts;
  bool pass_drafts = false;
  StepTimes times;
  VerifyOutputs view() const {
    VerifyOutputs o;
    o.tokens = tokens.data();
    o.tokens_len = static_cast<int64_t>(tokens.size());
    o.num_emitted = emitted.data();
    o.num_emitted_len = static_cast<int64_t>(emitted.size());
    o.num_accepted = accepted.data();
    o.num_accepted_len = static_cast<int64_t>(accepted.size());
    if (pass_drafts) {
      o.draft_tokens = drafts.data();
      o.draft_tokens_len = static_cast<int64_t>(drafts.size());
    }
    return o;
  }
};

// The caller's step body: draft passes, the verify pass, greedy verify. `ngram_drafts`
// passes the n-gram proposals back as draft_tokens too (the API allows it).
// The time a draft pass reports (s); a target pass reports about 0.01 s. A dear draft
// makes adaptive k choose k = 0 and probe now and then.
double g_draft_pass_s = 0.001;

Outputs run_models(const SpecDecoder& dec, World& w, const StepPlan& plan, bool ngram_drafts = false) {
  const int64_t B = plan.batch, K = plan.k;
  Outputs o;
  CHECK(!plan.passes.empty() && (B > 0 || !plan.prefill_seqs.empty()));
  if (plan.passes.empty()) return o;
  std::vector<Tokens> seen(static_cast<size_t>(B));  // committed ++ proposals so far
  for (int64_t b = 0; b < B; ++b) seen[static_cast<size_t>(b)] = dec.committed(plan.seqs[static_cast<size_t>(b)]);
  Tokens drafts = read<int32_t>(plan, plan.draft_tokens, B * K);
  const size_t nd = plan.passes.size() - 1;
  Tokens previous;
  for (size_t j = 0; j < nd; ++j) {
    const PassView p = view_pass(plan, j);
    std::vector<int64_t> ids = p.ids;
    if (j > 0) {  // each row's input: its proposal of the previous pass
      for (int64_t i = 0; i < p.B; ++i) {
        const int64_t at = p.prev_index[static_cast<size_t>(i)];
        const bool ok = at >= 0 && at < static_cast<int64_t>(previous.size());
        CHECK(ok);
        ids[static_cast<size_t>(i)] = ok ? previous[static_cast<size_t>(at)] : 0;
      }
    }
    std::vector<Tokens> expect;
    for (int64_t i = 0; i < p.B; ++i) expect.push_back(seen[static_cast<size_t>(p.rows[static_cast<size_t>(i)])]);
    previous = forward(*w.draft, p, ids, expect, draft_next);
    for (int64_t i = 0; i < p.B; ++i) {
      const int64_t at = p.draft_index[static_cast<size_t>(i)];
      const bool ok = at >= 0 && at < B * K;
      CHECK(ok);
      if (!ok) continue;
      drafts[static_cast<size_t>(at)] = previous[static_cast<size_t>(i)];
      seen[static_cast<size_t>(p.rows[static_cast<size_t>(i)])].push_back(previous[static_cast<size_t>(i)]);
    }
    o.times.draft_forward.push_back(g_draft_pass_s * static_cast<double>(j + 1));
    o.times.draft_sample.push_back(0.0002);
  }
  const PassView v = view_pass(plan, nd);
  std::vector<int64_t> ids = v.ids;
  for (int64_t f = 0; f < v.P; ++f) {
    const int64_t at = v.fill_pos[static_cast<size_t>(f)], src = v.fill_src[static_cast<size_t>(f)];
    const bool ok = at >= 0 && at < v.T && src >= 0 && src < B * K;
    CHECK(ok);
    if (ok) ids[static_cast<size_t>(at)] = drafts[static_cast<size_t>(src)];
  }
  for (int64_t b = 0; b < B; ++b) {  // n-gram: the proposals are in the plan already
    Tokens& s = seen[static_cast<size_t>(b)];
    if (!plan.draft_model) {
      for (int32_t j = 0; j < plan.row_k[static_cast<size_t>(b)]; ++j) s.push_back(drafts[static_cast<size_t>(b * K + j)]);
    }
  }
  // prefill rows (after the verify rows) see their committed tokens
  for (int64_t seq : plan.prefill_seqs) seen.push_back(dec.committed(seq));
  const Tokens argmax = forward(w.target, v, ids, seen, target_next);
  CHECK(static_cast<int64_t>(argmax.size()) == std::max<int64_t>(B * (K + 1), 1));
  o.tokens.assign(static_cast<size_t>(B * (K + 1)), 0);
  for (int64_t b = 0; b < B && static_cast<int64_t>(argmax.size()) == B * (K + 1); ++b) {
    const int64_t kb = plan.row_k[static_cast<size_t>(b)];
    int32_t a = 0;
    while (a < kb && drafts[static_cast<size_t>(b * K + a)] == argmax[static_cast<size_t>(b * (K + 1) + a)]) ++a;
    for (int64_t i = 0; i <= K; ++i) {
      o.tokens[static_cast<size_t>(b * (K + 1) + i)] =
          i < a ? drafts[static_cast<size_t>(b * K + i)] : argmax[static_cast<size_t>(b * (K + 1) + i)];
    }
    o.accepted.push_back(a);
    o.emitted.push_back(a + 1);
  }
  o.drafts = drafts;
  o.pass_drafts = plan.draft_model || (ngram_drafts && K > 0);
  o.times.target_forward = 0.01 + 0.001 * static_cast<double>(K);
  o.times.verify = 0.002;
  o.times.total = 0.02 + 0.002 * static_cast<double>(K);
  return o;
}

// ---- snapshots -------------------------------------------------------------------

bool same_stats(const SequenceStats& a, const SequenceStats& b) {
  return a.steps == b.steps && a.draft_forwards == b.draft_forwards && a.proposed == b.proposed &&
         a.accepted == b.accepted && a.emitted == b.emitted && a.proposed_at == b.proposed_at &&
         a.accepted_at == b.accepted_at && a.k_history == b.k_history &&
         a.acceptance_estimate == b.acceptance_estimate;
}

struct SeqSnap {
  Tokens committed;
  int64_t lt = 0, ld = 0;
  FinishReason finish = FinishReason::kNone;
  std::vector<int32_t> bt_t, bt_d;
  SequenceStats stats;
};

struct Snap {
  std::map<int64_t, SeqSnap> seqs;
  int64_t free_t = 0, free_d = 0, running = 0, num_seqs = 0, steps = 0;
  uint64_t offset = 0;
  bool open = false;
};

Snap snapshot(const SpecDecoder& dec, const std::vector<int64_t>& ids) {
  Snap s;
  const bool draft = dec.config().has_draft_model;
  for (int64_t id : ids) {
    SeqSnap q;
    q.committed = dec.committed(id);
    q.lt = dec.cache_len(id, ModelRole::kTarget);
    q.ld = dec.cache_len(id, ModelRole::kDraft);
    q.finish = dec.finish_reason(id);
    q.bt_t = dec.block_table(id, ModelRole::kTarget);
    if (draft) q.bt_d = dec.block_table(id, ModelRole::kDraft);
    q.stats = dec.stats(id);
    s.seqs[id] = q;
  }
  s.free_t = dec.num_free_blocks(ModelRole::kTarget);
  s.free_d = draft ? dec.num_free_blocks(ModelRole::kDraft) : 0;
  s.running = dec.num_running();
  s.num_seqs = dec.num_sequences();
  s.steps = dec.times().steps;
  s.offset = dec.offset();
  s.open = dec.step_open();
  return s;
}

// Equal state; `blocks`: the same block ids too (else only as many).
bool same(const Snap& a, const Snap& b, bool blocks) {
  if (a.seqs.size() != b.seqs.size()) return false;
  for (const auto& [id, x] : a.seqs) {
    auto it = b.seqs.find(id);
    if (it == b.seqs.end()) return false;
    const SeqSnap& y = it->second;
    if (x.committed != y.committed || x.lt != y.lt || x.ld != y.ld || x.finish != y.finish ||
        !same_stats(x.stats, y.stats)) {
      return false;
    }
    if (blocks ? (x.bt_t != y.bt_t || x.bt_d != y.bt_d)
               : (x.bt_t.size() != y.bt_t.size() || x.bt_d.size() != y.bt_d.size())) {
      return false;
    }
  }
  return a.free_t == b.free_t && a.free_d == b.free_d && a.running == b.running &&
         a.num_seqs == b.num_seqs && a.steps == b.steps && a.offset == b.offset && a.open == b.open;
}

// ---- the plan, checked against the documented layout ----------------------------

struct Pre {  // a row's state before begin_step
  Tokens committed;
  int64_t lt = 0, ld = 0, max_new = 0, prompt_len = 0;
};

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Checks every pass's arrays against the rows' state before the step. `order` is the
// expected row order; k is checked exactly unless the decoder chooses it adaptively.
void check_plan(const SpecDecoder& dec, const StepPlan& plan, const std::vector<int64_t>& order,
                const std::map<int64_t, Pre>& pre) {
  const DecoderConfig& c = dec.config();
  const int64_t B = plan.batch, K = plan.k, bs = c.block_size;
  CHECK(plan.seqs == order);
  CHECK(static_cast<int64_t>(plan.row_k.size()) == B);
  CHECK(plan.step_id != 0);
  CHECK(plan.offset == dec.offset());
  CHECK(plan.seed == c.seed);
  CHECK(plan.target_copies.empty() && plan.draft_copies.empty());
  CHECK(plan.inputs.size() % 8 == 0);
  if (static_cast<int64_t>(plan.row_k.size()) != B || static_cast<int64_t>(plan.seqs.size()) != B) return;
  int64_t maxk = 0;
  std::vector<Tokens> ngram(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) {
    const Pre& r = pre.at(plan.seqs[static_cast<size_t>(b)]);
    const int64_t C = static_cast<int64_t>(r.committed.size());
    const int64_t kb = plan.row_k[static_cast<size_t>(b)];
    maxk = std::max(maxk, kb);
    // The cap: never propose what could not be emitted or cached.
    int64_t cap = std::max<int64_t>(0, std::min({c.k, r.max_new - (C - r.prompt_len) - 1, c.max_context - C - 1}));
    if (c.has_draft_model) {
      const int64_t dmc = c.draft_max_context > 0 ? c.draft_max_context : c.max_context;
      cap = dmc - C < 1 ? 0 : std::min(cap, dmc - C + 1);
    }
    if (c.ngram_min_n > 0) {
      ngram[static_cast<size_t>(b)] = brute_propose(r.committed, c.ngram_min_n, c.ngram_max_n, cap);
      cap = static_cast<int64_t>(ngram[static_cast<size_t>(b)].size());
    }
    CHECK(c.adaptive_k ? (kb >= 0 && kb <= cap) : kb == cap);
  }
  CHECK(K == maxk);
  CHECK(plan.draft_model == (c.has_draft_model && K > 0));
  CHECK(read<int32_t>(plan, plan.num_draft, B) == plan.row_k);
  const Tokens drafts = read<int32_t>(plan, plan.draft_tokens, B * K);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t kb = plan.row_k[static_cast<size_t>(b)];
    for (int64_t j = 0; j < K; ++j) {
      const int32_t want = j < kb && c.ngram_min_n > 0 ? ngram[static_cast<size_t>(b)][static_cast<size_t>(j)] : -1;
      CHECK(drafts[static_cast<size_t>(b * K + j)] == want);
    }
  }
  const size_t nd = c.has_draft_model ? static_cast<size_t>(K) : 0;
  CHECK(plan.passes.size() == nd + 1);
  if (plan.passes.size() != nd + 1) return;

  // Generic layout of a pass: query starts, positions contiguous and ending at the
  // context length, block tables, slots, distinct blocks across rows.
  auto check_layout = [&](const PassView& p, int64_t num_blocks) {
    CHECK(p.qs.front() == 0 && p.qs.back() == p.T);
    bool ok = true;
    int64_t want_m = 1;
    std::vector<int32_t> blocks;
    for (int64_t i = 0; i < p.B; ++i) {
      const int64_t q0 = p.qs[static_cast<size_t>(i)], q1 = p.qs[static_cast<size_t>(i + 1)];
      const int64_t ctx = p.ctx[static_cast<size_t>(i)];
      ok = ok && q1 > q0 && p.pos[static_cast<size_t>(q1 - 1)] == ctx - 1;
      for (int64_t t = q0 + 1; t < q1 && ok; ++t) ok = p.pos[static_cast<size_t>(t)] == p.pos[static_cast<size_t>(t - 1)] + 1;
      const int64_t nb = ceil_div(ctx, bs);
      want_m = std::max(want_m, nb);
      for (int64_t m = 0; m < p.M && ok; ++m) {
        const int32_t blk = p.bt[static_cast<size_t>(i * p.M + m)];
        ok = m < nb ? (blk >= 0 && blk < num_blocks) : blk == -1;
        if (m < nb) blocks.push_back(blk);
      }
      for (int64_t t = q0; t < q1 && ok; ++t) {
        const int64_t pos = p.pos[static_cast<size_t>(t)];
        ok = pos / bs < p.M && p.slots[static_cast<size_t>(t)] ==
                                   p.bt[static_cast<size_t>(i * p.M + pos / bs)] * bs + pos % bs;
      }
    }
    CHECK(ok);
    CHECK(p.M == want_m);
    std::sort(blocks.begin(), blocks.end());
    CHECK(std::adjacent_find(blocks.begin(), blocks.end()) == blocks.end());
  };

  std::vector<int64_t> prev_rows;
  for (size_t j = 0; j < nd; ++j) {
    const PassView p = view_pass(plan, j);
    CHECK(p.role == ModelRole::kDraft);
    std::vector<int64_t> rows;
    for (int64_t b = 0; b < B; ++b) {
      if (plan.row_k[static_cast<size_t>(b)] > static_cast<int64_t>(j)) rows.push_back(b);
    }
    CHECK(p.rows == rows);
    CHECK(p.R == p.B && p.P == 0);
    if (p.rows != rows) continue;
    bool ok = true;
    for (int64_t i = 0; i < p.B; ++i) {
      const int64_t b = rows[static_cast<size_t>(i)];
      const Pre& r = pre.at(plan.seqs[static_cast<size_t>(b)]);
      const int64_t C = static_cast<int64_t>(r.committed.size());
      const int64_t q0 = p.qs[static_cast<size_t>(i)], q1 = p.qs[static_cast<size_t>(i + 1)];
      ok = ok && p.li[static_cast<size_t>(i)] == q1 - 1;
      ok = ok && p.draft_index[static_cast<size_t>(i)] == b * K + static_cast<int64_t>(j);
      if (j == 0) {  // catch up: committed[Ld:C]
        ok = ok && r.ld < C && q1 - q0 == C - r.ld && p.ctx[static_cast<size_t>(i)] == C;
        for (int64_t t = q0; t < q1 && ok; ++t) {
          ok = p.pos[static_cast<size_t>(t)] == r.ld + t - q0 &&
               p.ids[static_cast<size_t>(t)] == r.committed[static_cast<size_t>(r.ld + t - q0)];
        }
      } else {  // the previous proposal, at C + j - 1
        const auto at = std::find(prev_rows.begin(), prev_rows.end(), b) - prev_rows.begin();
        ok = ok && q1 - q0 == 1 && p.ids[static_cast<size_t>(q0)] == -1 &&
             p.pos[static_cast<size_t>(q0)] == C + static_cast<int64_t>(j) - 1 &&
             p.ctx[static_cast<size_t>(i)] == C + static_cast<int64_t>(j) &&
             p.prev_index[static_cast<size_t>(i)] == at;
      }
    }
    CHECK(ok);
    check_layout(p, c.draft_shares_target_cache ? c.target_num_blocks : c.draft_num_blocks);
    prev_rows = rows;
  }

  const PassView v = view_pass(plan, nd);
  CHECK(v.role == ModelRole::kTarget);
  CHECK(v.B == B && v.R == B * (K + 1));
  if (v.B != B || v.R != B * (K + 1)) return;
  std::vector<int64_t> all(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) all[static_cast<size_t>(b)] = b;
  CHECK(v.rows == all);
  std::vector<int64_t> fill_pos, fill_src;
  bool ok = true;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t seq = plan.seqs[static_cast<size_t>(b)];
    const Pre& r = pre.at(seq);
    const int64_t C = static_cast<int64_t>(r.committed.size());
    const int64_t kb = plan.row_k[static_cast<size_t>(b)];
    const int64_t q0 = v.qs[static_cast<size_t>(b)], q1 = v.qs[static_cast<size_t>(b + 1)];
    ok = ok && r.lt < C && q1 - q0 == C - r.lt + kb && v.ctx[static_cast<size_t>(b)] == C + kb;
    for (int64_t t = q0; t < q1 && ok; ++t) {
      const int64_t pos = r.lt + t - q0;
      ok = v.pos[static_cast<size_t>(t)] == pos;
      if (pos < C) {
        ok = ok && v.ids[static_cast<size_t>(t)] == r.committed[static_cast<size_t>(pos)];
      } else if (c.has_draft_model) {
        ok = ok && v.ids[static_cast<size_t>(t)] == -1;
        fill_pos.push_back(t);
        fill_src.push_back(b * K + pos - C);
      } else {
        ok = ok && v.ids[static_cast<size_t>(t)] == ngram[static_cast<size_t>(b)][static_cast<size_t>(pos - C)];
      }
    }
    // logits rows [B, K + 1]: the row's last kb + 1 inputs, padded with the last
    for (int64_t i = 0; i <= K && ok; ++i) {
      ok = v.li[static_cast<size_t>(b * (K + 1) + i)] == q1 - 1 - kb + std::min(i, kb);
    }
    // after begin_step the caches hold what the passes wrote
    ok = ok && dec.cache_len(seq, ModelRole::kTarget) == C + kb;
    ok = ok && dec.block_table(seq, ModelRole::kTarget) ==
                   std::vector<int32_t>(v.bt.begin() + b * v.M, v.bt.begin() + b * v.M + ceil_div(C + kb, bs));
    if (c.has_draft_model && !c.draft_shares_target_cache) {
      ok = ok && dec.cache_len(seq, ModelRole::kDraft) == (kb > 0 ? C + kb - 1 : r.ld);
    }
  }
  CHECK(ok);
  CHECK(v.fill_pos == fill_pos && v.fill_src == fill_src);
  check_layout(v, c.target_num_blocks);
}

// ---- one step as the reference caller, with its checks ----------------------------

struct Tracker {  // per sequence, what the test expects the stats to say
  Tokens prompt;
  StopParams stop;
  int64_t steps = 0, proposed = 0, accepted = 0;
  std::vector<int32_t> k_history;
  bool finished = false;
};

// One step of the running sequences `order`; checks the plan, the commit outputs and
// the cache algebra. Returns false when nothing ran.
bool checked_step(SpecDecoder& dec, World& w, std::vector<int64_t>& order, std::map<int64_t, Tracker>& tr,
                  bool ngram_drafts = false, bool may_preempt = false) {
  std::map<int64_t, Pre> pre;
  for (int64_t id : order) {
    Pre p;
    p.committed = dec.committed(id);
    p.lt = dec.cache_len(id, ModelRole::kTarget);
    p.ld = dec.cache_len(id, ModelRole::kDraft);
    p.max_new = tr[id].stop.max_new_tokens;
    p.prompt_len = static_cast<int64_t>(tr[id].prompt.size());
    pre[id] = p;
  }
  const uint64_t offset = dec.offset();
  const StepPlan plan = dec.begin_step();
  if (order.empty()) {
    CHECK(plan.batch == 0 && plan.passes.empty() && plan.inputs.empty() && !dec.step_open());
    return false;
  }
  CHECK(dec.step_open());
  // With preemption the rows are the oldest sequences (a prefix of the arrival order);
  // the newest ones were preempted: no cache blocks, tokens kept, waiting.
  std::vector<int64_t> preempted;
  if (may_preempt && plan.seqs.size() < order.size() &&
      std::equal(plan.seqs.begin(), plan.seqs.end(), order.begin())) {
    preempted.assign(order.begin() + static_cast<std::ptrdiff_t>(plan.seqs.size()), order.end());
    order.resize(plan.seqs.size());
    for (int64_t id : preempted) {
      CHECK(dec.cache_len(id, ModelRole::kTarget) == 0 && dec.block_table(id, ModelRole::kTarget).empty());
      CHECK(dec.cache_len(id, ModelRole::kDraft) == 0);
      CHECK(dec.committed(id) == pre[id].committed);
      CHECK(dec.finish_reason(id) == FinishReason::kNone);
      pre[id].lt = pre[id].ld = 0;
    }
  }
  check_plan(dec, plan, order, pre);
  if (plan.seqs != order) return false;
  const Outputs o = run_models(dec, w, plan, ngram_drafts);
  const auto res = dec.commit(plan.step_id, o.view(), o.times);
  CHECK(!dec.step_open());
  CHECK(dec.offset() == offset + static_cast<uint64_t>(plan.k) + 1);
  CHECK(res.size() == order.size());
  const DecoderConfig& c = dec.config();
  std::vector<int64_t> still;
  for (size_t b = 0; b < order.size() && b < res.size(); ++b) {
    const int64_t id = order[b];
    const Pre& r = pre[id];
    const int64_t C = static_cast<int64_t>(r.committed.size());
    const int64_t kb = plan.row_k[b], a = o.accepted[b];
    Tracker& t = tr[id];
    t.steps += 1;
    t.proposed += kb;
    t.accepted += a;
    t.k_history.push_back(static_cast<int32_t>(kb));
    CHECK(res[b].seq == id);
    const Tokens emitted(o.tokens.begin() + static_cast<std::ptrdiff_t>(b * (plan.k + 1)),
                         o.tokens.begin() + static_cast<std::ptrdiff_t>(b * (plan.k + 1) + a + 1));
    // what was kept is a prefix of what was emitted, all of it unless the row finished
    const Tokens& kept = res[b].new_tokens;
    CHECK(kept.size() <= emitted.size() && std::equal(kept.begin(), kept.end(), emitted.begin()));
    CHECK(res[b].finish != FinishReason::kNone || kept == emitted);
    Tokens now = r.committed;
    now.insert(now.end(), kept.begin(), kept.end());
    CHECK(dec.committed(id) == now);
    CHECK(dec.finish_reason(id) == res[b].finish);
    if (res[b].finish == FinishReason::kNone) {
      still.push_back(id);
      CHECK(dec.cache_len(id, ModelRole::kTarget) == C + a);
      if (c.has_draft_model) {
        const int64_t want = c.draft_shares_target_cache ? C + a : kb > 0 ? std::min(C + kb - 1, C + a) : r.ld;
        CHECK(dec.cache_len(id, ModelRole::kDraft) == want);
      }
      CHECK(static_cast<int64_t>(dec.block_table(id, ModelRole::kTarget).size()) == ceil_div(C + a, c.block_size));
    } else {
      t.finished = true;
      CHECK(dec.cache_len(id, ModelRole::kTarget) == 0 && dec.block_table(id, ModelRole::kTarget).empty());
    }
  }
  CHECK(dec.num_running() == static_cast<int64_t>(still.size()));
  CHECK(dec.num_waiting() == static_cast<int64_t>(preempted.size()));
  still.insert(still.end(), preempted.begin(), preempted.end());  // arrival order
  order = still;
  return true;
}

SamplingParams greedy() {
  SamplingParams p;
  p.temperature = 0.0f;
  return p;
}

StopParams stop_after(int64_t n, Tokens eos = {}, std::vector<Tokens> stops = {}) {
  StopParams s;
  s.max_new_tokens = n;
  s.eos_ids = std::move(eos);
  s.stop_sequences = std::move(stops);
  return s;
}

DecoderConfig base_config() {
  DecoderConfig c;
  c.k = 4;
  c.has_draft_model = true;
  c.target_num_blocks = 96;
  c.draft_num_blocks = 96;
  c.block_size = 4;
  c.vocab_size = kV;
  c.max_context = 48;
  c.seed = 7;
  return c;
}

DecoderConfig ngram_config(bool adaptive = false) {
  DecoderConfig c = base_config();
  c.has_draft_model = false;
  c.draft_num_blocks = 0;
  c.ngram_min_n = 1;
  c.ngram_max_n = 3;
  c.k = 5;
  c.adaptive_k = adaptive;
  return c;
}

DecoderConfig shared_config() {
  DecoderConfig c = base_config();
  c.draft_shares_target_cache = true;
  c.draft_num_blocks = 0;
  c.k = 3;
  return c;
}

DecoderConfig plain_config() {
  DecoderConfig c = base_config();
  c.has_draft_model = false;
  c.draft_num_blocks = 0;
  c.k = 0;
  return c;
}

// The sequences of the greedy runs: lengths, EOS, a stop sequence, the context limit.
std::vector<std::pair<Tokens, StopParams>> workload() {
  return {
      {{0}, stop_after(30)},
      {{3, 7, 2, 9, 4}, stop_after(20)},
      {{1, 6, 5, 0, 1, 6}, stop_after(25, {12})},
      {{11, 2}, stop_after(40, {}, {{5, 0, 1}})},
      {{8, 8, 8, 8, 8, 8, 8, 8, 8, 8}, stop_after(100)},  // stops at the context length
      {{4}, stop_after(1)},
      {{2, 10}, stop_after(2)},
  };
}

void test_greedy(const char* name, const DecoderConfig& c) {
  SpecDecoder dec(c);
  World w(c);
  std::vector<int64_t> order;
  std::map<int64_t, Tracker> tr;
  for (const auto& [prompt, stop] : workload()) {
    const int64_t id = dec.add(prompt, greedy(), stop);
    order.push_back(id);
    tr[id].prompt = prompt;
    tr[id].stop = stop;
  }
  const std::vector<int64_t> ids = order;
  CHECK(ids == std::vector<int64_t>({0, 1, 2, 3, 4, 5, 6}));
  int steps = 0;
  while (checked_step(dec, w, order, tr) && ++steps < 500) {
  }
  CHECK(order.empty() && !dec.has_running());
  CHECK(!checked_step(dec, w, order, tr));  // nothing running: batch 0, no step opened
  int64_t proposed = 0, accepted = 0;
  std::map<FinishReason, int> reasons;
  for (int64_t id : ids) {
    const Tracker& t = tr[id];
    const Ref ref = greedy_reference(t.prompt, t.stop, c.max_context);
    const bool ok = dec.generated(id) == ref.gen && dec.finish_reason(id) == ref.reason;
    CHECK(ok);
    if (!ok) std::fprintf(stderr, "  %s: sequence %lld differs from the greedy reference\n", name, static_cast<long long>(id));
    ++reasons[ref.reason];
    const SequenceStats s = dec.stats(id);
    CHECK(s.steps == t.steps && s.proposed == t.proposed && s.accepted == t.accepted && s.k_history == t.k_history);
    CHECK(s.emitted == static_cast<int64_t>(ref.gen.size()));
    CHECK(s.draft_forwards == (c.has_draft_model ? t.proposed : 0));
    proposed += t.proposed;
    accepted += t.accepted;
    CHECK(dec.cache_len(id, ModelRole::kTarget) == 0);
  }
  // the workload reaches every stop rule, and speculation both hits and misses
  CHECK(reasons[FinishReason::kEos] >= 1 && reasons[FinishReason::kStop] >= 1 &&
        reasons[FinishReason::kLength] >= 1 && reasons[FinishReason::kContext] >= 1);
  if (c.k > 0) {
    CHECK(accepted > 0 && accepted < proposed);
  } else {
    CHECK(proposed == 0);
  }
  CHECK(dec.num_free_blocks(ModelRole::kTarget) == c.target_num_blocks);
  if (c.has_draft_model) CHECK(dec.num_free_blocks(ModelRole::kDraft) == dec.num_blocks(ModelRole::kDraft));
  CHECK(dec.num_sequences() == static_cast<int64_t>(ids.size()));
  for (int64_t id : ids) dec.release(id);
  CHECK(dec.num_sequences() == 0);
  CHECK(dec.times().steps == steps);
}


// ---- commit's checks: every bad output fails, changes nothing -------------------------

struct Bad {
  const char* what;     // the message must contain this
  Outputs out;
};

// Every corruption of good outputs that applies to this plan.
std::vector<Bad> corruptions(const StepPlan& plan, const Outputs& good, bool ngram) {
  const int64_t B = plan.batch, K = plan.k;
  std::vector<Bad> v;
  if (B == 0) return v;
  auto add = [&](const char* what, const std::function<void(Outputs&)>& f) {
    Bad b{what, good};
    f(b.out);
    v.push_back(std::move(b));
  };
  // a row with drafts, and one that accepted at least one
  int64_t rk = -1, ra = -1;
  for (int64_t b = 0; b < B; ++b) {
    if (plan.row_k[static_cast<size_t>(b)] > 0 && rk < 0) rk = b;
    if (good.accepted[static_cast<size_t>(b)] > 0 && ra < 0) ra = b;
  }
  const int64_t last = B - 1;
  const size_t at = static_cast<size_t>(last * (K + 1) + good.accepted[static_cast<size_t>(last)]);
  add("tokens must hold", [](Outputs& o) { o.tokens.clear(); });  // null pointer
  add("tokens must hold", [](Outputs& o) { o.tokens.pop_back(); });
  add("tokens must hold", [](Outputs& o) { o.tokens.push_back(0); });
  add("num_emitted must hold", [](Outputs& o) { o.emitted.clear(); });
  add("num_emitted must hold", [](Outputs& o) { o.emitted.pop_back(); });
  add("num_accepted must hold", [](Outputs& o) { o.accepted.clear(); });
  add("num_accepted must hold", [](Outputs& o) { o.accepted.push_back(0); });
  add("must be in [0, 13), got 13", [&](Outputs& o) { o.tokens[at] = kV; });
  add("must be in [0, 13), got -1", [&](Outputs& o) { o.tokens[at] = -1; });
  add("must be in [0, 13), got 2147483647", [&](Outputs& o) { o.tokens[at] = std::numeric_limits<int32_t>::max(); });
  add("num_accepted[", [&](Outputs& o) {  // k_row + 1, with a consistent num_emitted
    o.accepted[static_cast<size_t>(last)] = plan.row_k[static_cast<size_t>(last)] + 1;
    o.emitted[static_cast<size_t>(last)] = plan.row_k[static_cast<size_t>(last)] + 2;
  });
  add("num_accepted[", [&](Outputs& o) {
    o.accepted[static_cast<size_t>(last)] = -1;
    o.emitted[static_cast<size_t>(last)] = 0;
  });
  add("num_emitted[", [&](Outputs& o) { o.emitted[static_cast<size_t>(last)] += 1; });
  add("num_emitted[", [&](Outputs& o) { o.emitted[static_cast<size_t>(last)] -= 1; });
  if (ra >= 0) {
    add("is accepted, so it must equal the draft", [&](Outputs& o) {
      int32_t& t = o.tokens[static_cast<size_t>(ra * (K + 1))];
      t = (t + 1) % kV;
    });
  }
  if (plan.draft_model) {
    add("draft_tokens must hold", [](Outputs& o) { o.pass_drafts = false; });
    add("draft_tokens must hold", [](Outputs& o) { o.drafts.pop_back(); });
    add("draft_tokens[", [&](Outputs& o) { o.drafts[static_cast<size_t>(rk * K)] = kV; });
    add("draft_tokens[", [&](Outputs& o) { o.drafts[static_cast<size_t>(rk * K)] = -5; });
  }
  if (ngram && K > 0) {
    add("must be the n-gram proposal", [&](Outputs& o) {
      o.pass_drafts = true;
      int32_t& d = o.drafts[static_cast<size_t>(rk * K + plan.row_k[static_cast<size_t>(rk)] - 1)];
      d = (d + 1) % kV;
    });
    add("draft_tokens must hold", [](Outputs& o) {
      o.pass_drafts = true;
      o.drafts.push_back(0);
    });
  }
  const size_t nd = plan.passes.size() - 1;
  add("times must hold", [&](Outputs& o) {
    o.times.draft_forward.assign(nd + 1, 0.001);
    o.times.draft_sample.assign(nd + 1, 0.001);
  });
  add("times must hold", [&](Outputs& o) {  // no draft_forward, but draft_sample times
    o.times.draft_forward.clear();
    o.times.draft_sample.assign(nd + 1, 0.001);
  });
  if (nd > 0) {
    add("times must hold", [](Outputs& o) { o.times.draft_sample.pop_back(); });
    add("times must hold", [](Outputs& o) { o.times.draft_forward.pop_back(); });
  }
  if (nd > 1) {
    add("times must hold", [](Outputs& o) { o.times.draft_forward.pop_back(); o.times.draft_sample.pop_back(); });
  }
  return v;
}

// Two decoders with the same sequences: at every step the disturbed one first gets
// every kind of bad output (each must fail and change nothing; the failed step is over),
// then good ones; after each step both must agree exactly.
void test_commit_failures(const char* name, const DecoderConfig& c) {
  SpecDecoder dec(c), twin(c);
  World w(c), tw(c);
  std::vector<int64_t> ids;
  for (const auto& [prompt, stop] : workload()) {
    ids.push_back(dec.add(prompt, greedy(), stop));
    twin.add(prompt, greedy(), stop);
  }
  const bool ngram = c.ngram_min_n > 0;
  std::map<std::string, int> tried;
  int steps = 0;
  while (twin.has_running() && dec.has_running() && ++steps < 500) {
    const Snap before = snapshot(dec, ids);
    CHECK(same(before, snapshot(twin, ids), false));
    const StepPlan first = dec.begin_step();
    const Outputs good = run_models(dec, w, first);
    dec.cancel_step(first.step_id);
    CHECK(same(snapshot(dec, ids), before, true));
    for (const Bad& bad : corruptions(first, good, ngram)) {
      const StepPlan plan = dec.begin_step();
      CHECK(plan.seqs == first.seqs && plan.row_k == first.row_k && plan.offset == first.offset);
      run_models(dec, w, plan);  // the caller ran its models (they wrote the caches)
      const VerifyOutputs out = bad.out.view();
      const std::string msg = error_of<InvalidArgumentError>([&] { dec.commit(plan.step_id, out, bad.out.times); });
      const bool ok = has(msg, "commit: ") && has(msg, bad.what);
      CHECK(ok);
      if (!ok) std::fprintf(stderr, "  %s: wanted \"%s\", got \"%s\"\n", name, bad.what, msg.c_str());
      if (msg == "<none>") return;  // committed: the two runs cannot be compared any more
      CHECK(same(snapshot(dec, ids), before, true));
      CHECK(!dec.step_open());
      // the step is over: its id is stale now
      CHECK(error_of<StepInProgressError>([&] { dec.commit(plan.step_id, good.view(), good.times); }) != "<none>");
      CHECK(same(snapshot(dec, ids), before, true));
      ++tried[bad.what];
    }
    const StepPlan plan = dec.begin_step();
    const Outputs o = run_models(dec, w, plan, /*ngram_drafts=*/true);
    const auto res = dec.commit(plan.step_id, o.view(), o.times);
    const StepPlan tplan = twin.begin_step();
    CHECK(tplan.seqs == plan.seqs && tplan.row_k == plan.row_k && tplan.offset == plan.offset);
    const Outputs to = run_models(twin, tw, tplan);
    const auto tres = twin.commit(tplan.step_id, to.view(), to.times);
    CHECK(res.size() == tres.size());
    for (size_t i = 0; i < res.size() && i < tres.size(); ++i) {
      CHECK(res[i].seq == tres[i].seq && res[i].new_tokens == tres[i].new_tokens && res[i].finish == tres[i].finish);
    }
    CHECK(same(snapshot(dec, ids), snapshot(twin, ids), false));
    const auto cm = dec.cost_model(), tcm = twin.cost_model();
    CHECK(cm.has_draft() == tcm.has_draft() && cm.measured() == tcm.measured());
  }
  CHECK(!dec.has_running());
  for (int64_t id : ids) {
    const Ref ref = greedy_reference(workload()[static_cast<size_t>(id)].first,
                                     workload()[static_cast<size_t>(id)].second, c.max_context);
    CHECK(dec.generated(id) == ref.gen && dec.finish_reason(id) == ref.reason);
  }
  CHECK(dec.num_free_blocks(ModelRole::kTarget) == c.target_num_blocks);
  // every kind was tried
  CHECK(tried["tokens must hold"] > 0 && tried["num_emitted must hold"] > 0 && tried["num_accepted must hold"] > 0);
  CHECK(tried["num_accepted["] > 0 && tried["num_emitted["] > 0 && tried["times must hold"] > 0);
  CHECK(tried["must be in [0, 13), got 13"] > 0 && tried["must be in [0, 13), got -1"] > 0);
  if (c.k > 0) CHECK(tried["is accepted, so it must equal the draft"] > 0);
  if (c.has_draft_model) CHECK(tried["draft_tokens must hold"] > 0 && tried["draft_tokens["] > 0);
  if (ngram) CHECK(tried["must be the n-gram proposal"] > 0 && tried["draft_tokens must hold"] > 0);
}

// ---- step ids, cancel, begin twice, nothing to run ----------------------------------

void test_step_ids_and_cancel() {
  const DecoderConfig c = base_config();
  SpecDecoder dec(c);
  World w(c);
  // nothing running: batch 0, no step opened, nothing to commit
  StepPlan none = dec.begin_step();
  CHECK(none.batch == 0 && none.seqs.empty() && !dec.step_open());
  CHECK(has(error_of<StepInProgressError>([&] { dec.commit(none.step_id, VerifyOutputs{}, StepTimes{}); }), "none"));
  dec.cancel_step(none.step_id);  // no-op
  std::vector<int64_t> ids = {dec.add({1, 2, 3}, greedy(), stop_after(12)), dec.add({4}, greedy(), stop_after(9))};
  // one step first, so the caches hold something to restore to
  std::vector<int64_t> order = ids;
  std::map<int64_t, Tracker> tr;
  tr[ids[0]].prompt = {1, 2, 3};
  tr[ids[0]].stop = stop_after(12);
  tr[ids[1]].prompt = {4};
  tr[ids[1]].stop = stop_after(9);
  CHECK(checked_step(dec, w, order, tr));
  const Snap before = snapshot(dec, ids);
  StepPlan p = dec.begin_step();
  CHECK(p.batch == 2 && dec.step_open());
  // begin twice: refused, the open step untouched
  CHECK(has(error_of<StepInProgressError>([&] { dec.begin_step(); }), "still open"));
  CHECK(dec.step_open());
  CHECK(has(error_of<StepInProgressError>([&] { dec.reseed(3); }), "step is open"));
  Outputs o = run_models(dec, w, p);
  // a stale id: refused, the open step untouched; cancel of a stale id: a no-op
  CHECK(has(error_of<StepInProgressError>([&] { dec.commit(p.step_id + 1, o.view(), o.times); }), "not the open step"));
  CHECK(has(error_of<StepInProgressError>([&] { dec.commit(p.step_id - 1, o.view(), o.times); }), "not the open step"));
  dec.cancel_step(p.step_id - 1);
  CHECK(dec.step_open());
  dec.cancel_step(p.step_id);
  CHECK(!dec.step_open());
  CHECK(same(snapshot(dec, ids), before, true));
  dec.cancel_step(p.step_id);  // twice: a no-op
  CHECK(same(snapshot(dec, ids), before, true));
  CHECK(has(error_of<StepInProgressError>([&] { dec.commit(p.step_id, o.view(), o.times); }), "none"));
  CHECK(same(snapshot(dec, ids), before, true));
  // the step after a cancel is the same step, with a new id; it runs as usual
  const StepPlan q = dec.begin_step();
  CHECK(q.step_id > p.step_id && q.seqs == p.seqs && q.row_k == p.row_k && q.offset == p.offset);
  dec.cancel_step(q.step_id);
  // a caller that does not time at all: empty StepTimes are accepted (only phase totals miss it)
  {
    const StepPlan r = dec.begin_step();
    const Outputs ro = run_models(dec, w, r);
    CHECK(error_of<InvalidArgumentError>([&] { dec.commit(r.step_id, ro.view(), StepTimes{}); }) == "<none>");
    CHECK(!dec.step_open() && dec.times().steps == before.steps + 1);
    for (size_t b = 0; b < r.seqs.size(); ++b) {
      const int64_t id = r.seqs[b];
      tr[id].steps += 1;
      if (dec.finish_reason(id) != FinishReason::kNone) order.erase(std::find(order.begin(), order.end(), id));
    }
  }
  while (checked_step(dec, w, order, tr)) {
  }
  for (int64_t id : ids) {
    const Ref ref = greedy_reference(tr[id].prompt, tr[id].stop, c.max_context);
    CHECK(dec.generated(id) == ref.gen);
  }
  // reseed between steps: offset 0
  dec.reseed(11);
  CHECK(dec.offset() == 0 && dec.config().seed == 11);
}

// ---- CacheFullError inside begin_step ---------------------------------------------

void test_cache_full() {
  // Sequences that do not fit together: the newest is preempted (blocks freed, tokens
  // kept) and recomputes its caches when it runs again; every output is the reference's.
  for (int which = 0; which < 3; ++which) {
    DecoderConfig c = which == 2 ? ngram_config() : base_config();
    if (which == 0) c.target_num_blocks = 6;  // the verify pass runs out
    if (which == 1) c.draft_num_blocks = 6;   // a draft pass runs out
    if (which == 2) c.target_num_blocks = 6;
    SpecDecoder dec(c);
    World w(c);
    std::vector<int64_t> order, ids;
    std::map<int64_t, Tracker> tr;
    const std::vector<Tokens> prompts = {{0, 1, 6, 5}, {3, 3, 3}, {5, 0, 1, 6, 5, 0}};
    for (const Tokens& pr : prompts) {
      const int64_t id = dec.add(pr, greedy(), stop_after(12));
      ids.push_back(id);
      order.push_back(id);
      tr[id].prompt = pr;
      tr[id].stop = stop_after(12);
    }
    for (int step = 0; step < 400 && !order.empty(); ++step) {
      CHECK(checked_step(dec, w, order, tr, /*ngram_drafts=*/false, /*may_preempt=*/true));
    }
    CHECK(order.empty() && !dec.has_running());
    CHECK(dec.num_preemptions() >= 1);
    CHECK(dec.stats(ids[0]).preemptions == 0);  // the oldest is never preempted
    for (int64_t id : ids) {
      const Ref ref = greedy_reference(tr[id].prompt, tr[id].stop, c.max_context);
      CHECK(dec.generated(id) == ref.gen);
    }
    CHECK(dec.num_free_blocks(ModelRole::kTarget) == c.target_num_blocks);
    if (c.has_draft_model) CHECK(dec.num_free_blocks(ModelRole::kDraft) == c.draft_num_blocks);
  }
  // One sequence that cannot fit alone: CacheFullError, and the failed begin changes nothing.
  for (int which = 0; which < 2; ++which) {
    DecoderConfig c = base_config();
    if (which == 0) c.target_num_blocks = 6;
    if (which == 1) c.draft_num_blocks = 6;
    SpecDecoder dec(c);
    World w(c);
    const int64_t a = dec.add({0, 1, 6, 5}, greedy(), stop_after(60));
    std::vector<int64_t> order = {a}, ids = {a};
    std::map<int64_t, Tracker> tr;
    tr[a].prompt = {0, 1, 6, 5};
    tr[a].stop = stop_after(60);
    int fulls = 0;
    for (int step = 0; step < 200 && fulls == 0; ++step) {
      const Snap before = snapshot(dec, ids);
      const uint64_t offset = dec.offset();
      const std::string msg = error_of<CacheFullError>([&] {
        StepPlan p = dec.begin_step();
        dec.cancel_step(p.step_id);
      });
      if (msg != "<none>") {
        ++fulls;
        CHECK(has(msg, "free blocks"));
        CHECK(same(snapshot(dec, ids), before, true));
        CHECK(!dec.step_open() && dec.offset() == offset);
        break;
      }
      CHECK(checked_step(dec, w, order, tr));
    }
    CHECK(fulls == 1);
    dec.abort(a);
    CHECK(dec.num_free_blocks(ModelRole::kTarget) == c.target_num_blocks);
  }
}

// ---- token budget and chunked prefill ---------------------------------------------

struct BudgetRun {
  int64_t max_tokens = 0;          // the largest verify pass seen
  int64_t prefill_steps = 0;       // steps with a prefill row
  int64_t chunk_only_steps = 0;    // steps with no verify row at all
  int64_t partial_preemptions = 0; // preempted while partly prefilled
  bool decode_stalled = false;     // a decoding sequence left out of a step
};

// Steps `dec` until nothing runs, checking each plan against the budget rules and the
// caches after each commit; every output is compared with the plain greedy loop.
BudgetRun run_budget(SpecDecoder& dec, World& w, const std::vector<int64_t>& ids,
                     const std::map<int64_t, Tracker>& tr) {
  const DecoderConfig& c = dec.config();
  const int64_t budget = c.max_tokens_per_step;
  BudgetRun run;
  for (int step = 0; step < 2000 && dec.has_running(); ++step) {
    std::map<int64_t, int64_t> lt, committed_len, chunks;
    for (int64_t id : ids) {
      if (dec.finish_reason(id) != FinishReason::kNone) continue;
      lt[id] = dec.cache_len(id, ModelRole::kTarget);
      committed_len[id] = dec.committed_len(id);
      chunks[id] = dec.stats(id).prefill_chunks;
    }
    const StepPlan plan = dec.begin_step();
    CHECK(!plan.passes.empty());
    if (plan.passes.empty()) break;
    const PassView v = view_pass(plan, plan.passes.size() - 1);
    const int64_t B = plan.batch, P = static_cast<int64_t>(plan.prefill_seqs.size());
    run.max_tokens = std::max(run.max_tokens, v.T);
    if (budget > 0) CHECK(v.T <= budget);
    CHECK(P <= 1);  // a chunk takes what is left: one prefill row at most
    CHECK(v.B == B + P && v.R == std::max<int64_t>(B * (plan.k + 1), 1));
    if (P > 0) ++run.prefill_steps;
    if (B == 0) ++run.chunk_only_steps;
    bool ok = true;
    for (int64_t i = 0; i < P; ++i) {  // prefill rows: rows = -1, a chunk of committed[Lt:]
      const int64_t seq = plan.prefill_seqs[static_cast<size_t>(i)];
      const int64_t row = B + i;
      const int64_t q0 = v.qs[static_cast<size_t>(row)], q1 = v.qs[static_cast<size_t>(row + 1)];
      const Tokens com = dec.committed(seq);
      ok = ok && v.rows[static_cast<size_t>(row)] == -1 && q1 > q0 &&
           lt[seq] + (q1 - q0) < committed_len[seq] &&  // it does not complete
           v.ctx[static_cast<size_t>(row)] == lt[seq] + (q1 - q0);
      for (int64_t t = q0; t < q1 && ok; ++t) {
        ok = v.pos[static_cast<size_t>(t)] == lt[seq] + t - q0 &&
             v.ids[static_cast<size_t>(t)] == com[static_cast<size_t>(lt[seq] + t - q0)];
      }
      for (int64_t l : v.li) ok = ok && (l < q0 || l >= q1 || B == 0);  // no logits (B = 0: one unused)
    }
    CHECK(ok);
    // every decoding sequence (a cache, and one uncached token) is a verify row
    for (const auto& [id, len] : lt) {
      if (len == 0 || committed_len[id] - len != 1) continue;
      if (std::find(plan.seqs.begin(), plan.seqs.end(), id) == plan.seqs.end()) run.decode_stalled = true;
    }
    const Outputs o = run_models(dec, w, plan);
    const auto res = dec.commit(plan.step_id, o.view(), o.times);
    CHECK(static_cast<int64_t>(res.size()) == B);
    for (int64_t i = 0; i < P; ++i) {  // the chunk stays cached; nothing committed
      const int64_t seq = plan.prefill_seqs[static_cast<size_t>(i)];
      const int64_t n = v.qs[static_cast<size_t>(B + i + 1)] - v.qs[static_cast<size_t>(B + i)];
      CHECK(dec.cache_len(seq, ModelRole::kTarget) == lt[seq] + n);
      CHECK(dec.committed_len(seq) == committed_len[seq]);
      CHECK(dec.stats(seq).prefill_chunks == chunks[seq] + 1);
    }
    for (const auto& [id, len] : lt) {  // preempted while partly prefilled: recomputes later
      if (len > 0 && len < committed_len[id] - 1 && dec.finish_reason(id) == FinishReason::kNone &&
          dec.cache_len(id, ModelRole::kTarget) == 0) {
        ++run.partial_preemptions;
      }
    }
  }
  CHECK(!dec.has_running());
  for (int64_t id : ids) {
    const Tracker& t = tr.at(id);
    const Ref ref = greedy_reference(t.prompt, t.stop, c.max_context);
    CHECK(dec.generated(id) == ref.gen && dec.finish_reason(id) == ref.reason);
  }
  CHECK(dec.num_free_blocks(ModelRole::kTarget) == c.target_num_blocks);
  if (c.has_draft_model && !c.draft_shares_target_cache) {
    CHECK(dec.num_free_blocks(ModelRole::kDraft) == c.draft_num_blocks);
  }
  return run;
}

BudgetRun budget_workload(DecoderConfig c, int64_t budget) {
  c.max_tokens_per_step = budget;
  SpecDecoder dec(c);
  World w(c);
  std::vector<int64_t> ids;
  std::map<int64_t, Tracker> tr;
  for (const auto& [prompt, stop] : workload()) {
    const int64_t id = dec.add(prompt, greedy(), stop);
    ids.push_back(id);
    tr[id].prompt = prompt;
    tr[id].stop = stop;
  }
  // and a long prompt arriving late, while the others decode
  const Tokens long_prompt = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 0, 1, 2, 3, 4, 5, 6, 7};
  const int64_t id = dec.add(long_prompt, greedy(), stop_after(6));
  ids.push_back(id);
  tr[id].prompt = long_prompt;
  tr[id].stop = stop_after(6);
  return run_budget(dec, w, ids, tr);
}

void test_token_budget() {
  // Bad budgets are refused, naming the argument, the rule and the value.
  DecoderConfig bad = base_config();
  bad.max_tokens_per_step = -1;
  const std::string msg = error_of<InvalidArgumentError>([&] { SpecDecoder d(bad); });
  CHECK(has(msg, "max_tokens_per_step") && has(msg, "0 (no limit) or >= 1") && has(msg, "got -1"));
  // Every draft source, several budgets: the pass stays within the budget, the output is
  // the plain greedy loop's, no decoding sequence waits for a prefill.
  const DecoderConfig configs[] = {base_config(), ngram_config(), ngram_config(true), shared_config(),
                                   plain_config()};
  for (const DecoderConfig& c : configs) {
    for (int64_t budget : {1, 2, 3, 5, 8, 13}) {
      const BudgetRun r = budget_workload(c, budget);
      CHECK(r.max_tokens <= budget);
      CHECK(!r.decode_stalled);
      CHECK(r.prefill_steps > 0);  // the long prompt (and others) went in chunks
    }
    // Power: without a budget the long prompt goes in whole, in a pass larger than 13.
    const BudgetRun none = budget_workload(c, 0);
    CHECK(none.max_tokens > 13 && none.prefill_steps == 0);
  }
  // A budget of 1: one sequence at a time, one token per step.
  const BudgetRun one = budget_workload(base_config(), 1);
  CHECK(one.max_tokens == 1 && one.chunk_only_steps > 0);
  // Adaptive k under a budget: chooses within what is left.
  DecoderConfig adaptive = base_config();
  adaptive.adaptive_k = true;
  CHECK(budget_workload(adaptive, 6).max_tokens <= 6);
}

void test_chunked_prefill_failures_and_preemption() {
  // A step with a prefill row that fails (cancel, a bad commit) restores its target cache.
  DecoderConfig c = base_config();
  c.max_tokens_per_step = 4;
  SpecDecoder dec(c);
  World w(c);
  const int64_t a = dec.add({1, 2}, greedy(), stop_after(10));
  const int64_t b = dec.add({3, 4, 5, 6, 7, 8, 9, 10, 11, 12}, greedy(), stop_after(5));
  const std::vector<int64_t> ids = {a, b};
  int failures_tried = 0;
  for (int step = 0; step < 100 && dec.has_running(); ++step) {
    const Snap before = snapshot(dec, ids);
    StepPlan plan = dec.begin_step();
    if (!plan.prefill_seqs.empty() && failures_tried < 4) {
      ++failures_tried;
      if (failures_tried % 2 == 1) {
        dec.cancel_step(plan.step_id);
      } else {
        Outputs o = run_models(dec, w, plan);
        o.emitted.push_back(1);  // one value too many
        CHECK(has(error_of<InvalidArgumentError>([&] { dec.commit(plan.step_id, o.view(), o.times); }),
                  "num_emitted"));
      }
      CHECK(same(snapshot(dec, ids), before, true));
      continue;
    }
    const Outputs o = run_models(dec, w, plan);
    dec.commit(plan.step_id, o.view(), o.times);
  }
  CHECK(failures_tried == 4 && !dec.has_running());
  CHECK(dec.generated(a) == greedy_reference({1, 2}, stop_after(10), c.max_context).gen);
  CHECK(dec.generated(b) ==
        greedy_reference({3, 4, 5, 6, 7, 8, 9, 10, 11, 12}, stop_after(5), c.max_context).gen);
  CHECK(dec.num_free_blocks(ModelRole::kTarget) == c.target_num_blocks);

  // A small pool: a partly prefilled sequence is preempted (rolled back to 0) and
  // recomputes later; every output is still the reference's, no block leaks.
  int64_t partial = 0;
  for (int64_t blocks : {6, 7, 8, 9, 10}) {
    DecoderConfig small = plain_config();
    small.target_num_blocks = blocks;
    small.max_tokens_per_step = 3;
    SpecDecoder d(small);
    World ww(small);
    std::vector<int64_t> sids;
    std::map<int64_t, Tracker> tr;
    const std::vector<std::pair<Tokens, int64_t>> work = {
        {{1, 2, 3}, 16}, {{4, 5, 6, 7, 8, 9, 10, 11, 12, 0, 1, 2}, 6}, {{5, 5, 5, 5, 5, 5, 5, 5}, 8}};
    for (const auto& [prompt, n] : work) {
      const int64_t id = d.add(prompt, greedy(), stop_after(n));
      sids.push_back(id);
      tr[id].prompt = prompt;
      tr[id].stop = stop_after(n);
    }
    const BudgetRun r = run_budget(d, ww, sids, tr);
    partial += r.partial_preemptions;
  }
  CHECK(partial > 0);
}

// ---- abort / release / add around an open step ------------------------------------

void test_queued_calls() {
  for (int end = 0; end < 2; ++end) {  // the step ends by commit, or by cancel
    const DecoderConfig c = base_config();
    SpecDecoder dec(c);
    World w(c);
    const int64_t a = dec.add({1, 2}, greedy(), stop_after(20));
    const int64_t b = dec.add({3, 4}, greedy(), stop_after(20));
    const int64_t d = dec.add({5, 6}, greedy(), stop_after(20));
    const StepPlan p = dec.begin_step();
    const Outputs o = run_models(dec, w, p);
    const Tokens b_before = dec.committed(b);
    dec.abort(b);    // queued
    dec.release(d);  // queued
    dec.release(d);  // queued once
    CHECK(dec.finish_reason(b) == FinishReason::kNone && dec.finish_reason(d) == FinishReason::kNone);
    CHECK(dec.num_running() == 3 && dec.num_sequences() == 3);
    CHECK(dec.cache_len(b, ModelRole::kTarget) > 0);
    // add during the step: not a row of it; a new id
    const int64_t e = dec.add({7}, greedy(), stop_after(20));
    CHECK(e == 3 && dec.num_running() == 3 && dec.num_waiting() == 1 &&
          dec.cache_len(e, ModelRole::kTarget) == 0);  // queued for the next step
    // release of an added-now sequence is immediate (not in the step)
    const int64_t f = dec.add({8}, greedy(), stop_after(20));
    dec.release(f);
    CHECK(has(error_of<UnknownSequenceError>([&] { dec.finish_reason(f); }), "unknown sequence id 4"));
    if (end == 0) {
      const auto res = dec.commit(p.step_id, o.view(), o.times);
      CHECK(res.size() == 2);  // d's row is gone
      CHECK(res.size() == 2 && res[0].seq == a && res[1].seq == b);
      CHECK(res.size() == 2 && res[0].finish == FinishReason::kNone && res[1].finish == FinishReason::kAborted);
      CHECK(res.size() == 2 && dec.committed(b).size() == b_before.size() + res[1].new_tokens.size());
    } else {
      dec.cancel_step(p.step_id);
      CHECK(dec.committed(b) == b_before);
    }
    CHECK(dec.finish_reason(b) == FinishReason::kAborted);
    CHECK(dec.cache_len(b, ModelRole::kTarget) == 0 && dec.cache_len(b, ModelRole::kDraft) == 0);
    CHECK(dec.block_table(b, ModelRole::kTarget).empty());
    CHECK(has(error_of<UnknownSequenceError>([&] { dec.committed(d); }), "unknown"));
    // a (running, or back in the queue after a cancel) and e (queued)
    CHECK(dec.num_sequences() == 3 && dec.num_running() + dec.num_waiting() == 2);
    // the blocks held are exactly a's
    CHECK(dec.num_free_blocks(ModelRole::kTarget) ==
          c.target_num_blocks - static_cast<int64_t>(dec.block_table(a, ModelRole::kTarget).size()));
    CHECK(dec.num_free_blocks(ModelRole::kDraft) ==
          c.draft_num_blocks - static_cast<int64_t>(dec.block_table(a, ModelRole::kDraft).size()));
    // the next step: a, then the one added during the step
    const StepPlan q = dec.begin_step();
    CHECK(q.seqs == std::vector<int64_t>({a, e}));
    dec.cancel_step(q.step_id);
    // unknown ids
    CHECK(has(error_of<UnknownSequenceError>([&] { dec.release(d); }), "unknown sequence id 2"));
    CHECK(has(error_of<UnknownSequenceError>([&] { dec.release(99); }), "unknown sequence id 99"));
    CHECK(has(error_of<UnknownSequenceError>([&] { dec.release(-1); }), "unknown sequence id -1"));
    CHECK(has(error_of<UnknownSequenceError>([&] { dec.abort(99); }), "unknown sequence id 99"));
    // abort of a finished sequence: no change; release of a finished one frees its id
    dec.abort(b);
    CHECK(dec.finish_reason(b) == FinishReason::kAborted);
    dec.release(b);
    CHECK(dec.num_sequences() == 2);
    // ids are reused, and the running list keeps add order, not id order
    const int64_t g = dec.add({9}, greedy(), stop_after(5));
    const int64_t h = dec.add({10}, greedy(), stop_after(5));
    CHECK((std::vector<int64_t>{g, h} == std::vector<int64_t>{b, d} ||
           std::vector<int64_t>{g, h} == std::vector<int64_t>{d, b}));
    const StepPlan r = dec.begin_step();
    CHECK(r.seqs == std::vector<int64_t>({a, e, g, h}));
    dec.cancel_step(r.step_id);
    for (int64_t id : {a, e, g, h}) dec.release(id);
    CHECK(dec.num_sequences() == 0 && dec.num_running() == 0);
    CHECK(dec.num_free_blocks(ModelRole::kTarget) == c.target_num_blocks);
    CHECK(dec.num_free_blocks(ModelRole::kDraft) == c.draft_num_blocks);
  }
}

void test_add_release_cycles() {
  const DecoderConfig c = base_config();
  SpecDecoder dec(c);
  std::vector<int64_t> live;
  int64_t max_id = -1;
  bool counts_ok = true;
  for (int i = 0; i < 100000; ++i) {
    live.push_back(dec.add({static_cast<int32_t>(i % kV)}, greedy(), stop_after(3)));
    max_id = std::max(max_id, live.back());
    if (live.size() > 3) {
      dec.release(live[static_cast<size_t>(i % 4)]);
      live.erase(live.begin() + i % 4);
    }
    counts_ok = counts_ok && dec.num_sequences() == static_cast<int64_t>(live.size()) &&
                dec.num_running() + dec.num_waiting() == static_cast<int64_t>(live.size());
  }
  CHECK(counts_ok);
  CHECK(max_id == 3);  // ids are reused
  for (int64_t id : live) dec.release(id);
  CHECK(dec.num_sequences() == 0);
}

// ---- threads ----------------------------------------------------------------------

void test_threads() {
  DecoderConfig c = base_config();
  c.target_num_blocks = 512;
  c.draft_num_blocks = 512;
  c.max_context = 40;
  SpecDecoder dec(c);
  World w(c);
  // untouched sequences: the other thread never names them
  std::vector<std::pair<int64_t, std::pair<Tokens, StopParams>>> mine;
  for (const auto& spec : workload()) mine.push_back({dec.add(spec.first, greedy(), spec.second), spec});
  std::atomic<bool> done{false};
  std::atomic<int64_t> worker_errors{0}, worker_ops{0}, during_step{0};
  std::thread worker([&] {
    std::mt19937 rng(1234);
    std::vector<int64_t> own;
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 20000; ++i) {
      if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(20)) break;
      try {
        if (dec.step_open()) ++during_step;  // racy by design: only reported
        const uint32_t op = rng() % 8;
        if (own.size() < 8 && (op < 3 || own.empty())) {
          Tokens pr(1 + rng() % 6);
          for (int32_t& t : pr) t = static_cast<int32_t>(rng() % kV);
          own.push_back(dec.add(pr, greedy(), stop_after(1 + rng() % 12)));
        } else if (op < 5) {
          dec.abort(own[rng() % own.size()]);
        } else {
          const size_t at = rng() % own.size();
          dec.release(own[at]);
          own.erase(own.begin() + static_cast<std::ptrdiff_t>(at));
        }
        ++worker_ops;
      } catch (...) {
        ++worker_errors;
      }
      if (i % 64 == 0) std::this_thread::yield();
    }
    for (int64_t id : own) {
      try {
        dec.release(id);
      } catch (...) {
        ++worker_errors;
      }
    }
    done = true;
  });
  int64_t steps = 0, step_errors = 0;
  const auto t0 = std::chrono::steady_clock::now();
  while ((!done || dec.has_running()) && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(40)) {
    try {
      const StepPlan p = dec.begin_step();
      if (p.batch == 0) {
        std::this_thread::yield();
        continue;
      }
      const Outputs o = run_models(dec, w, p);
      dec.commit(p.step_id, o.view(), o.times);
      ++steps;
    } catch (...) {
      ++step_errors;
    }
  }
  worker.join();
  while (dec.has_running()) {  // if the time ran out first
    const StepPlan p = dec.begin_step();
    const Outputs o = run_models(dec, w, p);
    dec.commit(p.step_id, o.view(), o.times);
  }
  std::printf("threads: %lld steps, %lld add/abort/release calls (%lld while a step was open)\n",
              static_cast<long long>(steps), static_cast<long long>(worker_ops.load()),
              static_cast<long long>(during_step.load()));
  CHECK(worker_errors == 0 && step_errors == 0);
  CHECK(worker_ops > 0 && steps > 0);
  for (const auto& [id, spec] : mine) {
    const Ref ref = greedy_reference(spec.first, spec.second, c.max_context);
    CHECK(dec.generated(id) == ref.gen && dec.finish_reason(id) == ref.reason);
    dec.release(id);
  }
  CHECK(dec.num_sequences() == 0 && dec.num_running() == 0 && !dec.step_open());
  CHECK(dec.num_free_blocks(ModelRole::kTarget) == c.target_num_blocks);
  CHECK(dec.num_free_blocks(ModelRole::kDraft) == c.draft_num_blocks);
}

// ---- bounds -----------------------------------------------------------------------

void test_bounds() {
  auto config_error = [](const std::function<void(DecoderConfig&)>& f) {
    DecoderConfig c = base_config();
    f(c);
    return error_of<InvalidArgumentError>([&] { SpecDecoder d(c); });
  };
  CHECK(has(config_error([](DecoderConfig& c) { c.k = -1; }), "k must be in [0, 64], got -1"));
  CHECK(has(config_error([](DecoderConfig& c) { c.k = verispec::kMaxK + 1; }), "got 65"));
  CHECK(config_error([](DecoderConfig& c) { c.k = verispec::kMaxK; }) == "<none>");
  CHECK(config_error([](DecoderConfig& c) { c.k = 0; }) == "<none>");
  CHECK(has(config_error([](DecoderConfig& c) { c.vocab_size = 0; }), "vocab_size"));
  CHECK(has(config_error([](DecoderConfig& c) { c.vocab_size = -3; }), "vocab_size"));
  CHECK(has(config_error([](DecoderConfig& c) { c.vocab_size = int64_t{1} << 31; }), "vocab_size"));
  CHECK(config_error([](DecoderConfig& c) { c.vocab_size = (int64_t{1} << 31) - 1; }) == "<none>");
  CHECK(has(config_error([](DecoderConfig& c) { c.max_context = 0; }), "max_context"));
  CHECK(has(config_error([](DecoderConfig& c) { c.ngram_min_n = 1; c.ngram_max_n = 2; }), "one draft source"));
  CHECK(has(config_error([](DecoderConfig& c) { c.has_draft_model = false; }), "needs a draft"));

  const DecoderConfig c = base_config();
  SpecDecoder dec(c);
  auto add_error = [&](Tokens prompt, SamplingParams sp, StopParams st) {
    return error_of<InvalidArgumentError>([&] { dec.add(prompt, sp, st); });
  };
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  auto sp = [](float t, int32_t k, float p, float m) {
    SamplingParams s;
    s.temperature = t;
    s.top_k = k;
    s.top_p = p;
    s.min_p = m;
    return s;
  };
  const StopParams ok = stop_after(4);
  CHECK(has(add_error({1}, sp(inf, 0, 1, 0), ok), "temperature"));
  CHECK(has(add_error({1}, sp(nan, 0, 1, 0), ok), "temperature"));
  CHECK(has(add_error({1}, sp(-1, 0, 1, 0), ok), "temperature"));
  CHECK(has(add_error({1}, sp(1, 0, 0, 0), ok), "top_p"));
  CHECK(has(add_error({1}, sp(1, 0, 1.5f, 0), ok), "top_p"));
  CHECK(has(add_error({1}, sp(1, 0, 1, 2), ok), "min_p"));
  CHECK(has(add_error({1}, sp(1, -1, 1, 0), ok), "top_k"));
  CHECK(has(add_error({}, greedy(), ok), "prompt"));
  CHECK(has(add_error({1, kV}, greedy(), ok), "prompt[1]"));
  CHECK(has(add_error({1, -1}, greedy(), ok), "prompt[1]"));
  CHECK(has(add_error(Tokens(static_cast<size_t>(c.max_context), 1), greedy(), ok), "prompt length"));
  CHECK(has(add_error({1}, greedy(), stop_after(0)), "max_new_tokens"));
  CHECK(has(add_error({1}, greedy(), stop_after(-2)), "max_new_tokens"));
  CHECK(has(add_error({1}, greedy(), stop_after(4, {3, -1})), "eos_token_id[1]"));
  CHECK(has(add_error({1}, greedy(), stop_after(4, {}, {{2}, {}})), "stop[1]"));
  // nothing was added; valid limits pass
  CHECK(dec.num_sequences() == 0 && dec.num_running() == 0);
  CHECK(dec.add(Tokens(static_cast<size_t>(c.max_context - 1), kV - 1), sp(0, 0, 1, 1), stop_after(1, {kV + 5})) == 0);
  CHECK(dec.num_sequences() == 1);
}

// The per-row sampling policy in the plan.
void test_policy_layout() {
  const DecoderConfig c = base_config();
  SpecDecoder dec(c);
  SamplingParams s1;
  s1.temperature = 0.7f;
  s1.top_k = 5;
  s1.top_p = 0.9f;
  s1.min_p = 0.1f;
  dec.add({1}, greedy(), stop_after(4));
  dec.add({2}, s1, stop_after(4));
  StepPlan p = dec.begin_step();
  CHECK(!p.policy.uniform);
  CHECK(read<float>(p, p.policy.temperature_rows, 2) == std::vector<float>({0.0f, 0.7f}));
  CHECK(read<int32_t>(p, p.policy.top_k_rows, 2) == std::vector<int32_t>({0, 5}));
  CHECK(read<float>(p, p.policy.top_p_rows, 2) == std::vector<float>({1.0f, 0.9f}));
  CHECK(read<float>(p, p.policy.min_p_rows, 2) == std::vector<float>({0.0f, 0.1f}));
  dec.cancel_step(p.step_id);
  dec.release(0);
  p = dec.begin_step();
  CHECK(p.policy.uniform && p.policy.temperature == 0.7f && p.policy.top_k == 5 && p.policy.top_p == 0.9f &&
        p.policy.min_p == 0.1f);
  CHECK(read<float>(p, p.policy.temperature_rows, 1) == std::vector<float>({0.7f}));
  dec.cancel_step(p.step_id);
}

// Runs one test; an exception it did not expect is a failed check, not an abort.
void guarded(const char* name, const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    ++native_check::checks;
    ++native_check::failures;
    std::fprintf(stderr, "%s: unexpected exception: %s\n", name, e.what());
  }
}

}  // namespace

int main() {
  guarded("greedy draft model", [] { test_greedy("draft model", base_config()); });
  guarded("greedy short draft context", [] {
    DecoderConfig c = base_config();
    c.draft_max_context = 30;  // rows past it stop drafting
    test_greedy("short draft context", c);
  });
  guarded("greedy ngram", [] { test_greedy("ngram", ngram_config()); });
  guarded("greedy ngram adaptive", [] { test_greedy("ngram adaptive", ngram_config(true)); });
  guarded("greedy shared cache", [] { test_greedy("shared cache", shared_config()); });
  guarded("greedy draft model adaptive", [] {
    DecoderConfig c = base_config();
    c.adaptive_k = true;
    test_greedy("draft model adaptive", c);
  });
  guarded("greedy plain", [] { test_greedy("plain", plain_config()); });
  guarded("commit failures draft model", [] { test_commit_failures("draft model", base_config()); });
  guarded("commit failures ngram", [] { test_commit_failures("ngram", ngram_config()); });
  guarded("commit failures ngram adaptive", [] { test_commit_failures("ngram adaptive", ngram_config(true)); });
  guarded("commit failures shared cache", [] { test_commit_failures("shared cache", shared_config()); });
  guarded("commit failures draft model adaptive", [] {
    DecoderConfig c = base_config();
    c.adaptive_k = true;
    test_commit_failures("draft model adaptive", c);
    // a dear draft: adaptive k goes to k = 0 and probes (the probe counters are restored too)
    g_draft_pass_s = 0.01;
    test_commit_failures("draft model adaptive, dear draft", c);
    g_draft_pass_s = 0.001;
  });
  guarded("commit failures plain", [] { test_commit_failures("plain", plain_config()); });
  guarded("step ids and cancel", test_step_ids_and_cancel);
  guarded("cache full", test_cache_full);
  guarded("token budget", test_token_budget);
  guarded("chunked prefill failures and preemption", test_chunked_prefill_failures_and_preemption);
  guarded("queued calls", test_queued_calls);
  guarded("add/release cycles", test_add_release_cycles);
  guarded("bounds", test_bounds);
  guarded("policy layout", test_policy_layout);
  guarded("threads", test_threads);
  return native_check::check_summary("test_spec_decoder");
}

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

// The message of the E thrown by f, or "<none>" if f threw nothing.
template <typename E, typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  return "<none>";
}

bool has(const std::string& s, const char* part) { return s.find(part) != std::string::npos; }

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

// ngram.h's rule written directly: the longest n in [min_n, max_n] whose last-n key
// occurs earlier, its most recent occurrence, up to k tokens after it.
Tokens brute_propose(const Tokens& t, int64_t min_n, int64_t max_n, int64_t k) {
  const int64_t len = static_cast<int64_t>(t.size());
  for (int64_t n = std::min(max_n, len); n >= min_n && k > 0; --n) {
    for (int64_t e = len - 2; e >= n - 1; --e) {
      bool eq = true;
      for (int64_t i = 0; i < n && eq; ++i) {
        eq = t[static_cast<size_t>(e - i)] == t[static_cast<size_t>(len - 1 - i)];
      }
      if (!eq) continue;
      Tokens out;
      for (int64_t j = e + 1; j < len && j <= e + k; ++j) out.push_back(t[static_cast<size_t>(j)]);
      return out;
    }
  }
  return {};
}

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
Outputs run_models(const SpecDecoder& dec, World& w, const StepPlan& plan, bool ngram_drafts = false) {
  const int64_t B = plan.batch, K = plan.k;
  std::vector<Tokens> seen(static_cast<size_t>(B));  // committed ++ proposals so far
  for (int64_t b = 0; b < B; ++b) seen[static_cast<size_t>(b)] = dec.committed(plan.seqs[static_cast<size_t>(b)]);
  Tokens drafts = read<int32_t>(plan, plan.draft_tokens, B * K);
  Outputs o;
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
    o.times.draft_forward.push_back(0.001 * static_cast<double>(j + 1));
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
  const Tokens argmax = forward(w.target, v, ids, seen, target_next);
  CHECK(static_cast<int64_t>(argmax.size()) == B * (K + 1));
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
                  bool ngram_drafts = false) {
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
  order = still;
  CHECK(dec.num_running() == static_cast<int64_t>(order.size()));
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

}  // namespace

int main() {
  test_greedy("draft model", base_config());
  {
    DecoderConfig c = base_config();
    c.draft_max_context = 30;  // rows past it stop drafting
    test_greedy("short draft context", c);
  }
  test_greedy("ngram", ngram_config());
  test_greedy("ngram adaptive", ngram_config(true));
  test_greedy("shared cache", shared_config());
  {
    DecoderConfig c = base_config();
    c.adaptive_k = true;
    test_greedy("draft model adaptive", c);
  }
  test_greedy("plain", plain_config());
  return native_check::check_summary("test_spec_decoder");
}

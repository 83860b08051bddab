#include "verispec/spec_decoder.h"

#include <algorithm>
#include <chrono>
#include <string>

#include "verispec/errors.h"
#include "verispec/nvtx.h"

namespace verispec {

struct SpecDecoder::Sequence {
  int64_t id = 0;
  std::vector<int32_t> tokens;  // committed: prompt + generated
  int64_t prompt_len = 0;
  SamplingParams sampling;
  StopParams stop;
  int64_t target_seq = -1;      // allocator sequence ids (-1 once freed)
  int64_t draft_seq = -1;
  FinishReason finish = FinishReason::kNone;
  SequenceStats stats;
  std::unique_ptr<NGramIndex> ngram;  // n-gram drafter state: the committed tokens
  // Adaptive k: acceptance of a draft model in trackers[0]; of n-gram proposals by
  // the length n of the matched suffix in trackers[n - min_n] (a 4-token match is a far
  // better predictor than a 1-token one). tracker = the one this step uses.
  std::vector<AcceptanceTracker> trackers;
  int64_t tracker = 0;

  int64_t committed() const { return static_cast<int64_t>(tokens.size()); }
  int64_t num_generated() const { return committed() - prompt_len; }
};

namespace {

// Everything a step must restore when it fails halfway.
struct CacheMark {
  int64_t target_len;
  int64_t draft_len;
  std::vector<AcceptanceTracker> trackers;  // choose_k moves probe counters
};

float row_temperature(const SamplingParams& p) { return p.greedy ? 0.0f : p.temperature; }

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

void push_policy(RowPolicy* policy, const SamplingParams& p) {
  policy->temperature.push_back(row_temperature(p));
  policy->top_k.push_back(p.top_k);
  policy->top_p.push_back(p.top_p);
  policy->min_p.push_back(p.min_p);
}

}  // namespace

SpecDecoder::SpecDecoder(const DecoderConfig& config)
    : config_(config),
      target_alloc_(config.target_num_blocks, config.block_size),
      cost_(config.num_spec + 1) {
  if (config.num_spec < 0) {
    throw InvalidArgumentError("SpecDecoder: k must be >= 0, got " +
                               std::to_string(config.num_spec));
  }
  if (config.max_context <= 0) {
    throw InvalidArgumentError("SpecDecoder: max_context must be > 0, got " +
                               std::to_string(config.max_context));
  }
  const bool ngram = config.ngram_min_n > 0;
  if (config.has_draft_model && ngram) {
    throw InvalidArgumentError("SpecDecoder: one draft source at a time: a draft model or n-gram lookup");
  }
  if (ngram) NGramIndex(config.ngram_min_n, config.ngram_max_n);  // validates n
  if (config.draft_shares_target_cache && !config.has_draft_model) {
    throw InvalidArgumentError("SpecDecoder: draft_shares_target_cache needs a draft model");
  }
  if (config.has_draft_model && !config.draft_shares_target_cache) {
    draft_alloc_ = std::make_unique<BlockAllocator>(config.draft_num_blocks, config.block_size);
  } else if (config.has_draft_model) {
    // shared: the draft uses the target's allocator and sequences
  } else if (!ngram && config.num_spec > 0) {
    throw InvalidArgumentError("SpecDecoder: k = " + std::to_string(config.num_spec) +
                               " needs a draft; without one k must be 0 (plain decoding)");
  }
}

SpecDecoder::~SpecDecoder() = default;

SpecDecoder::Sequence& SpecDecoder::get(int64_t seq) {
  return const_cast<Sequence&>(static_cast<const SpecDecoder*>(this)->get(seq));
}

const SpecDecoder::Sequence& SpecDecoder::get(int64_t seq) const {
  if (seq < 0 || seq >= static_cast<int64_t>(seqs_.size()) || !seqs_[static_cast<size_t>(seq)]) {
    throw UnknownSequenceError("SpecDecoder: unknown sequence id " + std::to_string(seq));
  }
  return *seqs_[static_cast<size_t>(seq)];
}

int64_t SpecDecoder::add(const std::vector<int32_t>& prompt, const SamplingParams& sampling,
                         const StopParams& stop, int64_t vocab_size) {
  if (prompt.empty()) throw InvalidArgumentError("add: prompt must hold at least 1 token, got 0");
  for (size_t i = 0; i < prompt.size(); ++i) {
    if (prompt[i] < 0 || prompt[i] >= vocab_size) {
      throw InvalidArgumentError("add: prompt[" + std::to_string(i) + "] must be in [0, " +
                                 std::to_string(vocab_size) + "), got " +
                                 std::to_string(prompt[i]));
    }
  }
  if (static_cast<int64_t>(prompt.size()) >= config_.max_context) {
    throw InvalidArgumentError("add: prompt length must be < the context length " +
                               std::to_string(config_.max_context) + ", got " +
                               std::to_string(prompt.size()));
  }
  if (stop.max_new_tokens <= 0) {
    throw InvalidArgumentError("add: max_new_tokens must be > 0, got " +
                               std::to_string(stop.max_new_tokens));
  }
  if (!sampling.greedy && !(sampling.temperature >= 0.0f)) {
    throw InvalidArgumentError("add: temperature must be >= 0, got " +
                               std::to_string(sampling.temperature));
  }
  if (sampling.top_k < 0) {
    throw InvalidArgumentError("add: top_k must be >= 0, got " + std::to_string(sampling.top_k));
  }
  if (!(sampling.top_p > 0.0f && sampling.top_p <= 1.0f)) {
    throw InvalidArgumentError("add: top_p must be in (0, 1], got " +
                               std::to_string(sampling.top_p));
  }
  if (!(sampling.min_p >= 0.0f && sampling.min_p <= 1.0f)) {
    throw InvalidArgumentError("add: min_p must be in [0, 1], got " +
                               std::to_string(sampling.min_p));
  }
  auto s = std::make_unique<Sequence>();
  s->id = static_cast<int64_t>(seqs_.size());
  s->tokens = prompt;
  s->prompt_len = static_cast<int64_t>(prompt.size());
  s->sampling = sampling;
  s->stop = stop;
  s->target_seq = target_alloc_.add_sequence();
  if (draft_alloc_) s->draft_seq = draft_alloc_->add_sequence();
  if (config_.ngram_min_n > 0) {
    s->ngram = std::make_unique<NGramIndex>(config_.ngram_min_n, config_.ngram_max_n);
    s->ngram->extend(prompt.data(), static_cast<int64_t>(prompt.size()));
  }
  s->trackers.resize(s->ngram ? static_cast<size_t>(config_.ngram_max_n - config_.ngram_min_n + 1)
                              : 1);
  seqs_.push_back(std::move(s));
  return seqs_.back()->id;
}

void SpecDecoder::finish(Sequence& s, FinishReason reason) {
  s.finish = reason;
  if (s.target_seq >= 0) target_alloc_.free(s.target_seq);
  if (s.draft_seq >= 0) draft_alloc_->free(s.draft_seq);
  s.target_seq = s.draft_seq = -1;
}

void SpecDecoder::abort(int64_t seq) {
  Sequence& s = get(seq);
  if (s.finish == FinishReason::kNone) finish(s, FinishReason::kAborted);
}

void SpecDecoder::release(int64_t seq) {
  abort(seq);
  seqs_[static_cast<size_t>(seq)].reset();
}

bool SpecDecoder::has_running() const {
  for (const auto& s : seqs_) {
    if (s && s->finish == FinishReason::kNone) return true;
  }
  return false;
}

std::vector<int64_t> SpecDecoder::running() const {
  std::vector<int64_t> ids;
  for (const auto& s : seqs_) {
    if (s && s->finish == FinishReason::kNone) ids.push_back(s->id);
  }
  return ids;
}

std::vector<int32_t> SpecDecoder::generated(int64_t seq) const {
  const Sequence& s = get(seq);
  return std::vector<int32_t>(s.tokens.begin() + s.prompt_len, s.tokens.end());
}

FinishReason SpecDecoder::finish_reason(int64_t seq) const { return get(seq).finish; }
const SequenceStats& SpecDecoder::stats(int64_t seq) const { return get(seq).stats; }
int64_t SpecDecoder::committed_len(int64_t seq) const { return get(seq).committed(); }
const std::vector<int32_t>& SpecDecoder::committed(int64_t seq) const { return get(seq).tokens; }

std::vector<int32_t> SpecDecoder::block_table(int64_t seq, ModelRole role) const {
  const Sequence& s = get(seq);
  const int64_t id = seq_for(s, role);
  if (id < 0) return {};
  return allocator(role).block_table(id);
}

int64_t SpecDecoder::cache_len(int64_t seq, ModelRole role) const {
  const Sequence& s = get(seq);
  if (role == ModelRole::kDraft && !config_.has_draft_model) return 0;
  const int64_t id = seq_for(s, role);
  return id >= 0 ? allocator(role).length(id) : 0;
}

int64_t SpecDecoder::seq_for(const Sequence& s, ModelRole role) const {
  return role == ModelRole::kDraft && draft_alloc_ ? s.draft_seq : s.target_seq;
}

const BlockAllocator& SpecDecoder::allocator(ModelRole role) const {
  if (role == ModelRole::kDraft) {
    if (!config_.has_draft_model) {
      throw InvalidArgumentError("allocator: this decoder has no draft model");
    }
    if (draft_alloc_) return *draft_alloc_;
  }
  return target_alloc_;
}

int64_t SpecDecoder::choose_k(Sequence& s, std::vector<int32_t>* ngram_proposals) {
  ngram_proposals->clear();
  s.tracker = 0;
  if (!config_.has_draft_model && !s.ngram) return 0;
  // Never propose what could not be emitted: a step emits at most k + 1 tokens, and
  // the verify pass writes positions up to C - 1 + k.
  const int64_t remaining = s.stop.max_new_tokens - s.num_generated();
  const int64_t room = config_.max_context - s.committed();
  int64_t cap = std::max<int64_t>(0, std::min({config_.num_spec, remaining - 1, room - 1}));
  if (s.ngram && cap > 0) {  // deterministic proposals: at most what the lookup found
    int64_t matched_n = 0;
    *ngram_proposals = s.ngram->propose(cap, &matched_n);
    cap = static_cast<int64_t>(ngram_proposals->size());
    if (matched_n > 0) s.tracker = matched_n - config_.ngram_min_n;
  }
  if (!config_.adaptive_k || cap == 0) return cap;
  int64_t k = cap;
  if (shared_cache() && s.committed() - target_alloc_.length(s.target_seq) > 1) {
    // The prompt is not cached yet: the target's prefill fills the shared cache for
    // free, where drafting now would make the draft prefill the prompt itself.
    k = 0;
  } else if (!s.ngram && !cost_.has_draft()) {
    // Measure the draft first: one steady draft pass (one token per row) is enough,
    // the second pass when the first catches the draft's own cache up.
    k = std::min<int64_t>(cap, shared_cache() ? 1 : 2);
  } else {
    // n-gram lookups cost nothing next to a model pass; a draft model is measured.
    const double draft_pass = s.ngram ? 0.0 : cost_.draft_pass();
    const std::vector<double> target_pass = cost_.target_passes();
    AcceptanceTracker& acc = s.trackers[static_cast<size_t>(s.tracker)];
    k = best_k(acc.rate, draft_pass, target_pass, cap);
    if (k > 0) {
      acc.steps_without_drafts = 0;
    } else if (++acc.steps_without_drafts >= probe_interval(draft_pass, target_pass)) {
      acc.steps_without_drafts = 0;  // probe: one step at k = 1
      k = 1;
    }
  }
  if (s.ngram) ngram_proposals->resize(static_cast<size_t>(k));
  return k;
}

void SpecDecoder::build_batch(ModelRole role, const std::vector<Sequence*>& rows,
                              const std::vector<int64_t>& starts,
                              const std::vector<std::vector<int32_t>>& inputs,
                              ForwardBatch* out) {
  BlockAllocator& alloc = alloc_for(role);
  const int64_t B = static_cast<int64_t>(rows.size());
  std::vector<int64_t> seqs(static_cast<size_t>(B)), counts(static_cast<size_t>(B));
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) {
    const Sequence& s = *rows[static_cast<size_t>(b)];
    seqs[static_cast<size_t>(b)] = seq_for(s, role);
    counts[static_cast<size_t>(b)] = static_cast<int64_t>(inputs[static_cast<size_t>(b)].size());
    total += counts[static_cast<size_t>(b)];
  }
  out->role = role;
  out->num_rows = B;
  out->slot_mapping.assign(static_cast<size_t>(total), -1);
  alloc.append_batch(seqs.data(), counts.data(), B, out->slot_mapping.data(), total);
  out->input_ids.clear();
  out->positions.clear();
  out->query_start.assign(1, 0);
  out->context_lens.resize(static_cast<size_t>(B));
  int64_t max_blocks = 1;
  for (int64_t b = 0; b < B; ++b) {
    const auto& in = inputs[static_cast<size_t>(b)];
    for (size_t i = 0; i < in.size(); ++i) {
      out->input_ids.push_back(in[i]);
      out->positions.push_back(starts[static_cast<size_t>(b)] + static_cast<int64_t>(i));
    }
    out->query_start.push_back(static_cast<int64_t>(out->input_ids.size()));
    const int64_t len = alloc.length(seqs[static_cast<size_t>(b)]);
    out->context_lens[static_cast<size_t>(b)] = static_cast<int32_t>(len);
    max_blocks = std::max<int64_t>(
        max_blocks, static_cast<int64_t>(alloc.block_table(seqs[static_cast<size_t>(b)]).size()));
  }
  out->max_blocks = max_blocks;
  out->block_tables.assign(static_cast<size_t>(B * max_blocks), -1);
  alloc.fill_block_tables(seqs.data(), B, out->block_tables.data(), max_blocks, max_blocks);
}

std::vector<StepOutput> SpecDecoder::step(StepRunner& runner) {
  std::vector<Sequence*> rows;
  for (auto& s : seqs_) {
    if (s && s->finish == FinishReason::kNone) rows.push_back(s.get());
  }
  const int64_t B = static_cast<int64_t>(rows.size());
  if (B == 0) return {};
  NvtxRange step_range("verispec.step");
  const auto step_start = Clock::now();
  double t_draft_forward = 0, t_draft_sample = 0, t_target_forward = 0, t_verify = 0;
  double t_draft_steady = 0;         // draft passes j >= 1: one token per row
  int64_t t_draft_steady_passes = 0;
  int64_t verify_tokens = 0, verify_steady_tokens = 0;  // steady: one pending token per row

  std::vector<int64_t> k(static_cast<size_t>(B));
  std::vector<CacheMark> marks(static_cast<size_t>(B));
  int64_t K = 0;
  std::vector<std::vector<int32_t>> proposals(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) {
    Sequence& s = *rows[static_cast<size_t>(b)];
    const int64_t target_len = target_alloc_.length(s.target_seq);
    marks[static_cast<size_t>(b)] = {
        target_len, draft_alloc_ ? draft_alloc_->length(s.draft_seq) : target_len, s.trackers};
    k[static_cast<size_t>(b)] = choose_k(s, &proposals[static_cast<size_t>(b)]);
    K = std::max(K, k[static_cast<size_t>(b)]);
  }
  // One offset per kernel call of this step: verify at base, draft position j at
  // base + 1 + j (the Philox layout itself lives in philox.h).
  const uint64_t base_offset = offset_;
  VerifyResult result;
  try {
    // ---- draft phase: K passes; row b takes part in the first k[b] of them.
    ForwardBatch batch;
    const bool draft_model = config_.has_draft_model;
    for (int64_t j = 0; draft_model && j < K; ++j) {
      std::vector<Sequence*> active;
      std::vector<int32_t> verify_rows;
      std::vector<int64_t> starts;
      std::vector<std::vector<int32_t>> inputs;
      RowPolicy policy;
      for (int64_t b = 0; b < B; ++b) {
        if (k[static_cast<size_t>(b)] <= j) continue;
        Sequence& s = *rows[static_cast<size_t>(b)];
        active.push_back(&s);
        verify_rows.push_back(static_cast<int32_t>(b));
        push_policy(&policy, s.sampling);
        if (j == 0) {  // catch up: committed[draft cache_len:]
          const int64_t from = marks[static_cast<size_t>(b)].draft_len;
          starts.push_back(from);
          inputs.emplace_back(s.tokens.begin() + from, s.tokens.end());
        } else {
          starts.push_back(s.committed() + j - 1);
          inputs.push_back({proposals[static_cast<size_t>(b)].back()});
        }
      }
      build_batch(ModelRole::kDraft, active, starts, inputs, &batch);
      const bool steady = static_cast<int64_t>(batch.input_ids.size()) ==
                          static_cast<int64_t>(active.size());  // one input per row
      runner.copy_blocks(ModelRole::kDraft, alloc_for(ModelRole::kDraft).take_block_copies());
      batch.logits_indices.assign(batch.query_start.begin() + 1, batch.query_start.end());
      for (auto& idx : batch.logits_indices) idx -= 1;  // last input of each row
      auto t0 = Clock::now();
      {
        NvtxRange range("verispec.draft_forward");
        runner.forward(batch);
      }
      const double t_fwd = seconds_since(t0);
      t0 = Clock::now();
      std::vector<int32_t> drawn;
      {
        NvtxRange range("verispec.draft_sample");
        drawn = runner.sample_draft(B, K, j, verify_rows, policy, config_.seed,
                                    base_offset + 1 + j);
      }
      const double t_smp = seconds_since(t0);
      t_draft_forward += t_fwd;
      t_draft_sample += t_smp;
      if (steady) {
        t_draft_steady += t_fwd + t_smp;
        ++t_draft_steady_passes;
      }
      for (size_t r = 0; r < active.size(); ++r) {
        proposals[static_cast<size_t>(verify_rows[r])].push_back(drawn[r]);
      }
    }

    // ---- verify phase: one target pass over committed[target cache_len:] ++ proposals.
    if (shared_cache() && K > 0) {  // drop the draft's K/V: the target rewrites them
      for (int64_t b = 0; b < B; ++b) {
        target_alloc_.rollback(rows[static_cast<size_t>(b)]->target_seq,
                               marks[static_cast<size_t>(b)].target_len);
      }
    }
    std::vector<int64_t> starts(static_cast<size_t>(B));
    std::vector<std::vector<int32_t>> inputs(static_cast<size_t>(B));
    VerifyRequest req;
    req.batch = B;
    req.num_spec = K;
    req.draft_tokens.assign(static_cast<size_t>(B * K), -1);
    req.num_draft.resize(static_cast<size_t>(B));
    req.use_draft_probs = K > 0 && config_.has_draft_model;
    req.seed = config_.seed;
    req.offset = base_offset;
    for (int64_t b = 0; b < B; ++b) {
      Sequence& s = *rows[static_cast<size_t>(b)];
      const int64_t from = marks[static_cast<size_t>(b)].target_len;
      starts[static_cast<size_t>(b)] = from;
      auto& in = inputs[static_cast<size_t>(b)];
      in.assign(s.tokens.begin() + from, s.tokens.end());
      const auto& p = proposals[static_cast<size_t>(b)];
      in.insert(in.end(), p.begin(), p.end());
      std::copy(p.begin(), p.end(), req.draft_tokens.begin() + b * K);
      req.num_draft[static_cast<size_t>(b)] = static_cast<int32_t>(p.size());
      push_policy(&req.policy, s.sampling);
    }
    build_batch(ModelRole::kTarget, rows, starts, inputs, &batch);
    verify_tokens = static_cast<int64_t>(batch.input_ids.size());
    for (int64_t b = 0; b < B; ++b) verify_steady_tokens += k[static_cast<size_t>(b)] + 1;
    runner.copy_blocks(ModelRole::kTarget, target_alloc_.take_block_copies());
    // Logits rows laid out [B, K + 1]: row b's position i is its (pending - 1 + i)-th
    // input; positions past k[b] repeat the last one (padding the kernel never reads).
    batch.logits_indices.clear();
    for (int64_t b = 0; b < B; ++b) {
      const int64_t first = batch.query_start[static_cast<size_t>(b + 1)] - 1 -
                            k[static_cast<size_t>(b)];
      for (int64_t i = 0; i <= K; ++i) {
        batch.logits_indices.push_back(first + std::min(i, k[static_cast<size_t>(b)]));
      }
    }
    auto t0 = Clock::now();
    {
      NvtxRange range("verispec.target_forward");
      runner.forward(batch);
    }
    t_target_forward = seconds_since(t0);
    t0 = Clock::now();
    {
      NvtxRange range("verispec.verify");
      result = runner.verify(req);
    }
    t_verify = seconds_since(t0);
  } catch (...) {
    // Leave every sequence as it was: only cache lengths and the adaptive-k probe
    // counters moved (neither restore can fail).
    for (int64_t b = 0; b < B; ++b) {
      Sequence& s = *rows[static_cast<size_t>(b)];
      s.trackers = std::move(marks[static_cast<size_t>(b)].trackers);
      target_alloc_.rollback(s.target_seq, marks[static_cast<size_t>(b)].target_len);
      if (draft_alloc_) draft_alloc_->rollback(s.draft_seq, marks[static_cast<size_t>(b)].draft_len);
    }
    throw;
  }
  offset_ = base_offset + static_cast<uint64_t>(K) + 1;
  // Feed the cost model steady-state passes only: a prefill or a catch-up of many
  // tokens would make a pass look far dearer than the decode passes k is chosen for.
  if (config_.has_draft_model && t_draft_steady_passes > 0) {
    cost_.observe_draft(t_draft_steady / static_cast<double>(t_draft_steady_passes));
  }
  if (verify_tokens == verify_steady_tokens) cost_.observe_target(K + 1, t_target_forward + t_verify);

  // ---- commit
  NvtxRange commit_range("verispec.commit");
  std::vector<StepOutput> outputs(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) {
    Sequence& s = *rows[static_cast<size_t>(b)];
    const int64_t C = s.committed();
    const int64_t kb = k[static_cast<size_t>(b)];
    const int64_t a = result.num_accepted[static_cast<size_t>(b)];
    const int64_t n = result.num_emitted[static_cast<size_t>(b)];
    const int32_t* emitted = result.tokens.data() + b * (K + 1);
    FinishReason reason;
    const std::vector<int32_t> generated(s.tokens.begin() + s.prompt_len, s.tokens.end());
    const int64_t keep = apply_stop_rules(s.stop, generated, emitted, n, s.prompt_len,
                                          config_.max_context, &reason);
    s.tokens.insert(s.tokens.end(), emitted, emitted + keep);
    if (s.ngram) s.ngram->extend(emitted, keep);

    SequenceStats& st = s.stats;
    st.steps += 1;
    if (config_.has_draft_model) st.draft_forwards += kb;
    st.proposed += kb;
    st.accepted += a;
    st.emitted += keep;
    st.k_history.push_back(static_cast<int32_t>(kb));
    if (static_cast<int64_t>(st.proposed_at.size()) < kb) {
      st.proposed_at.resize(static_cast<size_t>(kb), 0);
      st.accepted_at.resize(static_cast<size_t>(kb), 0);
    }
    for (int64_t j = 0; j < kb; ++j) {
      st.proposed_at[static_cast<size_t>(j)] += 1;
      if (j < a) st.accepted_at[static_cast<size_t>(j)] += 1;
    }

    s.trackers[static_cast<size_t>(s.tracker)].update(kb, a);
    st.acceptance_estimate.resize(s.trackers.size());
    for (size_t i = 0; i < s.trackers.size(); ++i) st.acceptance_estimate[i] = s.trackers[i].rate;

    StepOutput& o = outputs[static_cast<size_t>(b)];
    o.seq = s.id;
    o.new_tokens.assign(emitted, emitted + keep);
    if (reason != FinishReason::kNone) {
      finish(s, reason);
    } else {
      // What the committed tokens justify: the target cached C + k positions, of which
      // C + a hold accepted tokens; the draft cached up to C + k - 1.
      target_alloc_.rollback(s.target_seq, C + a);
      if (draft_alloc_) {
        draft_alloc_->rollback(s.draft_seq, std::min(draft_alloc_->length(s.draft_seq), C + a));
      }
    }
    o.finish = s.finish;
  }
  const double total = seconds_since(step_start);
  times_.draft_forward += t_draft_forward;
  times_.draft_sample += t_draft_sample;
  times_.target_forward += t_target_forward;
  times_.verify += t_verify;
  times_.bookkeeping += total - t_draft_forward - t_draft_sample - t_target_forward - t_verify;
  times_.steps += 1;
  return outputs;
}

}  // namespace verispec

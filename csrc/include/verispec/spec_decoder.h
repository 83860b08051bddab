// SpecDecoder: sequences, the draft -> verify -> commit loop, stop rules, statistics.
//
// Pure C++: the decoder never touches a tensor. It prepares each model's batch as host
// integer buffers, and asks a StepRunner (implemented by the binding layer, which
// owns the models, the KV pools and the kernels) to run forwards, sample draft
// proposals and verify. The decisions are all here: how far to speculate, what each
// model reads next, what is committed, where sequences stop, how the caches roll back.
//
// Per sequence, per model:   committed = prompt + generated tokens
//                            cache_len = how many of them the model's KV cache holds
// The next input of a model is always committed[cache_len:] (then its own proposals),
// so "the draft lags by one after a full accept" needs no special case.
//
//   step, for a row with C committed tokens, target cache Lt, draft cache Ld, k drafts:
//     draft j = 0:   committed[Ld:C]            -> proposal d1   (logits of the last input)
//     draft j >= 1:  d_j at position C + j - 1  -> proposal d_{j+1}
//     verify:        committed[Lt:C] ++ d1..dk  -> logits at C-1 .. C-1+k
//     commit a accepted + 1 correction/bonus; then
//       target cache = C + a                (the rest held rejected proposals)
//       draft cache  = min(C + k - 1, C + a)
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "verispec/adaptive_k.h"
#include "verispec/block_allocator.h"
#include "verispec/ngram.h"

namespace verispec {

enum class ModelRole : int32_t { kTarget = 0, kDraft = 1 };

// How a sequence samples; identical for target and draft (DESIGN.md).
struct SamplingParams {
  bool greedy = false;        // argmax decoding (also implied by temperature == 0)
  float temperature = 1.0f;
  int32_t top_k = 0;
  float top_p = 1.0f;
  float min_p = 0.0f;
};

// Where a sequence stops (stop_rules.cpp is the one place that applies these).
struct StopParams {
  int64_t max_new_tokens = 0;
  std::vector<int32_t> eos_ids;
  std::vector<std::vector<int32_t>> stop_sequences;
};

enum class FinishReason : int32_t {
  kNone = 0,      // still running
  kEos = 1,       // emitted an EOS id (kept as the last token)
  kStop = 2,      // emitted a stop sequence (kept as the last tokens)
  kLength = 3,    // max_new_tokens reached
  kContext = 4,   // the model's context length reached
  kAborted = 5,   // removed by the caller
};
const char* finish_reason_name(FinishReason r);

// Applies the stop rules to `tokens` emitted after `generated` (the tokens generated
// so far, not the prompt). Returns how many of `tokens` are kept and sets *reason.
// An EOS or a completed stop sequence ends the sequence right after it; tokens after
// it are dropped. max_new_tokens and max_total (context) cut exactly.
int64_t apply_stop_rules(const StopParams& stop, const std::vector<int32_t>& generated,
                         const int32_t* tokens, int64_t n, int64_t prompt_len,
                         int64_t max_context, FinishReason* reason);

struct SequenceStats {
  int64_t steps = 0;            // verify (target) passes that included this sequence
  int64_t draft_forwards = 0;   // draft model passes that included this sequence
  int64_t proposed = 0;         // draft tokens sent to verification
  int64_t accepted = 0;         // of those, accepted
  int64_t emitted = 0;          // tokens committed (accepted + corrections/bonus, after stops)
  std::vector<int64_t> proposed_at;  // by draft position j
  std::vector<int64_t> accepted_at;  // by draft position j
  std::vector<int32_t> k_history;    // k chosen at each step
  // Adaptive k's current acceptance estimates: [draft model], or n-gram proposals by
  // the length of the matched suffix [min_n .. max_n].
  std::vector<double> acceptance_estimate;
};

// One model forward: T new tokens of B rows, flattened; host buffers.
struct ForwardBatch {
  ModelRole role = ModelRole::kTarget;
  int64_t num_rows = 0;
  std::vector<int64_t> input_ids;       // [T]
  std::vector<int64_t> positions;       // [T]
  std::vector<int32_t> slot_mapping;    // [T]
  int64_t max_blocks = 0;
  std::vector<int32_t> block_tables;    // [B, max_blocks], -1 padded
  std::vector<int32_t> context_lens;    // [B] cached length after this forward
  std::vector<int64_t> query_start;     // [B + 1]
  std::vector<int64_t> logits_indices;  // [R] flattened token index per logits row
};

// Per-row policy of a verify or draft-sampling call.
struct RowPolicy {
  std::vector<float> temperature;  // 0 for greedy rows
  std::vector<int32_t> top_k;
  std::vector<float> top_p;
  std::vector<float> min_p;
};

struct VerifyRequest {
  int64_t batch = 0;
  int64_t num_spec = 0;                 // K: logits are [batch, K + 1] rows, padded
  std::vector<int32_t> draft_tokens;    // [batch, K], -1 padded
  std::vector<int32_t> num_draft;       // [batch]
  bool use_draft_probs = false;         // q from sampled drafts; false: one-hot q
  RowPolicy policy;
  uint64_t seed = 0;
  uint64_t offset = 0;
};

struct VerifyResult {
  std::vector<int32_t> tokens;          // [batch, K + 1], -1 padded
  std::vector<int32_t> num_emitted;     // [batch]
  std::vector<int32_t> num_accepted;    // [batch]
};

// What the decoder needs from the world of tensors (implemented by the binding).
class StepRunner {
 public:
  virtual ~StepRunner() = default;
  // Performs the allocator's copy-on-write copies on model `role`'s KV pools. Called
  // before any forward that writes the copied blocks.
  virtual void copy_blocks(ModelRole role, const std::vector<BlockCopy>& copies) = 0;
  // Runs model `batch.role` on the batch, keeping its logits ([R, V] rows in
  // batch.logits_indices order) until the next forward of that role.
  virtual void forward(const ForwardBatch& batch) = 0;
  // From the draft's last logits (row r belongs to verify row rows[r]), applies the
  // policy, samples one proposal per row with (seed, offset), stores the draft
  // distribution q at [rows[r], position] of a [batch, K, V] buffer for verify, and
  // returns the proposals.
  virtual std::vector<int32_t> sample_draft(int64_t batch, int64_t num_spec, int64_t position,
                                            const std::vector<int32_t>& rows,
                                            const RowPolicy& policy, uint64_t seed,
                                            uint64_t offset) = 0;
  // Verifies with the target's last logits laid out as [batch, K + 1].
  virtual VerifyResult verify(const VerifyRequest& request) = 0;
};

struct DecoderConfig {
  int64_t num_spec = 4;             // fixed k (0: plain decoding), or the largest k
  bool adaptive_k = false;          // choose k per sequence and step (adaptive_k.h)
  bool has_draft_model = false;     // a draft model proposes (sampled, q kept)
  // The draft model reads and writes the target's KV cache (early-exit
  // self-speculation: its layers are the target's first layers, so the K/V the target
  // wrote for committed tokens are exactly what the draft would write). The draft then
  // has no cache of its own and never catches up; its proposals' K/V are dropped
  // before the verify pass rewrites those positions.
  bool draft_shares_target_cache = false;
  int64_t ngram_min_n = 0;          // > 0: n-gram prompt lookup proposes (one-hot q)
  int64_t ngram_max_n = 0;
  int64_t target_num_blocks = 0;
  int64_t draft_num_blocks = 0;
  int64_t block_size = 16;
  int64_t max_context = 0;          // the target's context length
  uint64_t seed = 0;
};

// Wall time by phase, summed over steps (seconds).
struct PhaseTimes {
  double draft_forward = 0;   // draft model passes
  double draft_sample = 0;    // policy + sampling of proposals
  double target_forward = 0;  // the verify pass of the target
  double verify = 0;          // the verify op
  double bookkeeping = 0;     // everything else: k, batches, commit, rollback
  int64_t steps = 0;
};

struct StepOutput {
  int64_t seq;
  std::vector<int32_t> new_tokens;
  FinishReason finish = FinishReason::kNone;
};

class SpecDecoder {
 public:
  explicit SpecDecoder(const DecoderConfig& config);
  ~SpecDecoder();
  SpecDecoder(const SpecDecoder&) = delete;
  SpecDecoder& operator=(const SpecDecoder&) = delete;

  // Adds a sequence (continuous batching: any time between steps). Validates the
  // prompt against the vocabulary and the context length. Returns its id.
  int64_t add(const std::vector<int32_t>& prompt, const SamplingParams& sampling,
              const StopParams& stop, int64_t vocab_size);
  // Ends a sequence now (finish reason kAborted if it was running) and frees its
  // cache blocks; its record stays until release().
  void abort(int64_t seq);
  // Forgets a sequence (any state); KeyError-like for an unknown id.
  void release(int64_t seq);

  // One speculative step over every running sequence. Returns, for each of them, the
  // tokens committed in this step. On an exception (cache full, runner error) every
  // sequence and both caches are exactly as before the step.
  std::vector<StepOutput> step(StepRunner& runner);

  // Restarts the random stream: seed, and offset 0 (reproducible runs).
  void reseed(uint64_t seed) {
    config_.seed = seed;
    offset_ = 0;
  }

  bool has_running() const;
  std::vector<int64_t> running() const;
  std::vector<int32_t> generated(int64_t seq) const;
  FinishReason finish_reason(int64_t seq) const;
  const SequenceStats& stats(int64_t seq) const;
  int64_t cache_len(int64_t seq, ModelRole role) const;
  int64_t committed_len(int64_t seq) const;
  // The committed tokens (prompt + generated) and a model's block table.
  const std::vector<int32_t>& committed(int64_t seq) const;
  std::vector<int32_t> block_table(int64_t seq, ModelRole role) const;
  const BlockAllocator& allocator(ModelRole role) const;
  const DecoderConfig& config() const { return config_; }
  uint64_t offset() const { return offset_; }
  const PhaseTimes& times() const { return times_; }
  const CostModel& cost_model() const { return cost_; }

 private:
  struct Sequence;
  Sequence& get(int64_t seq);
  const Sequence& get(int64_t seq) const;
  void finish(Sequence& s, FinishReason reason);
  // k for this step; n-gram proposals are looked up here too (k = their count).
  int64_t choose_k(Sequence& s, std::vector<int32_t>* ngram_proposals);
  bool shared_cache() const { return config_.draft_shares_target_cache; }
  BlockAllocator& alloc_for(ModelRole role) {
    return role == ModelRole::kDraft && draft_alloc_ ? *draft_alloc_ : target_alloc_;
  }
  int64_t seq_for(const Sequence& s, ModelRole role) const;
  void build_batch(ModelRole role, const std::vector<Sequence*>& rows,
                   const std::vector<int64_t>& counts,
                   const std::vector<std::vector<int32_t>>& extra_tokens,
                   ForwardBatch* out);

  DecoderConfig config_;
  BlockAllocator target_alloc_;
  std::unique_ptr<BlockAllocator> draft_alloc_;
  std::vector<std::unique_ptr<Sequence>> seqs_;  // by id; null after release
  uint64_t offset_ = 0;
  PhaseTimes times_;
  CostModel cost_;
};

}  // namespace verispec

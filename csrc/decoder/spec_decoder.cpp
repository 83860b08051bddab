#include "verispec/spec_decoder.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>

#include "verispec/errors.h"
#include "verispec/nvtx.h"
#include "verispec/policy_rules.h"

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
  bool in_step = false;         // a row of the open step
  uint64_t arrival = 0;         // add order
  int64_t priority = 0;         // higher first; with arrival, the queue's and preemption's order
  SequenceStats stats;
  std::unique_ptr<NGramIndex> ngram;  // n-gram drafter state: the committed tokens
  // Adaptive k: acceptance of a draft model in trackers[0]; of n-gram proposals by
  // the length n of the matched suffix in trackers[n - min_n] (a 4-token match is a far
  // better predictor than a 1-token one). tracker = the one this step uses.
  std::vector<AcceptanceTracker> trackers;
  int64_t tracker = 0;
  // Draft trees: how often a sibling was accepted where the spine node was rejected, and
  // how many steps proposed a tree.
  AcceptanceTracker sibling;
  int64_t tree_steps = 0;
  // n-gram tries under adaptive k: how often the target took the most recent
  // continuation's token where the continuations disagreed (adaptive_k.h, r).
  AcceptanceTracker recent;

  int64_t committed() const { return static_cast<int64_t>(tokens.size()); }
  int64_t num_generated() const { return committed() - prompt_len; }
};

// One forward pass as it is built, before packing.
struct Pass {
  ModelRole role = ModelRole::kTarget;
  std::vector<int64_t> input_ids, positions, query_start, logits_indices, rows, draft_index,
      prev_index, fill_positions, fill_sources, num_children, q_index;
  std::vector<int32_t> slot_mapping, block_tables, context_lens;
  std::vector<uint8_t> tree_mask;  // [T, T] when the pass carries a branching tree
  int64_t max_blocks = 1;
  bool steady = false;  // one new token per row: what the cost model learns from
};

// Everything a step must restore when it fails, and what it decided.
struct SpecDecoder::OpenStep {
  uint64_t id = 0;
  std::vector<Sequence*> rows;        // verify rows; stable: a row's release is queued until the step ends
  std::vector<int64_t> k;             // per row
  int64_t K = 0;
  std::vector<int64_t> target_mark, draft_mark;
  std::vector<std::vector<AcceptanceTracker>> tracker_mark;  // choose_ks moves probe counters
  // prefill rows: a chunk of their uncached tokens goes through the verify pass
  std::vector<Sequence*> prefill;
  std::vector<int64_t> prefill_chunk, prefill_mark;
  std::vector<std::vector<int32_t>> proposals;  // n-gram proposals (known on the host)
  std::vector<std::vector<int32_t>> parents;    // tree steps: each proposal's parent node
  std::vector<std::vector<double>> freqs;       // n-gram trie rows under adaptive k: each
                                                // proposal's share (NGramIndex::propose_tree)
  std::vector<std::vector<bool>> recent;        // and whether it is on the most recent continuation
  bool tree = false;                  // verified as trees (ops.verify_tree)
  bool draft_tree = false;            // a draft model proposes trees (draft_branches > 1)
  std::vector<int64_t> fanout;        // draft trees: children per expanded node (1: a chain row)
  std::vector<int64_t> admitted;      // admitted from the queue by this step's begin_step
  uint64_t base_offset = 0;
  std::vector<Pass> passes;           // draft passes, then the verify pass
  int64_t verify_tokens = 0;          // T of the verify pass, prefill chunks included
  // filled by check_outputs, used by commit_row
  std::vector<int64_t> keep;
  std::vector<FinishReason> reason;
  std::vector<int32_t> drafts;        // [B, K] the proposals verified
  // calls queued while the step is open
  std::vector<int64_t> pending_abort, pending_release;
};

namespace {

void check_sampling(const SamplingParams& p) {
  const std::string error = policy_error(p.temperature, p.top_k, p.top_p, p.min_p);
  if (!error.empty()) throw InvalidArgumentError("add: " + error);
}

// Appends `v` to the byte buffer at an 8-byte aligned offset; returns that offset.
template <typename T>
int64_t put(std::vector<uint8_t>* buf, const std::vector<T>& v) {
  const size_t at = (buf->size() + 7) / 8 * 8;
  buf->resize(at + v.size() * sizeof(T));
  if (!v.empty()) std::memcpy(buf->data() + at, v.data(), v.size() * sizeof(T));
  return static_cast<int64_t>(at);
}

std::string row_at(int64_t b, int64_t i) {
  return "[" + std::to_string(b) + ", " + std::to_string(i) + "]";
}

}  // namespace

SpecDecoder::SpecDecoder(const DecoderConfig& config)
    : config_(config),
      target_alloc_(config.target_num_blocks, config.block_size),
      cost_() {
  if (config.k < 0 || config.k > kMaxK) {
    throw InvalidArgumentError("SpecDecoder: k must be in [0, " + std::to_string(kMaxK) +
                               "], got " + std::to_string(config.k));
  }
  if (config.max_context <= 0) {
    throw InvalidArgumentError("SpecDecoder: max_context must be > 0, got " +
                               std::to_string(config.max_context));
  }
  if (config.max_num_seqs < 0) {
    throw InvalidArgumentError("SpecDecoder: max_num_seqs must be >= 0 (0: no limit), got " +
                               std::to_string(config.max_num_seqs));
  }
  if (config.max_tokens_per_step < 0) {
    throw InvalidArgumentError(
        "SpecDecoder: max_tokens_per_step must be 0 (no limit) or >= 1, got " +
        std::to_string(config.max_tokens_per_step));
  }
  if (config.draft_max_context < 0) {
    throw InvalidArgumentError("SpecDecoder: draft_max_context must be >= 0, got " +
                               std::to_string(config.draft_max_context));
  }
  if (config.vocab_size < 1 || config.vocab_size > (int64_t{1} << 31) - 1) {
    throw InvalidArgumentError("SpecDecoder: vocab_size must be in [1, 2^31), got " +
                               std::to_string(config.vocab_size));
  }
  const bool ngram = config.ngram_min_n > 0;
  if (config.has_draft_model && ngram) {
    throw InvalidArgumentError("SpecDecoder: one draft source at a time: a draft model or n-gram lookup");
  }
  if (ngram) NGramIndex(config.ngram_min_n, config.ngram_max_n);  // validates n
  if (config.ngram_branches < 1 || config.ngram_branches > kMaxK) {
    throw InvalidArgumentError("SpecDecoder: ngram_branches must be in [1, " + std::to_string(kMaxK) +
                               "], got " + std::to_string(config.ngram_branches));
  }
  if (config.ngram_branches > 1 && !ngram) {
    throw InvalidArgumentError("SpecDecoder: ngram_branches = " + std::to_string(config.ngram_branches) +
                               " (trees) needs n-gram drafting (ngram_min_n > 0)");
  }
  if (config.draft_branches < 1 || config.draft_branches > kMaxK) {
    throw InvalidArgumentError("SpecDecoder: draft_branches must be in [1, " + std::to_string(kMaxK) +
                               "], got " + std::to_string(config.draft_branches));
  }
  if (config.draft_branches > 1 && !config.has_draft_model) {
    throw InvalidArgumentError("SpecDecoder: draft_branches = " + std::to_string(config.draft_branches) +
                               " (draft trees) needs a draft model (has_draft_model)");
  }
  if (config.draft_shares_target_cache && !config.has_draft_model) {
    throw InvalidArgumentError("SpecDecoder: draft_shares_target_cache needs a draft model");
  }
  if (config.draft_reads_target && (!config.has_draft_model || config.draft_shares_target_cache)) {
    throw InvalidArgumentError(
        "SpecDecoder: draft_reads_target needs a draft model with a cache of its own "
        "(has_draft_model and not draft_shares_target_cache)");
  }
  if (config.has_draft_model && !config.draft_shares_target_cache) {
    draft_alloc_ = std::make_unique<BlockAllocator>(config.draft_num_blocks, config.block_size);
  } else if (config.has_draft_model) {
    // shared: the draft uses the target's allocator and sequences
  } else if (!ngram && config.k > 0) {
    throw InvalidArgumentError("SpecDecoder: k = " + std::to_string(config.k) +
                               " needs a draft; without one k must be 0 (plain decoding)");
  }
  if (config_.draft_max_context == 0) config_.draft_max_context = config_.max_context;
  // one acceptance tracker per n-gram match length (n-gram drafting), else one
  population_.resize(ngram ? static_cast<size_t>(config.ngram_max_n - config.ngram_min_n + 1) : 1);
}

SpecDecoder::~SpecDecoder() = default;

// ---- sequences --------------------------------------------------------------------

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
                         const StopParams& stop, int64_t priority,
                         const std::vector<int32_t>& ngram_context) {
  std::lock_guard<std::mutex> lock(mu_);
  if (prompt.empty()) throw InvalidArgumentError("add: prompt must hold at least 1 token, got 0");
  if (!ngram_context.empty() && config_.ngram_min_n <= 0) {
    throw InvalidArgumentError("add: ngram_context needs n-gram drafting, got " +
                               std::to_string(ngram_context.size()) + " tokens without it");
  }
  for (size_t i = 0; i < ngram_context.size(); ++i) {
    if (ngram_context[i] < NGramIndex::kSeparator || ngram_context[i] >= config_.vocab_size) {
      throw InvalidArgumentError("add: ngram_context[" + std::to_string(i) + "] must be in [-1, " +
                                 std::to_string(config_.vocab_size) + ") (-1: a separator), got " +
                                 std::to_string(ngram_context[i]));
    }
  }
  for (size_t i = 0; i < prompt.size(); ++i) {
    if (prompt[i] < 0 || prompt[i] >= config_.vocab_size) {
      throw InvalidArgumentError("add: prompt[" + std::to_string(i) + "] must be in [0, " +
                                 std::to_string(config_.vocab_size) + "), got " +
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
  for (size_t i = 0; i < stop.eos_ids.size(); ++i) {
    if (stop.eos_ids[i] < 0) {  // an id past the vocabulary is allowed: it never matches
      throw InvalidArgumentError("add: eos_token_id[" + std::to_string(i) + "] must be >= 0, got " +
                                 std::to_string(stop.eos_ids[i]));
    }
  }
  for (size_t i = 0; i < stop.stop_sequences.size(); ++i) {
    if (stop.stop_sequences[i].empty()) {
      throw InvalidArgumentError("add: stop[" + std::to_string(i) + "] must hold at least 1 token, got 0");
    }
  }
  check_sampling(sampling);
  auto s = std::make_unique<Sequence>();
  s->tokens = prompt;
  s->prompt_len = static_cast<int64_t>(prompt.size());
  s->sampling = sampling;
  s->stop = stop;
  if (config_.ngram_min_n > 0) {
    s->ngram = std::make_unique<NGramIndex>(config_.ngram_min_n, config_.ngram_max_n);
    if (!ngram_context.empty()) {
      s->ngram->extend(ngram_context.data(), static_cast<int64_t>(ngram_context.size()));
      s->ngram->append(NGramIndex::kSeparator);
    }
    s->ngram->extend(prompt.data(), static_cast<int64_t>(prompt.size()));
  }
  for (const AcceptanceTracker& pop : population_) s->trackers.push_back(AcceptanceTracker::seeded_by(pop));
  s->sibling = AcceptanceTracker::seeded_by(population_sibling_);
  s->recent = AcceptanceTracker::seeded_by(population_recent_);
  // Reserve the id slot and the running entry before touching the allocators, so that
  // nothing below can fail after an allocator sequence exists.
  if (free_ids_.empty()) seqs_.emplace_back();
  waiting_.reserve(waiting_.size() + 1);
  running_.reserve(running_.size() + waiting_.size() + 1);
  const int64_t id = free_ids_.empty() ? static_cast<int64_t>(seqs_.size()) - 1 : free_ids_.back();
  s->id = id;
  s->target_seq = target_alloc_.add_sequence();
  if (draft_alloc_) s->draft_seq = draft_alloc_->add_sequence();
  if (!free_ids_.empty()) free_ids_.pop_back();
  s->arrival = next_arrival_++;
  s->priority = priority;
  seqs_[static_cast<size_t>(id)] = std::move(s);
  enqueue(id);  // behind every sequence of its priority or higher (reserved above)
  return id;
}

bool SpecDecoder::ahead(int64_t a, int64_t b) const {
  const Sequence& x = get(a);
  const Sequence& y = get(b);
  return x.priority != y.priority ? x.priority > y.priority : x.arrival < y.arrival;
}

// Inserts `seq` into `order` (a list in rank order) at its rank.
void SpecDecoder::insert_ranked(std::vector<int64_t>* order, int64_t seq) const {
  auto at = std::find_if(order->begin(), order->end(), [&](int64_t w) { return ahead(seq, w); });
  order->insert(at, seq);
}

void SpecDecoder::enqueue(int64_t seq) { insert_ranked(&waiting_, seq); }

std::vector<int64_t> SpecDecoder::admit() {
  std::vector<int64_t> admitted;
  // Every decoding sequence takes at least one token of a step, so at most
  // max_tokens_per_step of them run.
  size_t limit = std::numeric_limits<size_t>::max();
  if (config_.max_num_seqs > 0) limit = static_cast<size_t>(config_.max_num_seqs);
  if (config_.max_tokens_per_step > 0) {
    limit = std::min(limit, static_cast<size_t>(config_.max_tokens_per_step));
  }
  while (!waiting_.empty()) {
    const int64_t seq = waiting_.front();
    // A head that outranks the last running sequence (a higher priority) takes its place
    // when there is no room: that one is preempted, as when blocks run out.
    const bool outranks = !running_.empty() && ahead(seq, running_.back());
    if (running_.size() >= limit) {
      if (!outranks) break;
      preempt_newest();
      continue;
    }
    // In rank order: the head waits (and so does everyone behind it) while its whole
    // context plus a step's drafts would not fit the free blocks; with nothing running
    // it is admitted anyway, so a sequence that can never fit gets its CacheFullError.
    const Sequence& head = get(seq);
    const int64_t need = head.committed() + config_.k + 1;
    const bool fits =
        target_alloc_.blocks_needed(head.target_seq, need - target_alloc_.length(head.target_seq)) <=
            target_alloc_.num_free_blocks() &&
        (!draft_alloc_ ||
         draft_alloc_->blocks_needed(head.draft_seq, need - draft_alloc_->length(head.draft_seq)) <=
             draft_alloc_->num_free_blocks());
    if (!fits && !running_.empty()) {
      if (!outranks) break;
      preempt_newest();
      continue;
    }
    waiting_.erase(waiting_.begin());
    insert_ranked(&running_, seq);
    admitted.push_back(seq);
  }
  return admitted;
}

void SpecDecoder::unadmit(const std::vector<int64_t>& seqs) {
  for (int64_t seq : seqs) {
    auto it = std::find(running_.begin(), running_.end(), seq);
    if (it == running_.end()) continue;  // preempted (queued already) or finished
    running_.erase(it);
    enqueue(seq);
  }
}

void SpecDecoder::preempt_newest() {
  const int64_t seq = running_.back();  // the last in rank: lowest priority, then newest
  running_.pop_back();
  Sequence& s = get(seq);
  const bool held = target_alloc_.length(s.target_seq) > 0 ||
                    (draft_alloc_ && draft_alloc_->length(s.draft_seq) > 0);
  target_alloc_.rollback(s.target_seq, 0);
  if (draft_alloc_) draft_alloc_->rollback(s.draft_seq, 0);
  if (held) {  // a preemption frees a cache; sending back one admitted just now is not one
    ++s.stats.preemptions;
    ++preemptions_;
  }
  enqueue(seq);
}

void SpecDecoder::finish(Sequence& s, FinishReason reason) {
  s.finish = reason;
  if (s.target_seq >= 0) target_alloc_.free(s.target_seq);
  if (s.draft_seq >= 0) draft_alloc_->free(s.draft_seq);
  s.target_seq = s.draft_seq = -1;
  auto it = std::find(running_.begin(), running_.end(), s.id);
  if (it != running_.end()) running_.erase(it);
  auto w = std::find(waiting_.begin(), waiting_.end(), s.id);
  if (w != waiting_.end()) waiting_.erase(w);
}

bool SpecDecoder::in_open_step(int64_t seq) const { return open_ && get(seq).in_step; }

void SpecDecoder::abort_now(int64_t seq) {
  Sequence& s = get(seq);
  if (s.finish == FinishReason::kNone) finish(s, FinishReason::kAborted);
}

void SpecDecoder::release_now(int64_t seq) {
  abort_now(seq);
  seqs_[static_cast<size_t>(seq)].reset();
  free_ids_.push_back(seq);
}

void SpecDecoder::abort(int64_t seq) {
  std::lock_guard<std::mutex> lock(mu_);
  get(seq);  // unknown ids fail now, not when the step ends
  if (in_open_step(seq)) {
    open_->pending_abort.push_back(seq);
  } else {
    abort_now(seq);
  }
}

void SpecDecoder::release(int64_t seq) {
  std::lock_guard<std::mutex> lock(mu_);
  get(seq);
  if (in_open_step(seq)) {
    auto& q = open_->pending_release;
    if (std::find(q.begin(), q.end(), seq) == q.end()) q.push_back(seq);
  } else {
    release_now(seq);
  }
}

void SpecDecoder::reseed(uint64_t seed) {
  std::lock_guard<std::mutex> lock(mu_);
  if (open_) throw StepInProgressError("reseed: a step is open; reseed between steps");
  config_.seed = seed;
  offset_ = 0;
}

bool SpecDecoder::has_running() const {
  std::lock_guard<std::mutex> lock(mu_);
  return !running_.empty() || !waiting_.empty();
}

int64_t SpecDecoder::num_waiting() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(waiting_.size());
}

int64_t SpecDecoder::num_preemptions() const {
  std::lock_guard<std::mutex> lock(mu_);
  return preemptions_;
}

int64_t SpecDecoder::num_running() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(running_.size());
}

int64_t SpecDecoder::num_sequences() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(seqs_.size() - free_ids_.size());
}

bool SpecDecoder::step_open() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<bool>(open_);
}

std::vector<int32_t> SpecDecoder::generated(int64_t seq) const {
  std::lock_guard<std::mutex> lock(mu_);
  const Sequence& s = get(seq);
  return std::vector<int32_t>(s.tokens.begin() + s.prompt_len, s.tokens.end());
}

FinishReason SpecDecoder::finish_reason(int64_t seq) const {
  std::lock_guard<std::mutex> lock(mu_);
  return get(seq).finish;
}

SequenceStats SpecDecoder::stats(int64_t seq) const {
  std::lock_guard<std::mutex> lock(mu_);
  return get(seq).stats;
}

int64_t SpecDecoder::committed_len(int64_t seq) const {
  std::lock_guard<std::mutex> lock(mu_);
  return get(seq).committed();
}

std::vector<int32_t> SpecDecoder::committed(int64_t seq) const {
  std::lock_guard<std::mutex> lock(mu_);
  return get(seq).tokens;
}

std::vector<int32_t> SpecDecoder::block_table(int64_t seq, ModelRole role) const {
  std::lock_guard<std::mutex> lock(mu_);
  const Sequence& s = get(seq);
  const int64_t id = seq_for(s, role);
  if (id < 0) return {};
  return alloc(role).block_table(id);
}

int64_t SpecDecoder::cache_len(int64_t seq, ModelRole role) const {
  std::lock_guard<std::mutex> lock(mu_);
  const Sequence& s = get(seq);
  if (role == ModelRole::kDraft && !config_.has_draft_model) return 0;
  const int64_t id = seq_for(s, role);
  return id >= 0 ? alloc(role).length(id) : 0;
}

int64_t SpecDecoder::num_free_blocks(ModelRole role) const {
  std::lock_guard<std::mutex> lock(mu_);
  return alloc(role).num_free_blocks();
}

int64_t SpecDecoder::num_blocks(ModelRole role) const {
  std::lock_guard<std::mutex> lock(mu_);
  return alloc(role).num_blocks();
}

uint64_t SpecDecoder::offset() const {
  std::lock_guard<std::mutex> lock(mu_);
  return offset_;
}

PhaseTimes SpecDecoder::times() const {
  std::lock_guard<std::mutex> lock(mu_);
  return times_;
}

CostModel SpecDecoder::cost_model() const {
  std::lock_guard<std::mutex> lock(mu_);
  return cost_;
}

std::vector<double> SpecDecoder::acceptance_prior() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<double> out;
  for (const AcceptanceTracker& pop : population_) out.push_back(AcceptanceTracker::seeded_by(pop).rate);
  return out;
}

int64_t SpecDecoder::seq_for(const Sequence& s, ModelRole role) const {
  return role == ModelRole::kDraft && draft_alloc_ ? s.draft_seq : s.target_seq;
}

const BlockAllocator& SpecDecoder::alloc(ModelRole role) const {
  if (role == ModelRole::kDraft) {
    if (!config_.has_draft_model) {
      throw InvalidArgumentError("allocator: this decoder has no draft model");
    }
    if (draft_alloc_) return *draft_alloc_;
  }
  return target_alloc_;
}

BlockAllocator& SpecDecoder::alloc(ModelRole role) {
  return const_cast<BlockAllocator&>(static_cast<const SpecDecoder*>(this)->alloc(role));
}

// ---- begin_step -------------------------------------------------------------------

// A running sequence as plan_step sees it: its uncached tokens, and if it becomes a
// verify row, the cap on k, the k chosen and its n-gram proposals (cut to k at the end).
struct SpecDecoder::Choice {
  Sequence* s = nullptr;
  int64_t pending = 0;  // uncached committed tokens: 1 for a decoding row
  int64_t cap = 0;
  int64_t k = 0;
  std::vector<int32_t> proposals;
  std::vector<int32_t> parents;           // tree steps: each proposal's parent (-1: root)
  int64_t fanout = 1;                     // draft trees: children per expanded node (1: a chain)
  // an n-gram trie row under adaptive k: its nodes' shares, and the chain (the most
  // recent continuation) it may run instead, with its shares
  std::vector<double> freqs;
  std::vector<int32_t> chain;
  std::vector<double> chain_freqs;
  std::vector<bool> recent;  // the proposals run: on the most recent continuation
  size_t order = 0;                       // index in running_ (rank order)
  std::vector<AcceptanceTracker> mark;    // the trackers before the step
};

int64_t SpecDecoder::draft_fanout(const Sequence& s, bool chain) const {
  return config_.draft_branches > 1 && !chain && !s.sampling.keyed ? config_.draft_branches : 1;
}

int64_t SpecDecoder::draft_cap(Sequence& s, std::vector<int32_t>* ngram_proposals,
                               std::vector<int32_t>* parents, bool chain, Choice* trie) {
  ngram_proposals->clear();
  parents->clear();
  if (trie != nullptr) {
    trie->freqs.clear();
    trie->chain.clear();
    trie->chain_freqs.clear();
  }
  s.tracker = 0;
  if (!config_.has_draft_model && !s.ngram) return 0;
  // Never propose what could not be emitted: a step emits at most k + 1 tokens, and
  // the verify pass writes positions up to C - 1 + k. A draft model writes positions up
  // to C + k - 2 (and its catch-up up to C - 1): keep them inside its context.
  const int64_t remaining = s.stop.max_new_tokens - s.num_generated();
  const int64_t room = config_.max_context - s.committed();
  int64_t cap = std::max<int64_t>(0, std::min({config_.k, remaining - 1, room - 1}));
  if (config_.has_draft_model) {
    const int64_t draft_room = config_.draft_max_context - s.committed();
    cap = draft_room < 1 ? 0 : std::min(cap, draft_room + 1);
  }
  if (config_.has_draft_model) {  // the shape of the row's nodes (see "Draft trees")
    const int64_t f = draft_fanout(s, chain);
    for (int64_t i = 0; i < cap; ++i) {
      parents->push_back(static_cast<int32_t>(i < f ? -1 : (i / f - 1) * f));
    }
  }
  if (s.ngram && cap > 0) {  // deterministic proposals: at most what the lookup found
    int64_t matched_n = 0;
    if (config_.ngram_branches > 1 && !chain && !s.sampling.keyed) {
      const bool shares = trie != nullptr && config_.adaptive_k;
      *ngram_proposals = s.ngram->propose_tree(cap, config_.ngram_branches, parents, &matched_n,
                                               shares ? &trie->freqs : nullptr,
                                               shares ? &trie->chain_freqs : nullptr);
      if (shares && !ngram_proposals->empty()) trie->chain = s.ngram->propose(cap);
    } else {
      *ngram_proposals = s.ngram->propose(cap, &matched_n);
      for (size_t i = 0; i < ngram_proposals->size(); ++i) parents->push_back(static_cast<int32_t>(i) - 1);
    }
    cap = static_cast<int64_t>(ngram_proposals->size());
    if (matched_n > 0) s.tracker = matched_n - config_.ngram_min_n;
  }
  return cap;
}

// k of each row (its cap without adaptive k). `rest`: the rest of the step (rows decided
// before, prefill chunks); the rows' uncached tokens beyond their last are added here.
void SpecDecoder::choose_ks(const std::vector<Choice*>& rows, BatchRest rest) {
  const bool shared = config_.draft_shares_target_cache;
  std::vector<Choice*> free;  // rows the batch rule decides
  std::vector<double> rate;
  std::vector<int64_t> cap;
  for (Choice* c : rows) rest.tokens += c->pending - 1;
  for (Choice* c : rows) {
    const AcceptanceTracker& acc = c->s->trackers[static_cast<size_t>(c->s->tracker)];
    if (config_.draft_reads_target && c->pending > 1) {
      // The target has not cached the prompt yet (it prefills or recomputes it in this
      // step): the draft would read hidden states not written yet. Draft next step.
      c->k = 0;
    } else if (!config_.adaptive_k || c->cap == 0) {
      c->k = c->cap;
    } else if (shared && c->pending > 1) {
      // The prompt is not cached yet: the target's prefill fills the shared cache for
      // free, where drafting now would make the draft prefill the prompt itself.
      c->k = 0;
    } else if (!c->s->ngram && !cost_.has_draft()) {
      // Measure the draft first: one steady draft pass (one token per row) is enough,
      // the second pass when the first catches the draft's own cache up (a draft tree:
      // its second level, so f nodes a level).
      c->k = std::min<int64_t>(c->cap, (shared ? 1 : 2) * c->fanout);
    } else {
      free.push_back(c);
      rate.push_back(acc.rate);
      // a draft tree row: its chain depth (widened below if it pays); an n-gram trie
      // row: its chain's length (the trie below if it pays)
      cap.push_back(c->chain.empty() ? c->cap : static_cast<int64_t>(c->chain.size()));
      continue;
    }
    rest.expected += expected_tokens(acc.rate, c->k);
    rest.k = std::max(rest.k, c->k);
    rest.tokens += c->k + 1;
  }
  if (!free.empty()) {
    // n-gram lookups cost nothing next to a model pass; a draft model is measured.
    const double draft_pass = config_.has_draft_model ? cost_.draft_pass() : 0.0;
    std::vector<int64_t> k = best_batch_k(rate, cap, draft_pass, cost_, rest);
    const int64_t batch_rows = static_cast<int64_t>(free.size());  // rows that may probe
    int64_t tokens = rest.tokens;  // the step's target tokens at the chosen k
    double expected = rest.expected;
    // the two deepest chains (with the rest's k): the step's draft passes without a row
    size_t deepest = 0;
    int64_t first = rest.k, second = rest.k;
    for (size_t i = 0; i < free.size(); ++i) {
      tokens += k[i] + 1;
      expected += expected_tokens(rate[i], k[i]);
      if (k[i] > first) {
        second = first, first = k[i], deepest = i;
      } else {
        second = std::max(second, k[i]);
      }
    }
    // Draft-tree rows: the chain of depth k, or the tree of depth min(k, cap / f) where
    // the siblings' acceptance pays their verify rows and the lost depth (adaptive_k.h,
    // tree_pays), or while that acceptance is barely measured (kTreeExploreTrials,
    // kTreeExploreSteps) where a tree could pay at all (with every sibling accepted).
    for (size_t i = 0; i < free.size(); ++i) {
      Choice& c = *free[i];
      if (c.fanout <= 1) continue;
      const int64_t d = std::min(k[i], c.cap / c.fanout), nodes = c.fanout * d;
      const int64_t others = i == deepest && first > rest.k ? second : first;
      const double s = c.s->sibling.rate;
      const double draft_chain = static_cast<double>(std::max(others, k[i])) * draft_pass;
      const double draft_tree = static_cast<double>(std::max(others, d)) * draft_pass;
      const double target_chain = cost_.target_pass(tokens);
      const double target_tree = cost_.target_pass(tokens + nodes - k[i]);
      auto pays = [&](double sibling) {
        return tree_pays(rate[i], sibling, k[i], d, expected, draft_chain, draft_tree,
                         target_chain, target_tree);
      };
      const bool explore = c.s->sibling.trials < kTreeExploreTrials &&
                           c.s->tree_steps < kTreeExploreSteps && pays(1.0);
      if (k[i] > 0 && d > 0 && (explore || pays(s))) {
        expected += expected_tree_tokens(rate[i], s, d) - expected_tokens(rate[i], k[i]);
        tokens += nodes - k[i];
        k[i] = nodes;
        continue;
      }
      c.fanout = 1;  // a chain row: node i's parent is node i - 1
      for (size_t j = 0; j < c.parents.size(); ++j) c.parents[j] = static_cast<int32_t>(j) - 1;
    }
    // n-gram trie rows: the chain of the most recent continuation, or the trie's first m
    // nodes, whichever of all those prefixes gives the step the most expected tokens per
    // second (adaptive_k.h, expected_trie_tokens: the continuations' shares at each node).
    for (size_t i = 0; i < free.size(); ++i) {
      Choice& c = *free[i];
      if (c.chain.empty()) continue;  // not an n-gram trie row
      const double base = expected - expected_tokens(rate[i], k[i]);
      const int64_t base_tokens = tokens - (k[i] + 1);
      std::vector<int32_t> chain_parents(c.chain.size());
      for (size_t j = 0; j < chain_parents.size(); ++j) chain_parents[j] = static_cast<int32_t>(j) - 1;
      const double r = c.s->recent.rate;
      std::vector<bool> trie_recent, chain_recent;
      const std::vector<double> e_trie = expected_trie_tokens(
          rate[i], c.parents,
          trie_node_weights(r, c.proposals, c.parents, c.freqs, c.chain, c.chain_freqs, &trie_recent));
      const std::vector<double> e_chain = expected_trie_tokens(
          rate[i], chain_parents,
          trie_node_weights(r, c.chain, chain_parents, c.chain_freqs, c.chain, c.chain_freqs,
                            &chain_recent));
      double best = (base + 1.0) / std::max(cost_.target_pass(base_tokens + 1), 1e-12);
      int64_t best_m = 0;
      bool tree = false;
      for (int which = 0; which < 2; ++which) {
        const std::vector<double>& e = which == 0 ? e_chain : e_trie;
        for (size_t m = 1; m <= e.size(); ++m) {
          const double r = (base + e[m - 1]) /
                           std::max(cost_.target_pass(base_tokens + static_cast<int64_t>(m) + 1), 1e-12);
          if (r > best * (1.0 + 1e-9)) best = r, best_m = static_cast<int64_t>(m), tree = which == 1;
        }
      }
      expected = base + (best_m == 0 ? 1.0 : (tree ? e_trie : e_chain)[static_cast<size_t>(best_m - 1)]);
      tokens = base_tokens + best_m + 1;
      k[i] = best_m;
      if (tree) {
        c.recent = std::move(trie_recent);
      } else {  // the chain row: node i's parent is node i - 1
        c.proposals = std::move(c.chain);
        c.parents = std::move(chain_parents);
        c.freqs = std::move(c.chain_freqs);
        c.recent = std::move(chain_recent);
      }
    }
    for (size_t i = 0; i < free.size(); ++i) {
      Choice& c = *free[i];
      AcceptanceTracker& acc = c.s->trackers[static_cast<size_t>(c.s->tracker)];
      c.k = k[i];
      if (c.k > 0) {
        acc.steps_without_drafts = 0;
        continue;
      }
      // this row's plain step against a probe at k = 1, in this batch; every row of the
      // batch may probe, so the budget is shared by all of them
      const std::vector<double> probe = cost_.target_passes(tokens, 2);
      if (++acc.steps_without_drafts >= probe_interval(draft_pass, probe, batch_rows)) {
        acc.steps_without_drafts = 0;  // probe: one step at k = 1
        c.k = 1;
      }
    }
  }
}

namespace {

// Allocates the pass's tokens in `alloc` (all or nothing) and fills its slots, context
// lengths and block tables; the inputs, positions and query starts are already set.
void allocate_pass(BlockAllocator& alloc, const std::vector<int64_t>& seqs, Pass* p) {
  const int64_t B = static_cast<int64_t>(seqs.size());
  std::vector<int64_t> counts(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) {
    counts[static_cast<size_t>(b)] = p->query_start[static_cast<size_t>(b + 1)] -
                                     p->query_start[static_cast<size_t>(b)];
  }
  const int64_t T = static_cast<int64_t>(p->input_ids.size());
  p->slot_mapping.assign(static_cast<size_t>(T), -1);
  alloc.append_batch(seqs.data(), counts.data(), B, p->slot_mapping.data(), T);
  p->context_lens.resize(static_cast<size_t>(B));
  p->max_blocks = 1;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t id = seqs[static_cast<size_t>(b)];
    p->context_lens[static_cast<size_t>(b)] = static_cast<int32_t>(alloc.length(id));
    p->max_blocks = std::max<int64_t>(p->max_blocks, static_cast<int64_t>(alloc.block_table(id).size()));
  }
  p->block_tables.assign(static_cast<size_t>(B * p->max_blocks), -1);
  alloc.fill_block_tables(seqs.data(), B, p->block_tables.data(), p->max_blocks, p->max_blocks);
  p->steady = T == B;
}

}  // namespace

void SpecDecoder::plan_draft_passes(OpenStep& st) {
  if (!config_.has_draft_model) return;
  const int64_t B = static_cast<int64_t>(st.rows.size());
  std::vector<int64_t> prev_pos(static_cast<size_t>(B), -1);  // row -> index in the last pass
  // A row's passes: k for a chain, ceil(k / f) for a draft tree of fanout f.
  auto fanout = [&](int64_t b) { return st.draft_tree ? st.fanout[static_cast<size_t>(b)] : 1; };
  auto depth = [&](int64_t b) { return (st.k[static_cast<size_t>(b)] + fanout(b) - 1) / fanout(b); };
  int64_t passes = 0;
  for (int64_t b = 0; b < B; ++b) passes = std::max(passes, depth(b));
  for (int64_t j = 0; j < passes; ++j) {
    Pass p;
    p.role = ModelRole::kDraft;
    p.query_start.push_back(0);
    std::vector<int64_t> seqs;
    for (int64_t b = 0; b < B; ++b) {
      if (depth(b) <= j) continue;
      const Sequence& s = *st.rows[static_cast<size_t>(b)];
      if (j == 0) {  // catch up: committed[draft cache_len:]
        for (int64_t pos = st.draft_mark[static_cast<size_t>(b)]; pos < s.committed(); ++pos) {
          p.input_ids.push_back(s.tokens[static_cast<size_t>(pos)]);
          p.positions.push_back(pos);
        }
      } else {  // the previous proposal, on the device
        p.input_ids.push_back(-1);
        p.positions.push_back(s.committed() + j - 1);
        p.prev_index.push_back(prev_pos[static_cast<size_t>(b)]);
      }
      p.query_start.push_back(static_cast<int64_t>(p.input_ids.size()));
      p.logits_indices.push_back(p.query_start.back() - 1);
      p.rows.push_back(b);
      const int64_t f = fanout(b);
      p.draft_index.push_back(b * st.K + j * f);
      if (st.draft_tree) {
        p.num_children.push_back(std::min(f, st.k[static_cast<size_t>(b)] - j * f));
        p.q_index.push_back(b * (st.K + 1) + (j == 0 ? 0 : (j - 1) * f + 1));
      }
      seqs.push_back(seq_for(s, ModelRole::kDraft));
    }
    for (size_t i = 0; i < p.rows.size(); ++i) prev_pos[static_cast<size_t>(p.rows[i])] = static_cast<int64_t>(i);
    allocate_pass(alloc(ModelRole::kDraft), seqs, &p);
    st.passes.push_back(std::move(p));
  }
  if (config_.draft_shares_target_cache && st.K > 0) {
    // Drop the draft's K/V: the verify pass rewrites those positions.
    for (int64_t b = 0; b < B; ++b) {
      target_alloc_.rollback(st.rows[static_cast<size_t>(b)]->target_seq,
                             st.target_mark[static_cast<size_t>(b)]);
    }
  }
}

namespace {

// The verify pass's ancestor mask (PassLayout::tree_mask), when some row branches.
void plan_tree_mask(const std::vector<std::vector<int32_t>>& rows, Pass* p) {
  bool branches = false;
  for (const auto& parents : rows) {
    for (size_t j = 0; j < parents.size(); ++j) branches = branches || parents[j] != static_cast<int32_t>(j) - 1;
  }
  if (!branches) return;  // chains: positions alone give the causal mask
  const int64_t T = static_cast<int64_t>(p->input_ids.size());
  p->tree_mask.assign(static_cast<size_t>(T * T), 0);
  const int64_t R = static_cast<int64_t>(p->query_start.size()) - 1;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t lo = p->query_start[static_cast<size_t>(r)];
    const int64_t hi = p->query_start[static_cast<size_t>(r + 1)];
    const std::vector<int32_t> none;
    const std::vector<int32_t>& parents = r < static_cast<int64_t>(rows.size()) ? rows[static_cast<size_t>(r)] : none;
    const int64_t nodes = static_cast<int64_t>(parents.size());
    const int64_t first = hi - nodes;  // the row's first node; before it: committed tokens
    for (int64_t t = lo; t < hi; ++t) {
      uint8_t* row = p->tree_mask.data() + t * T;
      if (t < first) {
        for (int64_t u = lo; u <= t; ++u) row[u] = 1;
        continue;
      }
      for (int64_t u = lo; u < first; ++u) row[u] = 1;
      for (int64_t j = t - first; j >= 0; j = parents[static_cast<size_t>(j)]) row[first + j] = 1;
    }
  }
}

}  // namespace

void SpecDecoder::plan_verify_pass(OpenStep& st) {
  const int64_t B = static_cast<int64_t>(st.rows.size());
  const int64_t K = st.K;
  Pass p;
  p.role = ModelRole::kTarget;
  p.query_start.push_back(0);
  std::vector<int64_t> seqs;
  for (int64_t b = 0; b < B; ++b) {
    const Sequence& s = *st.rows[static_cast<size_t>(b)];
    const int64_t kb = st.k[static_cast<size_t>(b)];
    for (int64_t pos = st.target_mark[static_cast<size_t>(b)]; pos < s.committed(); ++pos) {
      p.input_ids.push_back(s.tokens[static_cast<size_t>(pos)]);
      p.positions.push_back(pos);
    }
    const auto& ngram = st.proposals[static_cast<size_t>(b)];
    const auto& parents = st.parents[static_cast<size_t>(b)];
    std::vector<int64_t> depth;  // tree steps: node j at RoPE position C + depth - 1
    for (int64_t j = 0; j < kb; ++j) {
      if (config_.has_draft_model) {
        p.fill_positions.push_back(static_cast<int64_t>(p.input_ids.size()));
        p.fill_sources.push_back(b * K + j);
        p.input_ids.push_back(-1);
      } else {
        p.input_ids.push_back(ngram[static_cast<size_t>(j)]);
      }
      if (st.tree) {
        const int32_t parent = parents[static_cast<size_t>(j)];
        depth.push_back(parent < 0 ? 1 : depth[static_cast<size_t>(parent)] + 1);
        p.positions.push_back(s.committed() + depth.back() - 1);
      } else {
        p.positions.push_back(s.committed() + j);
      }
    }
    p.query_start.push_back(static_cast<int64_t>(p.input_ids.size()));
    // Logits rows laid out [B, K + 1]: row b's position i is its (pending - 1 + i)-th
    // input; positions past k[b] repeat the last one (padding the kernel never reads).
    const int64_t first = p.query_start.back() - 1 - kb;
    for (int64_t i = 0; i <= K; ++i) p.logits_indices.push_back(first + std::min(i, kb));
    p.rows.push_back(b);
    seqs.push_back(s.target_seq);
  }
  // Prefill rows after the verify rows: a chunk of committed[Lt:], no logits.
  for (size_t i = 0; i < st.prefill.size(); ++i) {
    const Sequence& s = *st.prefill[i];
    const int64_t from = st.prefill_mark[i];
    for (int64_t pos = from; pos < from + st.prefill_chunk[i]; ++pos) {
      p.input_ids.push_back(s.tokens[static_cast<size_t>(pos)]);
      p.positions.push_back(pos);
    }
    p.query_start.push_back(static_cast<int64_t>(p.input_ids.size()));
    p.rows.push_back(-1);
    seqs.push_back(s.target_seq);
  }
  // No verify row: one logits row (unused), so that a model never gets R = 0.
  if (B == 0) p.logits_indices.push_back(p.query_start.back() - 1);
  if (st.tree) plan_tree_mask(st.parents, &p);
  allocate_pass(target_alloc_, seqs, &p);
  st.verify_tokens = static_cast<int64_t>(p.input_ids.size());
  st.passes.push_back(std::move(p));
}

void SpecDecoder::pack_inputs(OpenStep& st, StepPlan* plan) {
  const int64_t B = static_cast<int64_t>(st.rows.size());
  const int64_t K = st.K;
  std::vector<uint8_t>& buf = plan->inputs;
  for (const Pass& p : st.passes) {
    PassLayout l;
    l.role = p.role;
    l.num_rows = static_cast<int64_t>(p.rows.size());
    l.num_tokens = static_cast<int64_t>(p.input_ids.size());
    l.max_blocks = p.max_blocks;
    l.num_logits = static_cast<int64_t>(p.logits_indices.size());
    l.input_ids = put(&buf, p.input_ids);
    l.positions = put(&buf, p.positions);
    l.query_start = put(&buf, p.query_start);
    l.logits_indices = put(&buf, p.logits_indices);
    l.rows = put(&buf, p.rows);
    l.draft_index = put(&buf, p.draft_index);
    l.prev_index = put(&buf, p.prev_index);
    l.num_children = put(&buf, p.num_children);
    l.q_index = put(&buf, p.q_index);
    l.fill_positions = put(&buf, p.fill_positions);
    l.fill_sources = put(&buf, p.fill_sources);
    l.num_fill = static_cast<int64_t>(p.fill_positions.size());
    l.slot_mapping = put(&buf, p.slot_mapping);
    l.block_tables = put(&buf, p.block_tables);
    l.context_lens = put(&buf, p.context_lens);
    l.has_tree_mask = !p.tree_mask.empty();
    l.tree_mask = put(&buf, p.tree_mask);
    plan->passes.push_back(l);
  }
  std::vector<int32_t> drafts(static_cast<size_t>(B * K), -1), num_draft(static_cast<size_t>(B));
  std::vector<float> temperature(static_cast<size_t>(B)), top_p(static_cast<size_t>(B)),
      min_p(static_cast<size_t>(B));
  std::vector<int32_t> top_k(static_cast<size_t>(B)), keyed(static_cast<size_t>(B));
  std::vector<int64_t> seed_rows(static_cast<size_t>(B)), position_rows(static_cast<size_t>(B));
  PolicyLayout& pol = plan->policy;
  pol.all_keyed = B > 0;
  const SamplingParams s0 = B > 0 ? st.rows[0]->sampling : SamplingParams{};  // B = 0: unused
  std::vector<int32_t> parents(st.tree ? static_cast<size_t>(B * K) : 0, -1);
  for (int64_t b = 0; b < B; ++b) {
    const auto& ngram = st.proposals[static_cast<size_t>(b)];
    std::copy(ngram.begin(), ngram.end(), drafts.begin() + b * K);
    if (st.tree) {
      const auto& par = st.parents[static_cast<size_t>(b)];
      std::copy(par.begin(), par.end(), parents.begin() + b * K);
    }
    num_draft[static_cast<size_t>(b)] = static_cast<int32_t>(st.k[static_cast<size_t>(b)]);
    const SamplingParams& sp = st.rows[static_cast<size_t>(b)]->sampling;
    temperature[static_cast<size_t>(b)] = sp.temperature;
    top_k[static_cast<size_t>(b)] = sp.top_k;
    top_p[static_cast<size_t>(b)] = sp.top_p;
    min_p[static_cast<size_t>(b)] = sp.min_p;
    keyed[static_cast<size_t>(b)] = sp.keyed ? 1 : 0;
    seed_rows[static_cast<size_t>(b)] = static_cast<int64_t>(sp.seed);
    position_rows[static_cast<size_t>(b)] = st.rows[static_cast<size_t>(b)]->committed();
    pol.any_keyed = pol.any_keyed || sp.keyed;
    pol.all_keyed = pol.all_keyed && sp.keyed;
    pol.uniform = pol.uniform && sp.temperature == s0.temperature && sp.top_k == s0.top_k &&
                  sp.top_p == s0.top_p && sp.min_p == s0.min_p;
  }
  pol.temperature = s0.temperature;
  pol.top_k = s0.top_k;
  pol.top_p = s0.top_p;
  pol.min_p = s0.min_p;
  pol.temperature_rows = put(&buf, temperature);
  pol.top_k_rows = put(&buf, top_k);
  pol.top_p_rows = put(&buf, top_p);
  pol.min_p_rows = put(&buf, min_p);
  pol.keyed_rows = put(&buf, keyed);
  pol.seed_rows = put(&buf, seed_rows);
  pol.position_rows = put(&buf, position_rows);
  plan->draft_tokens = put(&buf, drafts);
  plan->num_draft = put(&buf, num_draft);
  plan->tree = st.tree;
  plan->tree_parents = put(&buf, parents);
  plan->draft_tree = st.draft_tree && K > 0;
  buf.resize((buf.size() + 7) / 8 * 8);
  plan->step_id = st.id;
  plan->batch = B;
  plan->k = K;
  plan->draft_model = config_.has_draft_model && K > 0;
  plan->seed = config_.seed;
  plan->offset = st.base_offset;
  for (int64_t b = 0; b < B; ++b) {
    plan->seqs.push_back(st.rows[static_cast<size_t>(b)]->id);
    plan->row_k.push_back(static_cast<int32_t>(st.k[static_cast<size_t>(b)]));
  }
  for (const Sequence* s : st.prefill) plan->prefill_seqs.push_back(s->id);
  // The decoder never forks, so these are empty today; a caller performs them anyway.
  plan->target_copies = target_alloc_.take_block_copies();
  if (draft_alloc_) plan->draft_copies = draft_alloc_->take_block_copies();
}

StepPlan SpecDecoder::begin_step() {
  std::lock_guard<std::mutex> lock(mu_);
  if (open_) {
    throw StepInProgressError("begin_step: step " + std::to_string(open_->id) +
                              " is still open; one step at a time (commit or cancel it first)");
  }
  StepPlan plan;
  const std::vector<int64_t> admitted = admit();
  if (running_.empty()) return plan;
  NvtxRange range("verispec.plan");
  // Plan with every running sequence; when the passes do not fit the free blocks,
  // preempt the last in rank (lowest priority, then newest) and plan again. One sequence alone that does not fit: the
  // CacheFullError goes to the caller (the step's admissions undone; sequences
  // preempted on the way keep their tokens and wait).
  try {
    while (!plan_step(&plan, admitted)) preempt_newest();
  } catch (...) {
    unadmit(admitted);
    throw;
  }
  return plan;
}

bool SpecDecoder::plan_step(StepPlan* out, const std::vector<int64_t>& admitted) {
  StepPlan& plan = *out;
  auto st = std::make_unique<OpenStep>();
  st->id = next_step_id_++;
  st->base_offset = offset_;
  const int64_t budget = config_.max_tokens_per_step > 0 ? config_.max_tokens_per_step
                                                        : std::numeric_limits<int64_t>::max() / 4;
  // The running sequences by what they need: decoding rows (one uncached token) come
  // first in the budget, then the others (a prompt, a recompute) in rank order.
  std::vector<Choice> decode, prefill;
  int64_t prefill_pending = 0;
  for (size_t i = 0; i < running_.size(); ++i) {
    Sequence& s = *seqs_[static_cast<size_t>(running_[i])];
    Choice c;
    c.s = &s;
    c.order = i;
    c.pending = s.committed() - target_alloc_.length(s.target_seq);
    c.mark = s.trackers;
    if (c.pending <= 1) {
      decode.push_back(std::move(c));
    } else {
      prefill_pending += c.pending;
      prefill.push_back(std::move(c));
    }
  }
  // k of the decoding rows, against the load the prefill will add (what it would take
  // with every decoding row at k = 0).
  std::vector<Choice*> verify;
  for (Choice& c : decode) {
    c.cap = draft_cap(*c.s, &c.proposals, &c.parents, c.pending > kTreeMaxUncached, &c);
    c.fanout = config_.has_draft_model ? draft_fanout(*c.s, c.pending > kTreeMaxUncached) : 1;
    verify.push_back(&c);
  }
  const int64_t n_decode = static_cast<int64_t>(decode.size());
  choose_ks(verify, BatchRest{0.0, 0, std::min(prefill_pending, std::max<int64_t>(0, budget - n_decode))});
  // Over the budget: the largest common cap c on k that fits, then c + 1 for the first
  // rows while tokens are left (k = 0 at worst: a decoding row always runs).
  int64_t used = 0;
  for (const Choice& c : decode) used += c.k + 1;
  if (used > budget) {
    int64_t cap = 0;
    for (const Choice& c : decode) cap = std::max(cap, c.k);
    auto tokens_at = [&](int64_t limit) {
      int64_t t = 0;
      for (const Choice& c : decode) t += 1 + std::min(c.k, limit);
      return t;
    };
    while (cap > 0 && tokens_at(cap) > budget) --cap;
    int64_t spare = std::max<int64_t>(0, budget - tokens_at(cap));
    used = 0;
    for (Choice& c : decode) {
      const bool more = c.k > cap && spare > 0;
      c.k = more ? cap + 1 : std::min(c.k, cap);
      spare -= more ? 1 : 0;
      used += c.k + 1;
    }
  }
  // The rest of the budget to the others, in rank order: whole (a verify row) or a
  // chunk (a prefill row); what gets nothing waits for the next step.
  int64_t left = std::max<int64_t>(0, budget - used);
  BatchRest sofar{0.0, 0, used};
  for (const Choice& c : decode) {
    sofar.expected += expected_tokens(c.s->trackers[static_cast<size_t>(c.s->tracker)].rate, c.k);
    sofar.k = std::max(sofar.k, c.k);
  }
  for (Choice& c : prefill) {
    if (left == 0) break;
    if (c.pending <= left) {
      c.cap = draft_cap(*c.s, &c.proposals, &c.parents, c.pending > kTreeMaxUncached, &c);
      c.fanout = config_.has_draft_model ? draft_fanout(*c.s, c.pending > kTreeMaxUncached) : 1;
      choose_ks({&c}, sofar);
      c.k = std::min(c.k, left - c.pending);
      left -= c.pending + c.k;
      sofar.expected += expected_tokens(c.s->trackers[static_cast<size_t>(c.s->tracker)].rate, c.k);
      sofar.k = std::max(sofar.k, c.k);
      sofar.tokens += c.pending + c.k;
      verify.push_back(&c);
    } else {
      st->prefill.push_back(c.s);
      st->prefill_chunk.push_back(left);
      st->prefill_mark.push_back(target_alloc_.length(c.s->target_seq));
      left = 0;
    }
  }
  std::sort(verify.begin(), verify.end(),
            [](const Choice* x, const Choice* y) { return x->order < y->order; });
  const size_t B = verify.size();
  st->k.resize(B);
  st->target_mark.resize(B);
  st->draft_mark.resize(B);
  st->proposals.resize(B);
  st->parents.resize(B);
  st->freqs.resize(B);
  st->recent.resize(B);
  st->draft_tree = config_.has_draft_model && config_.draft_branches > 1;
  st->tree = config_.ngram_branches > 1 || st->draft_tree;
  st->fanout.assign(B, 1);
  for (size_t b = 0; b < B; ++b) {
    Choice& c = *verify[b];
    Sequence& s = *c.s;
    st->rows.push_back(&s);
    st->k[b] = c.k;
    st->K = std::max(st->K, c.k);
    // Cut to k: the first k nodes of a tree are a tree (parents[i] < i).
    if (s.ngram) c.proposals.resize(static_cast<size_t>(c.k));
    if (s.ngram || st->draft_tree) c.parents.resize(static_cast<size_t>(c.k));
    if (!c.freqs.empty()) c.freqs.resize(static_cast<size_t>(c.k));
    if (!c.recent.empty()) c.recent.resize(static_cast<size_t>(c.k));
    if (st->draft_tree) st->fanout[b] = c.fanout;
    st->proposals[b] = std::move(c.proposals);
    st->parents[b] = std::move(c.parents);
    st->freqs[b] = std::move(c.freqs);
    st->recent[b] = std::move(c.recent);
    st->target_mark[b] = target_alloc_.length(s.target_seq);
    st->draft_mark[b] = draft_alloc_ ? draft_alloc_->length(s.draft_seq) : st->target_mark[b];
    st->tracker_mark.push_back(std::move(c.mark));
  }
  // A step whose rows all came out as chains (k = "auto" chose no tree, or the tries had
  // one continuation) runs as a chain step: a tree step's masks, tree verify, K/V moves
  // and f-child draft samples would cost without changing what a chain accepts.
  if (st->tree) {
    bool chains = true;
    for (size_t b = 0; b < B && chains; ++b) {
      if (st->draft_tree && st->fanout[b] > 1) chains = false;
      const std::vector<int32_t>& par = st->parents[b];
      for (size_t i = 0; i < par.size() && chains; ++i)
        chains = par[i] == static_cast<int32_t>(i) - 1;
    }
    if (chains) {
      st->tree = st->draft_tree = false;
      st->fanout.assign(B, 1);
    }
  }
  try {
    plan_draft_passes(*st);
    plan_verify_pass(*st);
    pack_inputs(*st, &plan);
  } catch (const CacheFullError&) {
    open_ = std::move(st);
    end_step(/*restore=*/true);
    if (running_.size() <= 1) throw;
    return false;
  } catch (...) {
    open_ = std::move(st);
    end_step(/*restore=*/true);
    throw;
  }
  for (Sequence* s : st->rows) s->in_step = true;
  for (Sequence* s : st->prefill) s->in_step = true;
  st->admitted = admitted;  // a cancelled step puts them back in the queue
  open_ = std::move(st);
  return true;
}

// ---- commit -----------------------------------------------------------------------

void SpecDecoder::check_outputs(const OpenStep& st, const VerifyOutputs& out) const {
  const int64_t B = static_cast<int64_t>(st.rows.size());
  const int64_t K = st.K;
  const int64_t V = config_.vocab_size;
  auto size_error = [&](const char* name, const std::string& dims, int64_t want, int64_t got) {
    return InvalidArgumentError("commit: " + std::string(name) + " must hold " + dims + " = " +
                                std::to_string(want) + " values, got " + std::to_string(got));
  };
  const std::string bk1 = "[B, K + 1] = [" + std::to_string(B) + ", " + std::to_string(K + 1) + "]";
  // (a step of prefill chunks only has B = 0: empty outputs, null pointers allowed)
  if ((!out.tokens && B > 0) || out.tokens_len != B * (K + 1)) throw size_error("tokens", bk1, B * (K + 1), out.tokens_len);
  if ((!out.num_emitted && B > 0) || out.num_emitted_len != B) throw size_error("num_emitted", "[B]", B, out.num_emitted_len);
  if ((!out.num_accepted && B > 0) || out.num_accepted_len != B) throw size_error("num_accepted", "[B]", B, out.num_accepted_len);
  const bool model = config_.has_draft_model && K > 0;
  if (st.tree && ((!out.accepted_nodes && B * K > 0) || out.accepted_nodes_len != B * K)) {
    throw size_error("accepted_nodes", "[B, K] = [" + std::to_string(B) + ", " + std::to_string(K) + "]",
                     B * K, out.accepted_nodes_len);
  }
  if (model || out.draft_tokens) {
    const std::string bk = "[B, K] = [" + std::to_string(B) + ", " + std::to_string(K) + "]";
    if (!out.draft_tokens || out.draft_tokens_len != B * K) {
      throw size_error("draft_tokens", bk, B * K, out.draft_tokens_len);
    }
  }
  for (int64_t b = 0; b < B; ++b) {
    const int64_t kb = st.k[static_cast<size_t>(b)];
    for (int64_t j = 0; j < kb && out.draft_tokens; ++j) {
      const int32_t d = out.draft_tokens[b * K + j];
      if (d < 0 || d >= V) {
        throw InvalidArgumentError("commit: draft_tokens" + row_at(b, j) + " must be in [0, " +
                                   std::to_string(V) + "), got " + std::to_string(d));
      }
      if (!model && d != st.proposals[static_cast<size_t>(b)][static_cast<size_t>(j)]) {
        throw InvalidArgumentError("commit: draft_tokens" + row_at(b, j) +
                                   " must be the n-gram proposal " +
                                   std::to_string(st.proposals[static_cast<size_t>(b)][static_cast<size_t>(j)]) +
                                   ", got " + std::to_string(d));
      }
    }
    const int64_t a = out.num_accepted[b];
    if (a < 0 || a > kb) {
      throw InvalidArgumentError("commit: num_accepted[" + std::to_string(b) + "] must be in [0, " +
                                 std::to_string(kb) + "] (the row's drafts), got " + std::to_string(a));
    }
    const int64_t n = out.num_emitted[b];
    if (n != a + 1) {
      throw InvalidArgumentError("commit: num_emitted[" + std::to_string(b) + "] must be num_accepted + 1 = " +
                                 std::to_string(a + 1) + ", got " + std::to_string(n));
    }
    const int32_t* row = out.tokens + b * (K + 1);
    if (st.tree) {  // the accepted path: a chain of nodes from the root, tokens equal theirs
      const auto& parents = st.parents[static_cast<size_t>(b)];
      const auto& ngram = st.proposals[static_cast<size_t>(b)];
      // a node's token: the draft model's proposal (checked above), else the trie's
      auto token_of = [&](int32_t node) {
        return model ? out.draft_tokens[b * K + node] : ngram[static_cast<size_t>(node)];
      };
      int32_t prev = -1;
      for (int64_t i = 0; i < a; ++i) {
        const int32_t node = out.accepted_nodes[b * K + i];
        if (node < 0 || node >= kb || parents[static_cast<size_t>(node)] != prev) {
          throw InvalidArgumentError(
              "commit: accepted_nodes" + row_at(b, i) + " must be a node in [0, " + std::to_string(kb) +
              ") whose parent is " + (i == 0 ? std::string("the root") : "node " + std::to_string(prev)) +
              ", got " + std::to_string(node) +
              (node >= 0 && node < kb ? " (parent " + std::to_string(parents[static_cast<size_t>(node)]) + ")" : ""));
        }
        if (row[i] != token_of(node)) {
          throw InvalidArgumentError("commit: tokens" + row_at(b, i) + " is accepted node " +
                                     std::to_string(node) + ", so it must equal its token " +
                                     std::to_string(token_of(node)) + ", got " +
                                     std::to_string(row[i]));
        }
        prev = node;
      }
      for (int64_t i = 0; i < n; ++i) {
        if (row[i] < 0 || row[i] >= V) {
          throw InvalidArgumentError("commit: tokens" + row_at(b, i) + " must be in [0, " +
                                     std::to_string(V) + "), got " + std::to_string(row[i]));
        }
      }
      continue;
    }
    for (int64_t i = 0; i < n; ++i) {
      if (row[i] < 0 || row[i] >= V) {
        throw InvalidArgumentError("commit: tokens" + row_at(b, i) + " must be in [0, " +
                                   std::to_string(V) + "), got " + std::to_string(row[i]));
      }
      const int32_t d = i < a ? (out.draft_tokens ? out.draft_tokens[b * K + i]
                                                  : st.proposals[static_cast<size_t>(b)][static_cast<size_t>(i)])
                              : -1;
      if (i < a && row[i] != d) {
        throw InvalidArgumentError("commit: tokens" + row_at(b, i) + " is accepted, so it must equal the draft " +
                                   std::to_string(d) + ", got " + std::to_string(row[i]));
      }
    }
  }
}

CommitOutput SpecDecoder::commit_row(OpenStep& st, int64_t b, const VerifyOutputs& out) {
  Sequence& s = *st.rows[static_cast<size_t>(b)];
  const int64_t K = st.K;
  const int64_t C = s.committed();
  const int64_t kb = st.k[static_cast<size_t>(b)];
  const int64_t a = out.num_accepted[b];
  const int32_t* emitted = out.tokens + b * (K + 1);
  const int64_t keep = st.keep[static_cast<size_t>(b)];
  const FinishReason reason = st.reason[static_cast<size_t>(b)];
  s.tokens.insert(s.tokens.end(), emitted, emitted + keep);
  if (s.ngram) s.ngram->extend(emitted, keep);

  SequenceStats& stats = s.stats;
  stats.steps += 1;
  const int64_t f = st.draft_tree ? st.fanout[static_cast<size_t>(b)] : 1;
  if (config_.has_draft_model) stats.draft_forwards += (kb + f - 1) / f;
  stats.proposed += kb;
  stats.accepted += a;
  stats.emitted += keep;
  stats.k_history.push_back(static_cast<int32_t>(kb));
  if (static_cast<int64_t>(stats.proposed_at.size()) < kb) {
    stats.proposed_at.resize(static_cast<size_t>(kb), 0);
    stats.accepted_at.resize(static_cast<size_t>(kb), 0);
  }
  for (int64_t j = 0; j < kb; ++j) {
    stats.proposed_at[static_cast<size_t>(j)] += 1;
    if (j < a) stats.accepted_at[static_cast<size_t>(j)] += 1;
  }
  if (f > 1 && kb > 0) {
    // A draft tree: its spine is a chain of `depth` proposals, accepted up to the level
    // where the spine node was rejected; there, a sibling was accepted (the path ended
    // on it) or not, when the level had siblings (adaptive_k.h, expected_tree_tokens).
    const int64_t depth = (kb + f - 1) / f;
    const int32_t last = a > 0 ? out.accepted_nodes[b * K + a - 1] : -1;
    const bool on_sibling = last >= 0 && last % f != 0;
    const int64_t spine = on_sibling ? a - 1 : a;
    s.tree_steps += 1;
    s.trackers[static_cast<size_t>(s.tracker)].update(depth, spine);
    population_[static_cast<size_t>(s.tracker)].update(depth, spine);
    if (spine < depth && std::min(f, kb - spine * f) > 1) {
      s.sibling.update(1, on_sibling ? 1 : 0);
      population_sibling_.update(1, on_sibling ? 1 : 0);
    }
  } else {
    const std::vector<double>& shares = st.freqs[static_cast<size_t>(b)];
    AcceptanceTracker& own = s.trackers[static_cast<size_t>(s.tracker)];
    AcceptanceTracker& all = population_[static_cast<size_t>(s.tracker)];
    const std::vector<bool>& recent = st.recent[static_cast<size_t>(b)];
    if (!shares.empty() && static_cast<int64_t>(shares.size()) >= kb &&
        static_cast<int64_t>(recent.size()) >= kb) {
      // An n-gram trie row under adaptive k (adaptive_k.h, expected_trie_tokens). a: a
      // trial at each level where the continuations agreed (share 1), accepted on the
      // path, rejected below it (the level's one node proposed). r: a trial at each
      // level where they disagreed below the most recent continuation with its node
      // proposed: accepted there, or not.
      const std::vector<int32_t>& par = st.parents[static_cast<size_t>(b)];
      const bool tree = st.tree && out.accepted_nodes != nullptr;
      const auto node = [&](int64_t j) {
        return tree ? static_cast<int64_t>(out.accepted_nodes[b * K + j]) : j;
      };
      // the proposed child of `parent` on the most recent continuation where the
      // continuations disagree there, else -1
      const auto recent_child = [&](int64_t parent) {
        if (parent >= 0 && !recent[static_cast<size_t>(parent)]) return int64_t{-1};
        for (int64_t i = 0; i < kb; ++i) {
          if (par[static_cast<size_t>(i)] == parent && recent[static_cast<size_t>(i)] &&
              shares[static_cast<size_t>(i)] < kAgreedShare)
            return i;
        }
        return int64_t{-1};
      };
      for (int64_t j = 0; j <= a; ++j) {
        const int64_t parent = j == 0 ? -1 : node(j - 1);
        if (j < a) {
          const int64_t at = node(j);
          if (shares[static_cast<size_t>(at)] >= kAgreedShare) {
            own.update(1, 1), all.update(1, 1);
          } else if (recent_child(parent) >= 0) {
            const int64_t hit = recent[static_cast<size_t>(at)] ? 1 : 0;
            s.recent.update(1, hit), population_recent_.update(1, hit);
          }
          continue;
        }
        int64_t below = 0, only = -1;  // the rejection level
        for (int64_t i = 0; i < kb; ++i) {
          if (par[static_cast<size_t>(i)] == parent) ++below, only = i;
        }
        if (below == 1 && shares[static_cast<size_t>(only)] >= kAgreedShare) {
          own.update(1, 0), all.update(1, 0);
        } else if (below > 0 && recent_child(parent) >= 0) {
          s.recent.update(1, 0), population_recent_.update(1, 0);
        }
      }
    } else {
      // a chain of kb proposals of which a were accepted (or a trie under a fixed k,
      // counted as one: a conservative estimate of the chain acceptance rate)
      own.update(kb, a);
      all.update(kb, a);
    }
  }
  stats.acceptance_estimate.resize(s.trackers.size());
  for (size_t i = 0; i < s.trackers.size(); ++i) stats.acceptance_estimate[i] = s.trackers[i].rate;

  CommitOutput o;
  o.seq = s.id;
  o.new_tokens.assign(emitted, emitted + keep);
  if (reason != FinishReason::kNone) {
    finish(s, reason);
  } else {
    // What the committed tokens justify: the target cached C + k positions, of which
    // C + a hold accepted tokens; the draft cached up to C + k - 1.
    target_alloc_.rollback(s.target_seq, C + a);
    // The draft cached the spine (a chain row: every node is): valid for the accepted
    // path's leading spine nodes, node j * f at level j.
    int64_t spine = a;
    if (st.draft_tree) {
      spine = 0;
      while (spine < a && out.accepted_nodes[b * K + spine] == spine * f) ++spine;
    }
    if (draft_alloc_) {
      // A draft that reads the target's states keeps only its catch-up (positions < C,
      // drafted from the target's states; see DecoderConfig::draft_reads_target).
      const int64_t draft_keep = config_.draft_reads_target ? C : C + spine;
      draft_alloc_->rollback(s.draft_seq,
                             std::min(draft_alloc_->length(s.draft_seq), draft_keep));
    }
  }
  return o;
}

void SpecDecoder::record_times(const OpenStep& st, const StepTimes& times) {
  double draft_forward = 0, draft_sample = 0, steady = 0;
  int64_t steady_passes = 0;
  for (size_t j = 0; j < times.draft_forward.size(); ++j) {
    draft_forward += times.draft_forward[j];
    draft_sample += times.draft_sample[j];
    if (st.passes[j].steady) {
      steady += times.draft_forward[j] + times.draft_sample[j];
      ++steady_passes;
    }
  }
  // A draft pass is one number: its steady passes only (a catch-up of many tokens would
  // make a pass look far dearer than the ones k is chosen for). The target pass is keyed
  // by its total tokens, so every pass measures it, prefill chunks included.
  if (config_.has_draft_model && steady_passes > 0) {
    cost_.observe_draft(steady / static_cast<double>(steady_passes));
  }
  cost_.observe_target(st.verify_tokens, times.target_forward + times.verify);
  times_.draft_forward += draft_forward;
  times_.draft_sample += draft_sample;
  times_.target_forward += times.target_forward;
  times_.verify += times.verify;
  times_.bookkeeping += std::max(0.0, times.total - draft_forward - draft_sample -
                                          times.target_forward - times.verify);
  times_.steps += 1;
}

std::vector<CommitOutput> SpecDecoder::commit(uint64_t step_id, const VerifyOutputs& out,
                                              const StepTimes& times) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!open_ || open_->id != step_id) {
    throw StepInProgressError("commit: step " + std::to_string(step_id) + " is not the open step (" +
                              (open_ ? std::to_string(open_->id) : std::string("none")) + ")");
  }
  NvtxRange range("verispec.commit");
  OpenStep& st = *open_;
  const int64_t B = static_cast<int64_t>(st.rows.size());
  const size_t draft_passes = st.passes.size() - 1;
  try {
    check_outputs(st, out);
    // No draft times at all is allowed (a caller that does not time); any given must match.
    if ((!times.draft_forward.empty() || !times.draft_sample.empty()) &&
        (times.draft_forward.size() != draft_passes || times.draft_sample.size() != draft_passes)) {
      throw InvalidArgumentError("commit: times must hold one draft_forward and one draft_sample per draft pass (" +
                                 std::to_string(draft_passes) + "), got " +
                                 std::to_string(times.draft_forward.size()) + " and " +
                                 std::to_string(times.draft_sample.size()));
    }
    // The stop rules are pure: decide every row before changing any.
    st.keep.resize(static_cast<size_t>(B));
    st.reason.resize(static_cast<size_t>(B));
    for (int64_t b = 0; b < B; ++b) {
      const Sequence& s = *st.rows[static_cast<size_t>(b)];
      const std::vector<int32_t> generated(s.tokens.begin() + s.prompt_len, s.tokens.end());
      st.keep[static_cast<size_t>(b)] =
          apply_stop_rules(s.stop, generated, out.tokens + b * (st.K + 1), out.num_emitted[b],
                           s.prompt_len, config_.max_context, &st.reason[static_cast<size_t>(b)]);
    }
  } catch (...) {
    end_step(/*restore=*/true);
    throw;
  }
  std::vector<CommitOutput> outputs;
  outputs.reserve(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) outputs.push_back(commit_row(st, b, out));
  for (Sequence* s : st.prefill) s->stats.prefill_chunks += 1;  // the cache holds the chunk
  record_times(st, times);
  offset_ = st.base_offset + static_cast<uint64_t>(st.K) + 1;
  end_step(/*restore=*/false);
  // Queued aborts finished some rows; released rows are gone.
  std::vector<CommitOutput> kept;
  kept.reserve(outputs.size());
  for (CommitOutput& o : outputs) {
    const auto& slot = seqs_[static_cast<size_t>(o.seq)];
    if (!slot) continue;
    o.finish = slot->finish;
    kept.push_back(std::move(o));
  }
  return kept;
}

void SpecDecoder::cancel_step(uint64_t step_id) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!open_ || open_->id != step_id) return;  // already ended (commit restores on its own failures)
  end_step(/*restore=*/true);
}

void SpecDecoder::end_step(bool restore) {
  std::unique_ptr<OpenStep> st = std::move(open_);
  for (size_t b = 0; b < st->rows.size(); ++b) {
    Sequence& s = *st->rows[b];
    s.in_step = false;
    if (!restore) continue;
    // Only cache lengths and the adaptive-k probe counters moved (no restore can fail).
    if (b < st->tracker_mark.size()) s.trackers = std::move(st->tracker_mark[b]);
    if (s.target_seq >= 0) target_alloc_.rollback(s.target_seq, st->target_mark[b]);
    if (draft_alloc_ && s.draft_seq >= 0) draft_alloc_->rollback(s.draft_seq, st->draft_mark[b]);
  }
  for (size_t i = 0; i < st->prefill.size(); ++i) {
    Sequence& s = *st->prefill[i];
    s.in_step = false;
    if (restore && s.target_seq >= 0) target_alloc_.rollback(s.target_seq, st->prefill_mark[i]);
  }
  if (restore) {  // copies of blocks a failed plan allocated: nothing will write them
    target_alloc_.take_block_copies();
    if (draft_alloc_) draft_alloc_->take_block_copies();
    unadmit(st->admitted);
  }
  for (int64_t id : st->pending_abort) {
    if (seqs_[static_cast<size_t>(id)]) abort_now(id);
  }
  for (int64_t id : st->pending_release) {
    if (seqs_[static_cast<size_t>(id)]) release_now(id);
  }
}

}  // namespace verispec

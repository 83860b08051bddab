// SpecDecoder: sequences, the decisions of the draft -> verify -> commit step, stop rules,
// statistics.
//
// Pure C++: the decoder never touches a tensor and never calls out. A step is three
// calls, all made by the caller (python/verispec/decoder.py drives them):
//
//   begin_step()   decides everything that does not depend on model outputs: which
//                  sequences run, k per row, n-gram proposals, and every forward pass of
//                  the step (K draft passes, then the verify pass), with their cache
//                  slots allocated and their inputs packed into ONE host buffer (so a
//                  GPU caller copies the step's metadata to the device once).
//   commit(...)    takes what the models and the verify op produced, checks all of it
//                  (shapes, token ids in [0, V), counts within [0, k], accepted tokens
//                  equal to the proposals), and only then commits tokens, stops, caches,
//                  n-gram indexes, statistics and the cost model.
//   cancel_step()  puts every sequence, both caches and the n-gram indexes back as they
//                  were before begin_step. commit() does the same itself when its inputs
//                  fail a check.
//
// Scheduling: add() queues a sequence; each begin_step() admits waiting sequences in rank
// order: higher priority first (add's `priority`, 0 by default), then arrival (FIFO), at
// most max_num_seqs running, and at most max_tokens_per_step (every decoding sequence
// takes at least one token of a step). When the step's passes do not fit the free cache
// blocks, the last running sequence in rank order (lowest priority, then newest) is
// preempted: its blocks are freed, its committed tokens kept, and it waits at its place
// in the queue; admitted again, it recomputes its caches (its next input is
// committed[0:]). A waiting sequence that outranks the last running one and finds no room
// (blocks or max_num_seqs) preempts it the same way. CacheFullError reaches the caller
// only when one sequence alone does not fit.
//
// Token budget and chunked prefill (max_tokens_per_step > 0): the target pass carries at
// most that many tokens. Decoding rows (one uncached token) come first, k + 1 tokens each;
// when they do not fit, k shrinks (to 0 at worst: a decoding row always runs). Then rows
// with more uncached tokens (a new prompt, a preempted sequence's recompute) take the
// rest in rank order: a row whose uncached tokens fit becomes a verify row as usual
// (its k shrunk to what is left); the first that does not fit prefills a chunk of them
// and emits nothing this step. Such a prefill row is an extra row of the verify pass
// after the B verify rows (see PassLayout): no logits, no draft passes; its target cache
// holds the chunk after the step. Rows the budget leaves no token wait for the next step.
//
// Threads: every public method takes one mutex, so calls from several threads are
// serialised. A step spans calls, so begin_step() of a second step while one is open
// throws StepInProgressError. abort() and release() of a sequence that belongs to the
// open step are queued and applied when the step ends (commit or cancel); add() takes
// effect at once (the new sequence joins the next step).
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
//       draft cache  = min(C + k - 1, C + a)  (k >= 1; a row with k = 0 keeps Ld)
//
// Trees (DecoderConfig::ngram_branches > 1): a decoding row's k proposals are the nodes
// of an n-gram trie (NGramIndex::propose_tree; parents[i] < i, -1: the root), and the
// verify pass carries them like a chain: node i is input C - Lt + i of its row, cached
// at index C + i, at RoPE position C + depth(i) - 1 (depth 1: a child of the root), and
// the pass carries an ancestor mask (PassLayout::tree_mask, the layout of
// PagedBatch.tree_mask in python/verispec/models/base.py). The caller verifies with
// ops.verify_tree and hands commit the accepted nodes; before commit it moves the
// accepted path's K/V into place (cache index C + accepted_nodes[j] -> C + j, j < a,
// in increasing j; python/verispec/decoder.py _move_accepted is the one place), and
// commit rolls the target back to C + a as for a chain. Rows with more than
// kTreeMaxUncached uncached tokens (a long prompt, a recompute) and keyed rows propose
// chains (parents i - 1) in the same pass. With adaptive k a trie row runs the first m
// nodes of either its trie or the chain of the most recent continuation, whichever the
// continuations' shares make faster (adaptive_k.h, expected_trie_tokens).
//
// Draft trees (DecoderConfig::draft_branches = f > 1, a draft model): a row's k nodes
// have a fixed shape, level by level: node i is child i % f of level i / f; the f
// children of level 0 are the root's, and level l >= 1's are the children of node
// (l - 1) * f, the first child of level l - 1 (the "spine"). Draft pass j (j < depth =
// ceil(k / f)) draws level j's children from one q: pass 0 after the catch-up as for a
// chain, pass j >= 1 with the spine node of level j - 1 as its one input, at position
// C + j - 1. So the draft's passes and cache are a chain's (no tree mask there: only
// spine nodes are ever fed to the draft), and its cache stays valid for the accepted
// path's leading spine nodes: commit rolls the draft back to C + that many (capped by
// what it cached). The target verifies the whole tree in one pass as for n-gram tries;
// keyed rows and rows with more than kTreeMaxUncached uncached tokens propose chains.
// With adaptive k a row's chain depth d is chosen as a chain's (on the spine's
// acceptance, the node budget as its cap), and the row proposes the tree of depth
// min(d, k / f) only where its siblings' measured acceptance pays their verify rows and
// the lost depth (adaptive_k.h, tree_pays), else the chain of d.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "verispec/adaptive_k.h"
#include "verispec/block_allocator.h"
#include "verispec/errors.h"
#include "verispec/ngram.h"

namespace verispec {

enum class ModelRole : int32_t { kTarget = 0, kDraft = 1 };

// How a sequence samples; identical for target and draft (docs/design.md). Greedy is
// temperature 0, the one representation inside the library.
struct SamplingParams {
  float temperature = 1.0f;
  int32_t top_k = 0;
  float top_p = 1.0f;
  float min_p = 0.0f;
  // Per-request reproducible sampling: the sequence draws from the keyed stream of `seed`
  // (philox.h), addressed by token position, and is verified by the keyed rule
  // (python/verispec/ops.py verify_keyed): its tokens are the same alone or in any batch,
  // with any k and any draft. Unkeyed sequences draw from the decoder's stream.
  bool keyed = false;
  uint64_t seed = 0;
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
  int64_t prefill_chunks = 0;   // target passes that cached a chunk of it and emitted nothing
  int64_t preemptions = 0;      // times its cache was freed for others (it recomputes it)
  // Adaptive k's current acceptance estimates: [draft model], or n-gram proposals by
  // the length of the matched suffix [min_n .. max_n].
  std::vector<double> acceptance_estimate;
};

// One forward pass of a step: T new tokens of B rows, flattened. The arrays live in
// StepPlan::inputs; each offset below is a BYTE offset into it (8-byte aligned), so a
// caller views them after one copy of the whole buffer.
//
// The verify pass holds the step's B verify rows, then its prefill rows (StepPlan::
// prefill_seqs): num_rows = B + P; query_start, block_tables and context_lens cover all
// of them; logits_indices only the verify rows ([B, K + 1]). A step of prefill chunks
// only (B = 0) asks one logits row, its last token's, which the caller does not use (so
// a model never sees R = 0).
struct PassLayout {
  ModelRole role = ModelRole::kTarget;
  int64_t num_rows = 0;        // B of this pass (the verify pass: verify + prefill rows)
  int64_t num_tokens = 0;      // T
  int64_t max_blocks = 0;      // M
  int64_t num_logits = 0;      // R
  // int64 arrays
  int64_t input_ids = 0;       // [T]; draft passes j >= 1 and a draft model's proposals
                               //      in the verify pass hold -1: filled on the device
  int64_t positions = 0;       // [T]
  int64_t query_start = 0;     // [B + 1]
  int64_t logits_indices = 0;  // [R] flattened token index per logits row
  int64_t rows = 0;            // [B] the step row (verify row) of each of this pass's rows
                               //      (-1: a prefill row of the verify pass)
  int64_t draft_index = 0;     // [B] draft passes: rows[i] * K + j, where this pass's
                               //      proposals go in the [B, K] draft tokens (draft
                               //      trees: the first of its children, rows[i] * K + j * f)
  int64_t num_children = 0;    // [B] draft passes of a draft-tree step: proposals this
                               //      row draws from this pass's q (1 .. f), stored at
                               //      draft_index .. draft_index + num_children - 1
  int64_t q_index = 0;         // [B] draft passes of a draft-tree step: the row of the
                               //      [B, K + 1, V] draft probabilities this pass's q goes
                               //      to: rows[i] * (K + 1) + (j == 0 ? 0 : (j - 1) * f + 1)
  int64_t prev_index = 0;      // [B] draft passes j >= 1: index of each row in the
                               //      previous pass's proposals (its input token)
  int64_t fill_positions = 0;  // [P] verify pass: flattened input indices that take
  int64_t fill_sources = 0;    // [P]   draft_tokens.view(-1)[fill_sources] (draft model)
  int64_t num_fill = 0;        // P
  // int32 arrays
  int64_t slot_mapping = 0;    // [T]
  int64_t block_tables = 0;    // [B, M], -1 padded
  int64_t context_lens = 0;    // [B] cached length after this forward
  // uint8 [T, T] (the verify pass of a tree step whose rows branch, else absent): token t
  // of row b sees the row's keys cached before this pass and the row's new tokens u
  // with tree_mask[t, u] = 1 (its ancestors and itself; a chain token: the row's earlier
  // new tokens and itself); 0 across rows.
  bool has_tree_mask = false;
  int64_t tree_mask = 0;
};

// Per-row sampling policy of the step's rows (float arrays in the inputs buffer); when
// every row agrees, uniform is true and the scalars hold the common value.
struct PolicyLayout {
  bool uniform = true;
  float temperature = 1.0f;
  int32_t top_k = 0;
  float top_p = 1.0f;
  float min_p = 0.0f;
  int64_t temperature_rows = 0;  // float32 [B]
  int64_t top_k_rows = 0;        // int32 [B]
  int64_t top_p_rows = 0;        // float32 [B]
  int64_t min_p_rows = 0;        // float32 [B]
  // Keyed rows (SamplingParams::keyed): whether any row is, which, their seeds, and the
  // position of each row's first token of the step (its committed length).
  bool any_keyed = false;
  bool all_keyed = false;
  int64_t keyed_rows = 0;        // int32 [B]: 1 for a keyed row
  int64_t seed_rows = 0;         // int64 [B] (uint64 bits)
  int64_t position_rows = 0;     // int64 [B]
};

// What begin_step decided: the rows, k, every pass, and their inputs in one buffer.
struct StepPlan {
  uint64_t step_id = 0;          // pass it back to commit / cancel_step
  int64_t batch = 0;             // B verify rows (0 and no prefill rows: nothing runs, no
                                 // step was opened; 0 with prefill rows: a step of chunks)
  int64_t k = 0;                 // K = the largest k of the step
  std::vector<int64_t> seqs;     // [B] sequence id of each row
  std::vector<int32_t> row_k;    // [B] k of each row
  std::vector<int64_t> prefill_seqs;  // [P] sequences that prefill a chunk and emit nothing
  bool draft_model = false;      // the draft passes sample proposals (q kept)
  uint64_t seed = 0;
  uint64_t offset = 0;           // the verify call's Philox offset; draft pass j: offset + 1 + j
  std::vector<PassLayout> passes;  // draft passes (role kDraft), then the verify pass
  int64_t draft_tokens = 0;      // int32 [B, K] proposals, -1 padded (n-gram: filled;
                                 // draft model: -1, filled by the caller's passes)
  int64_t num_draft = 0;         // int32 [B] = row_k
  // Tree steps (DecoderConfig::ngram_branches > 1): verify with ops.verify_tree over the
  // proposals as nodes, with parents int32 [B, K] (-1: the root, and padding past k).
  bool tree = false;
  int64_t tree_parents = 0;
  // Draft-tree steps (DecoderConfig::draft_branches > 1, a draft model): the draft passes
  // sample each row's children (PassLayout::num_children, q_index), and verify_tree gets
  // the draft probabilities [B, K + 1, V] (row 0: q at the root, row i + 1: q at node i).
  bool draft_tree = false;
  PolicyLayout policy;
  std::vector<uint8_t> inputs;   // the packed arrays above
  // Copy-on-write copies to perform on each model's pools before the first pass.
  std::vector<BlockCopy> target_copies;
  std::vector<BlockCopy> draft_copies;
};

// Time a step spent where the caller ran things (seconds). The cost model learns the
// target pass by its total tokens from every step, a draft pass from the steady ones
// (one new token per row); the rest only feeds the phase totals.
struct StepTimes {
  std::vector<double> draft_forward;  // per draft pass
  std::vector<double> draft_sample;   // per draft pass
  double target_forward = 0;
  double verify = 0;
  double total = 0;                   // the whole step, begin to commit
};

// What the caller's verify produced (ops.verify's outputs), host int32.
struct VerifyOutputs {
  const int32_t* tokens = nullptr;        // [B, K + 1]
  int64_t tokens_len = 0;
  const int32_t* num_emitted = nullptr;   // [B]
  int64_t num_emitted_len = 0;
  const int32_t* num_accepted = nullptr;  // [B]
  int64_t num_accepted_len = 0;
  const int32_t* draft_tokens = nullptr;  // [B, K] the proposals (a draft model's; n-gram: may be null)
  int64_t draft_tokens_len = 0;
  const int32_t* accepted_nodes = nullptr;  // [B, K] tree steps: the accepted path's nodes
  int64_t accepted_nodes_len = 0;
};

struct DecoderConfig {
  int64_t k = 4;                    // fixed k (0: plain decoding), or the largest k
  bool adaptive_k = false;          // choose k per sequence and step (adaptive_k.h)
  bool has_draft_model = false;     // a draft model proposes (sampled, q kept)
  // The draft model reads and writes the target's KV cache (early-exit
  // self-speculation: its layers are the target's first layers, so the K/V the target
  // wrote for committed tokens are exactly what the draft would write). The draft then
  // has no cache of its own and never catches up; its proposals' K/V are dropped
  // before the verify pass rewrites those positions.
  bool draft_shares_target_cache = false;
  // The draft model reads the target's hidden states of the tokens before its inputs
  // (EAGLE-3, DFlash: the target writes them beside its K/V). Its cache then holds only
  // positions drafted from the target's own states: a row drafts once the target has
  // cached all but its last committed token (not in the step that prefills or
  // recomputes its prompt), and after each commit the draft's cache keeps what the step's
  // catch-up pass wrote (positions < C), so the next catch-up redoes the accepted
  // proposals from the target's states instead of keeping the draft's own guesses.
  bool draft_reads_target = false;
  int64_t ngram_min_n = 0;          // > 0: n-gram prompt lookup proposes (one-hot q)
  int64_t ngram_max_n = 0;
  // > 1: n-gram drafting proposes tries of at most k nodes with at most this many
  // children per node (trees; see the top of this file); 1: chains.
  int64_t ngram_branches = 1;
  // > 1: a draft model proposes trees (draft trees, below) of at most k nodes with this
  // many children per expanded node; 1: chains. Needs has_draft_model.
  int64_t draft_branches = 1;
  int64_t target_num_blocks = 0;
  int64_t draft_num_blocks = 0;
  int64_t block_size = 16;
  int64_t vocab_size = 0;
  int64_t max_context = 0;          // the target's context length
  int64_t draft_max_context = 0;    // a draft model's (0: the target's); rows past it stop drafting
  uint64_t seed = 0;
  // Admission: at most this many sequences run in a step (0: no limit); the others wait
  // in rank order (priority, then FIFO).
  int64_t max_num_seqs = 0;
  // The target pass's token budget (0: no limit; else >= 1): see "Token budget" above.
  int64_t max_tokens_per_step = 0;
};

// The largest k a decoder takes.
constexpr int64_t kMaxK = 64;
// Tree steps: a row with more uncached tokens than this (a long prompt, a recompute)
// proposes a chain, so that the verify pass's [T, T] tree mask stays small.
constexpr int64_t kTreeMaxUncached = 64;

// Wall time by phase, summed over steps (seconds).
struct PhaseTimes {
  double draft_forward = 0;   // draft model passes
  double draft_sample = 0;    // policy + sampling of proposals
  double target_forward = 0;  // the verify pass of the target
  double verify = 0;          // the verify op
  double bookkeeping = 0;     // everything else: plan, commit, rollback, the caller's glue
  int64_t steps = 0;
};

// What one step committed for one sequence.
struct CommitOutput {
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

  // Adds a sequence (any time, also while a step is open: it joins the next one).
  // Validates the prompt against the vocabulary and the context length, and the policy.
  // `priority`: higher runs first (see "Scheduling" above). Returns its id; ids of
  // released sequences are reused.
  // ngram_context (n-gram drafting only): earlier text the sequence's n-gram index reads
  // before its prompt (token ids, NGramIndex::kSeparator between texts; one more
  // separator is put after it): proposals may come from it, never across a separator.
  int64_t add(const std::vector<int32_t>& prompt, const SamplingParams& sampling,
              const StopParams& stop, int64_t priority = 0,
              const std::vector<int32_t>& ngram_context = {});
  // Ends a sequence (finish reason kAborted if it was running) and frees its cache
  // blocks; its record stays until release(). Queued while it takes part in an open step.
  void abort(int64_t seq);
  // Forgets a sequence (any state) and frees its id; UnknownSequenceError for an unknown
  // id. Queued while it takes part in an open step (it is unknown after the step).
  void release(int64_t seq);

  // The step's phases (see the top of this file).
  StepPlan begin_step();
  std::vector<CommitOutput> commit(uint64_t step_id, const VerifyOutputs& out,
                                   const StepTimes& times);
  void cancel_step(uint64_t step_id);
  bool step_open() const;

  // Restarts the random stream: seed, and offset 0 (reproducible runs).
  void reseed(uint64_t seed);

  // Whether any sequence is running or waiting (step() has work).
  bool has_running() const;
  int64_t num_running() const;
  // Sequences waiting for admission: added but not yet admitted, or preempted.
  int64_t num_waiting() const;
  int64_t num_preemptions() const;  // total, over the decoder's life
  int64_t num_sequences() const;  // records held (running, finished, not released)
  std::vector<int32_t> generated(int64_t seq) const;
  FinishReason finish_reason(int64_t seq) const;
  SequenceStats stats(int64_t seq) const;
  int64_t cache_len(int64_t seq, ModelRole role) const;
  int64_t committed_len(int64_t seq) const;
  // The committed tokens (prompt + generated) and a model's block table.
  std::vector<int32_t> committed(int64_t seq) const;
  std::vector<int32_t> block_table(int64_t seq, ModelRole role) const;
  int64_t num_free_blocks(ModelRole role) const;
  int64_t num_blocks(ModelRole role) const;
  const DecoderConfig& config() const { return config_; }
  uint64_t offset() const;
  PhaseTimes times() const;
  CostModel cost_model() const;
  // The acceptance rate every new sequence starts from, per tracker (AcceptanceTracker::
  // seeded_by of the population).
  std::vector<double> acceptance_prior() const;

 private:
  struct Sequence;
  struct OpenStep;

  Sequence& get(int64_t seq);
  const Sequence& get(int64_t seq) const;
  bool in_open_step(int64_t seq) const;
  void finish(Sequence& s, FinishReason reason);
  void abort_now(int64_t seq);
  void release_now(int64_t seq);
  const BlockAllocator& alloc(ModelRole role) const;
  BlockAllocator& alloc(ModelRole role);
  int64_t seq_for(const Sequence& s, ModelRole role) const;

  // begin_step's phases.
  struct Choice;
  // `chain`: the row proposes a chain even in tree steps (see kTreeMaxUncached).
  int64_t draft_fanout(const Sequence& s, bool chain) const;
  // trie (may be null): for an n-gram trie row under adaptive k, gets the trie's shares
  // and the chain the row may run instead (Choice::freqs, chain, chain_freqs).
  int64_t draft_cap(Sequence& s, std::vector<int32_t>* ngram_proposals,
                    std::vector<int32_t>* parents, bool chain, Choice* trie = nullptr);
  void choose_ks(const std::vector<Choice*>& rows, BatchRest rest);
  void plan_draft_passes(OpenStep& st);
  void plan_verify_pass(OpenStep& st);
  void pack_inputs(OpenStep& st, StepPlan* plan);
  // commit's phases.
  void check_outputs(const OpenStep& st, const VerifyOutputs& out) const;
  CommitOutput commit_row(OpenStep& st, int64_t b, const VerifyOutputs& out);
  void record_times(const OpenStep& st, const StepTimes& times);
  // Ends the open step: restores its marks if `restore`, then applies queued calls.
  void end_step(bool restore);
  // Scheduling: admits waiting sequences (rank order, within max_num_seqs); frees the
  // last running sequence's caches (lowest priority, then newest) and puts it back in the
  // queue (it keeps its tokens and recomputes its caches when admitted again).
  std::vector<int64_t> admit();
  void unadmit(const std::vector<int64_t>& seqs);  // back to the queue (a cancelled step)
  void preempt_newest();
  void enqueue(int64_t seq);
  bool ahead(int64_t a, int64_t b) const;  // a ranks before b: higher priority, then older
  void insert_ranked(std::vector<int64_t>* order, int64_t seq) const;
  bool plan_step(StepPlan* plan, const std::vector<int64_t>& admitted);

  DecoderConfig config_;
  mutable std::mutex mu_;
  BlockAllocator target_alloc_;
  std::unique_ptr<BlockAllocator> draft_alloc_;
  std::vector<std::unique_ptr<Sequence>> seqs_;  // by id; null when free
  std::vector<int64_t> free_ids_;                // released ids, reused by add()
  std::vector<int64_t> running_;                 // running ids in rank order
  std::vector<int64_t> waiting_;                 // waiting ids in rank order
  uint64_t next_arrival_ = 0;
  int64_t preemptions_ = 0;
  std::unique_ptr<OpenStep> open_;               // the open step, if any
  uint64_t next_step_id_ = 1;
  uint64_t offset_ = 0;
  PhaseTimes times_;
  CostModel cost_;
  // Acceptance over every sequence (per tracker, as Sequence::trackers): a new sequence
  // starts from it (AcceptanceTracker::seeded_by).
  std::vector<AcceptanceTracker> population_;
  // Draft trees: the population's sibling acceptance (Sequence::sibling starts from it).
  AcceptanceTracker population_sibling_;
  // n-gram tries: the population's recency rate (Sequence::recent starts from it).
  AcceptanceTracker population_recent_;
};

}  // namespace verispec

// Framework-free launchers of verispec's sampling ops (CPU and CUDA).
//
// Raw pointers, element strides and sizes in, a status out; no torch, no pybind11,
// and no CUDA header (streams travel as `void*`). Shapes, dtypes and devices are
// validated by the binding layer; these functions validate what they see while
// running (values) and never throw.
//
// Conventions, for every op:
//   * the last (vocab) dimension is contiguous; other strides are in elements;
//   * outputs are written by the op into memory the caller allocated (destination
//     passing); on an error the rows at fault get the documented padding values;
//   * pointers of a CUDA op are device pointers on `CudaLaunch::device`, including the
//     per-row policy arrays and the seed/offset pointers; those of a CPU op are host;
//   * randomness is an input: coin = philox.h `uniform(seed, offset, row, position,
//     purpose)`. Give seed/offset as pointers to let a CUDA graph replay with new
//     values; a call consumes one offset, the caller advances it by one per call.
//
// The semantics below are pinned; python/verispec/reference.py implements the same in
// PyTorch and the tests compare the two.
#pragma once

#include <cstddef>
#include <cstdint>

namespace verispec {

// Element type of logits.
enum class LogitsDType : int32_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

enum class StatusCode : int32_t {
  kOk = 0,
  kInvalidArgument = 1,     // a host-side argument is wrong; `what` says which (and
                            // `value` holds it where it is a number: a policy scalar)
  kInvalidPolicy = 2,       // per-row policy value out of range: row; col = PolicyField
  kNumDraftOutOfRange = 3,  // num_draft[row] not in [0, num_spec]
  kTokenOutOfRange = 4,     // draft_tokens[row, col] not in [0, vocab)
  kNanOrInfLogits = 5,      // NaN or +Inf in logits row `row`, or no finite logit in it
                            // (-Inf is a mask): col = vocab index, -1 for an all -Inf
                            // row (apply_policy), or the position (verify)
  kInvalidProbs = 6,        // probs/draft_probs negative, NaN or Inf (or a probs row of
                            // zero mass): col = vocab index (sample) or position (verify)
  kCudaError = 7,           // a CUDA runtime call failed; `what` is its message
  kCudaNotCompiled = 8,     // a CUDA op was called in a build without CUDA
  kInvalidParent = 9,       // verify_tree: parents[row, col] not in [-1, col)
  kDuplicateSibling = 10,   // verify_tree: node col holds the token of an earlier sibling
                            // (deterministic candidates, or drawn without replacement)
};

// Which per-row policy value a kInvalidPolicy status is about (its `col`).
enum class PolicyField : int32_t { kTemperature = 0, kTopK = 1, kTopP = 2, kMinP = 3 };

struct OpStatus {
  StatusCode code = StatusCode::kOk;
  int64_t row = -1;        // batch row at fault, -1 if none
  int64_t col = -1;        // column at fault (see StatusCode), -1 if none
  bool has_value = false;  // whether `value` holds the offending value
  double value = 0.0;
  const char* what = "";   // static text: which rule was broken
  bool ok() const { return code == StatusCode::kOk; }
};

// Sampling policy. Each parameter is the scalar, or per-row values when its pointer is
// non-null ([rows] of apply_policy, [batch] of verify). Their ranges are the *_valid
// predicates of sampling_math.h, in words in policy_rules.h (policy_rule); per-row values
// outside them give kInvalidPolicy, scalars kInvalidArgument (with the value). Meaning:
//   temperature  0 means greedy: one-hot at argmax (ties: lowest index)
//   top_k        0 or >= vocab disables it
//   top_p        1 disables it
//   min_p        0 disables it
struct PolicyParams {
  float temperature = 1.0f;
  const float* temperature_per_row = nullptr;
  int32_t top_k = 0;
  const int32_t* top_k_per_row = nullptr;
  float top_p = 1.0f;
  const float* top_p_per_row = nullptr;
  float min_p = 0.0f;
  const float* min_p_per_row = nullptr;
};

// Philox key and offset: the scalar, or read at run time through a one-element pointer
// when non-null (int64 reinterpreted as uint64). offset must be < 2^60 (philox.h).
struct RandomParams {
  uint64_t seed = 0;
  const int64_t* seed_ptr = nullptr;
  uint64_t offset = 0;
  const int64_t* offset_ptr = nullptr;
};

// ---- apply_policy ---------------------------------------------------------------
// probs[n] = policy(logits[n]) for n < rows:
//   temperature 0  -> one-hot at argmax(logits[n]) (ties: lowest index); else
//   p = softmax(logits / T);
//   top-k: keep p >= (k-th largest p)                      (ties at the threshold kept)
//   top-p: among the survivors, keep p >= t for the largest t with
//          mass{survivors, p >= t} >= top_p * mass{survivors}   (ties kept)
//   min-p: keep p >= min_p * max(p)
//   renormalise the kept probabilities (no filter active: probs = softmax exactly).
// Logits may be -Inf (masked: probability 0); NaN, +Inf and rows without a finite value
// are errors: kNanOrInfLogits (row, col = vocab index or -1), kInvalidPolicy. Rows at
// fault: 0.
struct ApplyPolicyArgs {
  const void* logits = nullptr;  // [rows, vocab], dtype logits_dtype
  LogitsDType logits_dtype = LogitsDType::kFloat32;
  int64_t logits_row_stride = 0;
  int64_t rows = 0;
  int64_t vocab = 0;
  PolicyParams policy;           // per-row arrays: [rows]
  float* probs = nullptr;        // out: [rows, vocab] float32
  int64_t probs_row_stride = 0;
};

// ---- sample ------------------------------------------------------------------------
// tokens[n] = inverse-CDF pick (sampling_math.h) from the weights probs[n] (need not be
// normalised) with coin uniform(seed, offset, row = n, position = 0, Purpose::kSample).
// Keyed (row_seeds and row_positions given, both or neither): tokens[n] = the keyed
// sample of probs[n] (sampling_math.h race_score) with the exponentials of the keyed
// stream (philox.h) at (row_seeds[n], row_positions[n]); rng is not used. A row's token
// depends on its weights, seed and position only: not on the row index, the call, or
// what else the call holds.
// Errors: kInvalidProbs (negative / NaN / Inf value: col = vocab index; all zero: col -1).
// Rows at fault: -1.
struct SampleArgs {
  const float* probs = nullptr;  // [rows, vocab] float32
  int64_t probs_row_stride = 0;
  int64_t rows = 0;
  int64_t vocab = 0;
  RandomParams rng;
  const int64_t* row_seeds = nullptr;      // [rows] keyed: each row's seed (uint64 bits)
  const int64_t* row_positions = nullptr;  // [rows] keyed: each row's position (uint64 bits)
  int32_t* tokens = nullptr;     // out: [rows] int32
};

// ---- verify ---------------------------------------------------------------------------
// Speculative verification of batch rows b < batch, each with n = num_draft[b] proposals
// (num_spec if num_draft is null), proposal j = draft_tokens[b, j] drawn from
// q = draft_probs[b, j] (one-hot at the token if draft_probs is null).
// p_j = policy(target_logits[b, j]) (apply_policy semantics, fused).
//   sampled rows: for j < n, accept iff uniform(.., b, j, kAccept) * q_j(y) < p_j(y);
//     at the first rejection emit a token from max(p_j - q_j, 0) (from p_j if that mass
//     is < kResidualEps) with the coin uniform(.., b, j, kCorrection) and stop;
//     if all n pass, emit a bonus token from p_n with uniform(.., b, n, kCorrection).
//   greedy rows (temperature 0, the one spelling of greedy): accept while
//     y == argmax target_logits[b, j]; emit the argmax where it stops (or at n).
// Outputs: tokens[b, :num_emitted[b]] are the emitted tokens, the rest -1;
//   num_emitted[b] = num_accepted[b] + 1.
// Only target_logits[b, :n + 1] are read (positions past n are padding); every one of
// them is checked (no NaN / +Inf, at least one finite value: -Inf masks are fine), every
// draft_tokens[b, :n] for range, and draft_probs where it is read (q_j(y) for j < n, the
// whole row at a rejection).
// Errors: kInvalidPolicy, kNumDraftOutOfRange, kTokenOutOfRange (col = j),
//   kNanOrInfLogits (col = j), kInvalidProbs (col = j). Rows at fault: tokens -1,
//   num_emitted 0, num_accepted 0. The status reports the lowest row at fault.
//
// method kBlock: block verification (Sun et al., arXiv 2403.10444) of sampled rows
// (draft_probs given, not greedy), exact like token-wise and never shorter in expectation:
// with p_j(y) and q_j(y) as above, w_0 = 1, w_j = block_weight(w_{j-1}, p_{j-1}(y_j),
// q_{j-1}(y_j)) (sampling_math.h); h_j = block_keep_probability(R_j, w_j) for 1 <= j < n,
// R_j = sum_x max(w_j p_j(x) - q_j(x), 0), and h_n = w_n; the accepted count tau is the
// largest j in [1, n] with uniform(.., b, j - 1, kAccept) < h_j, else 0; then the token at
// position tau is drawn with uniform(.., b, tau, kCorrection) from p_n (tau == n) or from
// max(w_tau p_tau - q_tau, 0) (roundoff rule: p_tau). Every q_j row for j < n is read (and
// checked: kInvalidProbs, col = j), and p_j for j <= min(n, the last j with w_j > 0).
// One-hot drafts (draft_probs null) and greedy rows are verified token-wise.
//
// Compact q (verify and verify_tree): a draft whose vocabulary is a subset of the
// target's keeps its probabilities over that subset only. With draft_index set, a
// draft_probs row holds draft_width columns and q(x) = row[draft_index[x]] where
// draft_index[x] >= 0, q(x) = 0 where it is -1 (x outside the draft vocabulary); an entry
// >= draft_width reads as NaN (kInvalidProbs where read). Every result is the one the
// full row (the compact one scattered, zeros elsewhere) gives, bit for bit.
enum class VerifyMethod : int32_t { kToken = 0, kBlock = 1 };

struct VerifyArgs {
  const void* target_logits = nullptr;  // [batch, num_spec + 1, vocab]
  LogitsDType target_logits_dtype = LogitsDType::kFloat32;
  int64_t target_logits_stride_b = 0;
  int64_t target_logits_stride_k = 0;
  int64_t batch = 0;
  int64_t num_spec = 0;                 // K: draft positions per row
  int64_t vocab = 0;
  const int32_t* draft_tokens = nullptr;  // [batch, num_spec] int32 (may be null if K == 0)
  int64_t draft_tokens_stride_b = 0;
  const float* draft_probs = nullptr;     // [batch, num_spec, W] float32, or null
  int64_t draft_probs_stride_b = 0;
  int64_t draft_probs_stride_k = 0;
  const int32_t* draft_index = nullptr;   // [vocab] int32: compact q (below), or null
  int64_t draft_width = 0;                // W with draft_index (else W = vocab)
  const int32_t* num_draft = nullptr;     // [batch] int32, or null
  VerifyMethod method = VerifyMethod::kToken;
  PolicyParams policy;                    // per-row arrays: [batch]
  RandomParams rng;
  int32_t* tokens = nullptr;              // out: [batch, num_spec + 1] int32
  int64_t tokens_stride_b = 0;
  int32_t* num_emitted = nullptr;         // out: [batch] int32
  int32_t* num_accepted = nullptr;        // out: [batch] int32
};

// ---- verify_tree ------------------------------------------------------------------------
// Tree verification of batch rows b < batch, each with n = num_nodes[b] draft nodes
// (max_nodes if num_nodes is null): node i holds token tree_tokens[b, i] and has parent
// parents[b, i] (-1 = the root, else a node < i, so nodes are in topological order).
// Row j of target_logits[b] is the target after the root (j = 0) or after node j - 1;
// p_j = policy(target_logits[b, j]) (apply_policy semantics). The walk starts at the root;
// at a node with row j and children C (the nodes whose parent it is, in node order):
//   deterministic candidates (draft_probs null) and greedy rows: x = a draw from p_j with
//     uniform(.., b, j, kTreeEmit) (argmax target_logits[b, j] for greedy rows); if a child
//     c holds x, accept c and continue at c, else emit x and stop (siblings must be
//     distinct: kDuplicateSibling).
//   sampled children (draft_probs[b, j] = q, the distribution C was drawn from): r = p_j;
//     for c in C: accept c iff uniform(.., b, c, kTreeAccept) * q_i(x_c) < r(x_c), then
//     continue at c; else r = norm(max(r - q_i, 0)) (p_j if that mass < kResidualEps).
//     q_i = q (replacement), or q with the earlier siblings' tokens removed and divided by
//     1 - their q mass (sampling_math.h renormalised_q; siblings must be distinct). If all
//     are rejected, or C is empty (a leaf: the bonus), emit a draw from r with
//     uniform(.., b, j, kTreeEmit) and stop.
// Outputs: tokens[b, :num_emitted[b]] = the accepted nodes' tokens then the emitted token
//   (-1 after); accepted_nodes[b, :num_emitted[b] - 1] = the accepted nodes (-1 after).
// Checks per row: policy, num_nodes in [0, max_nodes] (kNumDraftOutOfRange), every
//   parents[b, i] (kInvalidParent, col = i) and tree_tokens[b, i] (kTokenOutOfRange,
//   col = i) for i < n, distinct siblings where required (kDuplicateSibling, col = the later
//   node), every logits row j <= n (kNanOrInfLogits, col = j), and q where read: q(x_c) at
//   a test, the whole row at a rejection (kInvalidProbs, col = the draft_probs row).
// Rows at fault: tokens -1, accepted_nodes -1, num_emitted 0; the lowest row is reported.
struct VerifyTreeArgs {
  const void* target_logits = nullptr;  // [batch, max_nodes + 1, vocab]
  LogitsDType target_logits_dtype = LogitsDType::kFloat32;
  int64_t target_logits_stride_b = 0;
  int64_t target_logits_stride_n = 0;
  int64_t batch = 0;
  int64_t max_nodes = 0;                // N
  int64_t vocab = 0;
  const int32_t* tree_tokens = nullptr;   // [batch, N] int32 (may be null if N == 0)
  int64_t tree_tokens_stride_b = 0;
  const int32_t* parents = nullptr;       // [batch, N] int32 (may be null if N == 0)
  int64_t parents_stride_b = 0;
  const float* draft_probs = nullptr;     // [batch, N + 1, W] float32, or null
  int64_t draft_probs_stride_b = 0;
  int64_t draft_probs_stride_n = 0;
  const int32_t* draft_index = nullptr;   // [vocab] int32: compact q (see verify), or null
  int64_t draft_width = 0;                // W with draft_index (else W = vocab)
  const int32_t* num_nodes = nullptr;     // [batch] int32, or null
  bool replacement = true;                // sampled children: i.i.d. (true) or not
  PolicyParams policy;                    // per-row arrays: [batch]
  RandomParams rng;
  int32_t* tokens = nullptr;              // out: [batch, N + 1] int32
  int64_t tokens_stride_b = 0;
  int32_t* num_emitted = nullptr;         // out: [batch] int32
  int32_t* accepted_nodes = nullptr;      // out: [batch, N] int32 (may be null if N == 0)
  int64_t accepted_nodes_stride_b = 0;
};

// ---- CPU launchers (single-threaded; scratch allocated per call) ---------------------
OpStatus apply_policy_cpu(const ApplyPolicyArgs& args);
OpStatus sample_cpu(const SampleArgs& args);
OpStatus verify_cpu(const VerifyArgs& args);
OpStatus verify_tree_cpu(const VerifyTreeArgs& args);

// ---- CUDA launchers ------------------------------------------------------------------
// Value errors found on the device go to an error record in the workspace. With
// check_errors the launcher copies it back, which synchronises the stream; pass
// check_errors = false where that is not allowed (CUDA graph capture): the op then
// returns after enqueueing, and the record stays in the workspace (first 8 bytes, a
// uint64: ~0 = no error, else decode_device_error()).
// workspace: device memory of at least *_cuda_workspace_bytes(); if null, the launcher
// allocates one stream-ordered (cudaMallocAsync) and frees it after the op.
struct CudaLaunch {
  void* stream = nullptr;  // cudaStream_t; null is the legacy default stream
  int device = 0;          // the device of every pointer; made current for the call
  bool check_errors = true;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

constexpr size_t kCudaErrorRecordBytes = 256;     // error record, padded for alignment
// Launches with few rows split each row over several blocks, whose per-chunk statistics
// (24 bytes each) and per-tile statistics (the maximum and fixed-point sum of each 1024
// values, 12 bytes; sampling_math.h kStatsTile) live in the workspace: at most
// kCudaSplitMaxRows rows of kCudaSplitMaxChunks chunks and kMaxVocab / 1024 tiles; then,
// for rows with a filter (top-k, top-p, min-p), each row's statistics, filter progress and
// radix histogram (2048 bins of a count and a fixed-point mass; kCudaSplitFilterRowBytes a
// row) (kernels/cuda/split_kernels.cuh).
constexpr int64_t kCudaSplitMaxRows = 128;
constexpr int64_t kCudaSplitMaxChunks = 32;
constexpr int64_t kCudaSplitMaxTiles = 1024;
constexpr size_t kCudaSplitFilterRowBytes = 24832;
constexpr size_t kCudaSplitBytes =
    kCudaSplitMaxRows * kCudaSplitMaxChunks * 24 + kCudaSplitMaxRows * kCudaSplitMaxTiles * 12 +
    kCudaSplitMaxRows * kCudaSplitFilterRowBytes;
// verify's payload per (row, position): its policy statistics (32 bytes), then block
// verification's residual mass and q check (16 bytes).
constexpr size_t kVerifyStatsBytesPerPosition = 48;
// Layout: [error record][split chunk statistics][op payload].
constexpr size_t kCudaWorkspaceHeadBytes = kCudaErrorRecordBytes + kCudaSplitBytes;

inline size_t apply_policy_cuda_workspace_bytes() { return kCudaWorkspaceHeadBytes; }
inline size_t sample_cuda_workspace_bytes() { return kCudaWorkspaceHeadBytes; }
inline size_t verify_cuda_workspace_bytes(int64_t batch, int64_t num_spec) {
  return kCudaWorkspaceHeadBytes +
         static_cast<size_t>(batch) * static_cast<size_t>(num_spec + 1) *
             kVerifyStatsBytesPerPosition;
}
// verify_tree: the head, then two float rows of vocab per batch row (the residual r and
// the sibling q without replacement), then the policy statistics of every (row, node
// row) (kVerifyStatsBytesPerPosition each).
inline size_t verify_tree_cuda_workspace_bytes(int64_t batch, int64_t max_nodes, int64_t vocab) {
  return kCudaWorkspaceHeadBytes +
         static_cast<size_t>(batch) * 2 * static_cast<size_t>(vocab) * sizeof(float) +
         static_cast<size_t>(batch) * static_cast<size_t>(max_nodes + 1) *
             kVerifyStatsBytesPerPosition;
}

// In a build without CUDA these return kCudaNotCompiled.
OpStatus apply_policy_cuda(const ApplyPolicyArgs& args, const CudaLaunch& launch);
OpStatus sample_cuda(const SampleArgs& args, const CudaLaunch& launch);
OpStatus verify_cuda(const VerifyArgs& args, const CudaLaunch& launch);
OpStatus verify_tree_cuda(const VerifyTreeArgs& args, const CudaLaunch& launch);

// Whether this build has the CUDA launchers.
bool cuda_compiled();

// The device error record: bits 63..32 row, 31..28 StatusCode, 27..0 col (2^28 - 1:
// unknown or too large, decoded as -1).
// The smallest record wins (atomicMin), so the lowest row at fault is the one reported.
constexpr uint64_t kNoDeviceError = ~uint64_t{0};

enum class OpKind : int32_t { kApplyPolicy = 0, kSample = 1, kVerify = 2, kVerifyTree = 3 };

// Status of a record (no value; `what` as the launchers give it). kOk for kNoDeviceError.
OpStatus decode_device_error(OpKind op, uint64_t record);

}  // namespace verispec

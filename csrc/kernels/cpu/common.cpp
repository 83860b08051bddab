// Host-side helpers of both backends: argument checks, status text, and decoding of
// the device error record. Compiled in every build (CPU only or CUDA).
#include "../common.h"
#include "verispec/policy_rules.h"

namespace verispec {
namespace kernels {

namespace {

constexpr int64_t kMaxRows = (int64_t{1} << 31) - 1;   // grid and Philox row limits

bool valid_dtype(LogitsDType d) {
  return d == LogitsDType::kFloat32 || d == LogitsDType::kBFloat16 || d == LogitsDType::kFloat16;
}

OpStatus check_rng(const RandomParams& r) {
  if (!r.offset_ptr && r.offset >= kPhiloxMaxOffset) {
    return invalid_argument("offset must be in [0, 2^60)");
  }
  return OpStatus{};
}

}  // namespace

const char* status_what(OpKind op, StatusCode code, int64_t col) {
  switch (code) {
    case StatusCode::kOk:
      return "";
    case StatusCode::kInvalidPolicy:
      return policy_rule(static_cast<PolicyField>(col));
    case StatusCode::kNumDraftOutOfRange:
      if (op == OpKind::kVerifyTree) return "num_nodes must be in [0, N]";
      return "num_draft must be in [0, K]";
    case StatusCode::kTokenOutOfRange:
      if (op == OpKind::kVerifyTree) return "tree_tokens must be in [0, V)";
      return "draft_tokens must be in [0, V)";
    case StatusCode::kInvalidParent:
      return "parents must be -1 (the root) or an earlier node: in [-1, i) for node i";
    case StatusCode::kDuplicateSibling:
      return "sibling nodes must hold distinct tokens (deterministic candidates, or drawn "
             "without replacement)";
    case StatusCode::kNanOrInfLogits:
      if (op == OpKind::kVerify || op == OpKind::kVerifyTree) {
        return "target_logits must not contain NaN or +Inf, nor a row of only -Inf";
      }
      return col < 0 ? "logits must have a finite value in every row (this one is all -Inf)"
                     : "logits must not contain NaN or +Inf";
    case StatusCode::kInvalidProbs:
      if (op == OpKind::kVerify || op == OpKind::kVerifyTree) {
        return "draft_probs must be finite and >= 0";
      }
      return col < 0 ? "probs row has zero total mass"
                     : "probs must be finite and >= 0";
    case StatusCode::kInvalidArgument:
      return "invalid argument";
    case StatusCode::kCudaError:
      return "CUDA error";
    case StatusCode::kCudaNotCompiled:
      return "verispec was built without CUDA";
  }
  return "unknown error";
}

OpStatus make_status(OpKind op, StatusCode code, int64_t row, int64_t col) {
  OpStatus s;
  s.code = code;
  s.row = row;
  s.col = col;
  s.what = status_what(op, code, col);
  return s;
}

OpStatus invalid_argument(const char* what) {
  OpStatus s;
  s.code = StatusCode::kInvalidArgument;
  s.what = what;
  return s;
}

OpStatus check_policy_scalars(const PolicyParams& p) {
  // Per-row values are the kernels' to check (row by row); here they count as defaults.
  const PolicyParams d;
  const float t = p.temperature_per_row ? d.temperature : p.temperature;
  const int32_t k = p.top_k_per_row ? d.top_k : p.top_k;
  const float tp = p.top_p_per_row ? d.top_p : p.top_p;
  const float mp = p.min_p_per_row ? d.min_p : p.min_p;
  const int32_t field = policy_error_field(t, k, tp, mp);
  if (field < 0) return OpStatus{};
  const double values[] = {t, static_cast<double>(k), tp, mp};
  OpStatus s = invalid_argument(policy_rule(static_cast<PolicyField>(field)));
  s.has_value = true;
  s.value = values[field];
  return s;
}

// The exact fixed-point sums (sampling_math.h) hold rows of up to kMaxVocab values.
static OpStatus vocab_out_of_range(int64_t vocab) {
  OpStatus s = invalid_argument("vocab (the last dimension) must be in [1, 2^20 = 1048576]");
  s.has_value = true;
  s.value = static_cast<double>(vocab);
  return s;
}

OpStatus check_apply_policy_args(const ApplyPolicyArgs& a) {
  if (a.rows < 0 || a.rows > kMaxRows) return invalid_argument("rows must be in [0, 2^31)");
  if (a.rows == 0) return OpStatus{};
  if (a.vocab < 1 || a.vocab > kMaxVocab) return vocab_out_of_range(a.vocab);
  if (!valid_dtype(a.logits_dtype)) return invalid_argument("logits dtype must be float32, bfloat16 or float16");
  if (!a.logits || !a.probs) return invalid_argument("logits and probs must not be null");
  if (a.logits_row_stride < 0) return invalid_argument("logits row stride must be >= 0");
  if (a.rows > 1 && a.probs_row_stride < a.vocab) {
    return invalid_argument("probs row stride must be >= vocab");
  }
  return check_policy_scalars(a.policy);
}

OpStatus check_sample_args(const SampleArgs& a) {
  if (a.rows < 0 || a.rows > kMaxRows) return invalid_argument("rows must be in [0, 2^31)");
  if (a.rows == 0) return OpStatus{};
  if (a.vocab < 1 || a.vocab > kMaxVocab) return vocab_out_of_range(a.vocab);
  if (!a.probs || !a.tokens) return invalid_argument("probs and tokens must not be null");
  if (a.probs_row_stride < 0) return invalid_argument("probs row stride must be >= 0");
  if ((a.row_seeds == nullptr) != (a.row_positions == nullptr)) {
    return invalid_argument("row_seeds and row_positions must be given together (keyed) or not at all");
  }
  return check_rng(a.rng);
}

OpStatus check_compact_q(const float* draft_probs, const int32_t* draft_index,
                         int64_t draft_width) {
  if (!draft_index) return OpStatus{};
  if (!draft_probs) return invalid_argument("draft_index needs draft_probs");
  if (draft_width < 1 || draft_width > kMaxVocab) {
    return invalid_argument("draft_width must be in [1, 2^20] with draft_index");
  }
  return OpStatus{};
}

OpStatus check_verify_args(const VerifyArgs& a) {
  if (a.batch < 0 || a.batch > kMaxRows) return invalid_argument("batch must be in [0, 2^31)");
  if (a.num_spec < 0 || a.num_spec > kMaxRows - 1) {
    return invalid_argument("K must be in [0, 2^31 - 1)");
  }
  if (a.batch == 0) return OpStatus{};
  if (a.vocab < 1 || a.vocab > kMaxVocab) return vocab_out_of_range(a.vocab);
  if (!valid_dtype(a.target_logits_dtype)) {
    return invalid_argument("target_logits dtype must be float32, bfloat16 or float16");
  }
  if (!a.target_logits || !a.tokens || !a.num_emitted || !a.num_accepted) {
    return invalid_argument("target_logits, tokens, num_emitted and num_accepted must not be null");
  }
  if (a.num_spec > 0 && !a.draft_tokens) return invalid_argument("draft_tokens must not be null");
  if (a.target_logits_stride_b < 0 || a.target_logits_stride_k < 0 ||
      a.draft_tokens_stride_b < 0 || a.draft_probs_stride_b < 0 || a.draft_probs_stride_k < 0) {
    return invalid_argument("strides must be >= 0");
  }
  if (a.batch > 1 && a.tokens_stride_b < a.num_spec + 1) {
    return invalid_argument("tokens row stride must be >= K + 1");
  }
  if (a.method != VerifyMethod::kToken && a.method != VerifyMethod::kBlock) {
    return invalid_argument("method must be token (0) or block (1)");
  }
  const OpStatus c = check_compact_q(a.draft_probs, a.draft_index, a.draft_width);
  if (!c.ok()) return c;
  const OpStatus s = check_policy_scalars(a.policy);
  if (!s.ok()) return s;
  return check_rng(a.rng);
}

OpStatus check_verify_tree_args(const VerifyTreeArgs& a) {
  if (a.batch < 0 || a.batch > kMaxRows) return invalid_argument("batch must be in [0, 2^31)");
  if (a.max_nodes < 0 || a.max_nodes > kMaxRows - 1) {
    return invalid_argument("N must be in [0, 2^31 - 1)");
  }
  if (a.batch == 0) return OpStatus{};
  if (a.vocab < 1 || a.vocab > kMaxVocab) return vocab_out_of_range(a.vocab);
  if (!valid_dtype(a.target_logits_dtype)) {
    return invalid_argument("target_logits dtype must be float32, bfloat16 or float16");
  }
  if (!a.target_logits || !a.tokens || !a.num_emitted) {
    return invalid_argument("target_logits, tokens and num_emitted must not be null");
  }
  if (a.max_nodes > 0 && (!a.tree_tokens || !a.parents || !a.accepted_nodes)) {
    return invalid_argument("tree_tokens, parents and accepted_nodes must not be null");
  }
  if (a.target_logits_stride_b < 0 || a.target_logits_stride_n < 0 ||
      a.tree_tokens_stride_b < 0 || a.parents_stride_b < 0 || a.draft_probs_stride_b < 0 ||
      a.draft_probs_stride_n < 0) {
    return invalid_argument("strides must be >= 0");
  }
  if (a.batch > 1 && (a.tokens_stride_b < a.max_nodes + 1 ||
                      (a.max_nodes > 0 && a.accepted_nodes_stride_b < a.max_nodes))) {
    return invalid_argument("tokens / accepted_nodes row strides must be >= N + 1 / N");
  }
  const OpStatus c = check_compact_q(a.draft_probs, a.draft_index, a.draft_width);
  if (!c.ok()) return c;
  const OpStatus s = check_policy_scalars(a.policy);
  if (!s.ok()) return s;
  return check_rng(a.rng);
}

}  // namespace kernels

OpStatus decode_device_error(OpKind op, uint64_t record) {
  if (record == kNoDeviceError) return OpStatus{};
  const int64_t row = static_cast<int64_t>(record >> 32);
  const auto code = static_cast<StatusCode>((record >> 28) & 0xfu);
  const int64_t col = static_cast<int64_t>(record & 0x0fffffffu);
  return kernels::make_status(op, code, row, col == kernels::kErrorColMax ? -1 : col);
}

}  // namespace verispec

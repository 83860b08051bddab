// verify on the CPU: per row, check everything the walk may read (policy, num_draft,
// tokens, logits, q(y)), then walk the proposals, computing p_j lazily per position.
#include <algorithm>
#include <type_traits>
#include <vector>

#include "cpu_policy.h"

namespace verispec {

namespace {

using namespace kernels;

template <typename T>
struct VerifyRow {
  const VerifyArgs& a;
  const T* logits;  // [batch, K + 1, vocab]
  uint64_t seed;
  uint64_t offset;
  float* p;                   // [vocab] scratch: p_j
  cpu::PolicyScratch* scratch;
  float* qfull;               // [vocab] scratch: a compact q row read in full (or null)

  const T* logits_at(int64_t b, int64_t j) const {
    return logits + b * a.target_logits_stride_b + j * a.target_logits_stride_k;
  }
  const float* q_at(int64_t b, int64_t j) const {
    return a.draft_probs + b * a.draft_probs_stride_b + j * a.draft_probs_stride_k;
  }
  // q_j(x), through draft_index for a compact q (ops.h).
  float q_value(int64_t b, int64_t j, int64_t x) const {
    return compact_q(q_at(b, j), a.draft_index, a.draft_width, x);
  }
  // q_j over the whole vocabulary: the row itself, or a compact one scattered into qfull.
  const float* q_row(int64_t b, int64_t j) const {
    if (!a.draft_index) return q_at(b, j);
    for (int64_t x = 0; x < a.vocab; ++x) qfull[x] = q_value(b, j, x);
    return qfull;
  }
  float coin(int64_t b, int64_t j, Purpose purpose) const {
    return uniform(seed, offset, static_cast<uint32_t>(b), static_cast<uint32_t>(j), purpose);
  }
  // The correction or bonus at position j: the exact inverse CDF over fixed-point weights
  // w(i) (fixed_weight of floats) of total mass `total` > 0.
  template <typename WeightFn>
  int32_t draw(int64_t b, int64_t j, const WeightFn& w, uint64_t total) const {
    const uint64_t coin64 = uniform64(seed, offset, static_cast<uint32_t>(b),
                                      static_cast<uint32_t>(j), Purpose::kCorrection);
    return static_cast<int32_t>(pick_fixed([&w](int64_t i) { return fixed_weight(w(i)); },
                                           a.vocab, draw_target(coin64, total)));
  }
  const int32_t* draft_row(int64_t b) const {  // [K]; null when K == 0
    return a.draft_tokens ? a.draft_tokens + b * a.draft_tokens_stride_b : nullptr;
  }
  int32_t pick_from_p(int64_t b, int64_t j) const {
    const float* pp = p;
    return draw(b, j, [pp](int64_t i) { return pp[i]; }, cpu::fixed_sum(pp, a.vocab));
  }

  // Everything the walk of row b may read; returns the first fault.
  OpStatus check(int64_t b, const RowPolicy& pol, int64_t n) const {
    const int32_t field = invalid_policy_field(pol);
    if (field >= 0) return cpu::invalid_policy_status(OpKind::kVerify, b, pol, field);
    if (n < 0 || n > a.num_spec) {
      OpStatus s = make_status(OpKind::kVerify, StatusCode::kNumDraftOutOfRange, b, -1);
      s.has_value = true;
      s.value = static_cast<double>(n);
      return s;
    }
    const int32_t* y = draft_row(b);
    for (int64_t j = 0; j < n; ++j) {
      if (y[j] < 0 || y[j] >= a.vocab) {
        OpStatus s = make_status(OpKind::kVerify, StatusCode::kTokenOutOfRange, b, j);
        s.has_value = true;
        s.value = y[j];
        return s;
      }
    }
    for (int64_t j = 0; j <= n; ++j) {
      const int64_t bad = cpu::check_logits_row(logits_at(b, j), a.vocab);
      if (bad != kLogitsOk) {  // a NaN / +Inf at `bad`, or all -Inf
        OpStatus s = make_status(OpKind::kVerify, StatusCode::kNanOrInfLogits, b, j);
        if (bad >= 0) {
          s.has_value = true;
          s.value = to_float(logits_at(b, j)[bad]);
        }
        return s;
      }
    }
    if (a.draft_probs) {
      for (int64_t j = 0; j < n; ++j) {
        const float q = q_value(b, j, y[j]);
        if (!(q >= 0.0f) || !is_finite(q)) {
          OpStatus s = make_status(OpKind::kVerify, StatusCode::kInvalidProbs, b, j);
          s.has_value = true;
          s.value = q;
          return s;
        }
      }
    }
    return OpStatus{};
  }

  // A whole q row is read: every value must be a probability (col = j).
  OpStatus check_q_row(int64_t b, int64_t j, const float* q) const {
    const float* bad =
        std::find_if(q, q + a.vocab, [](float v) { return !(v >= 0.0f) || !is_finite(v); });
    if (bad == q + a.vocab) return OpStatus{};
    OpStatus s = make_status(OpKind::kVerify, StatusCode::kInvalidProbs, b, j);
    s.has_value = true;
    s.value = *bad;
    return s;
  }

  // Block verification of row b (ops.h, sampling_math.h): tau from the keep
  // probabilities h_j, then the token at tau; writes tokens[0, tau] and *accepted = tau.
  OpStatus walk_block(int64_t b, const RowPolicy& pol, int64_t n, int32_t* out,
                      int64_t* accepted) {
    const int32_t* y = draft_row(b);
    float w = 1.0f;  // w_j
    int64_t tau = 0;
    float w_tau = 1.0f;
    for (int64_t j = 0; j <= n; ++j) {
      if (j == n) {  // h_n = w_n
        if (n > 0 && block_keep(coin(b, j - 1, Purpose::kAccept), w)) {
          tau = j;
          w_tau = w;
        }
        break;
      }
      cpu::policy_row(logits_at(b, j), a.vocab, pol, p, *scratch);
      const float* q = q_row(b, j);
      const OpStatus s = check_q_row(b, j, q);
      if (!s.ok()) return s;
      if (j >= 1) {
        const float* pp = p;
        uint64_t mass = 0;
        for (int64_t i = 0; i < a.vocab; ++i) mass += fixed_weight(block_residual_weight(w, pp[i], q[i]));
        const float h = block_keep_probability(fixed_to_float(mass), w);
        if (block_keep(coin(b, j - 1, Purpose::kAccept), h)) {
          tau = j;
          w_tau = w;
        }
      }
      w = block_weight(w, p[y[j]], q[y[j]]);
      if (!(w > 0.0f)) break;  // every later h is 0
    }
    *accepted = tau;
    for (int64_t j = 0; j < tau; ++j) out[j] = y[j];
    cpu::policy_row(logits_at(b, tau), a.vocab, pol, p, *scratch);
    if (tau < n) {
      const float* pp = p;
      const float* q = q_row(b, tau);
      auto r = [pp, q, w_tau](int64_t i) { return block_residual_weight(w_tau, pp[i], q[i]); };
      uint64_t mass = 0;
      for (int64_t i = 0; i < a.vocab; ++i) mass += fixed_weight(r(i));
      if (residual_usable(fixed_to_float(mass))) {
        out[tau] = draw(b, tau, r, mass);
        return OpStatus{};
      }
    }
    out[tau] = pick_from_p(b, tau);
    return OpStatus{};
  }

  // Walks row b; writes tokens[0, emitted) and returns the number accepted, or a fault.
  OpStatus walk(int64_t b, const RowPolicy& pol, int64_t n, int32_t* out, int64_t* accepted) {
    const int32_t* y = draft_row(b);
    const bool greedy = pol.greedy();
    for (int64_t j = 0; j < n; ++j) {
      if (greedy) {
        const int32_t best = static_cast<int32_t>(cpu::argmax_row(logits_at(b, j), a.vocab));
        out[j] = best;
        if (best != y[j]) {
          *accepted = j;
          return OpStatus{};
        }
        continue;
      }
      cpu::policy_row(logits_at(b, j), a.vocab, pol, p, *scratch);
      const float q_y = a.draft_probs ? q_value(b, j, y[j]) : 1.0f;
      if (accept_draft(coin(b, j, Purpose::kAccept), p[y[j]], q_y)) {
        out[j] = y[j];
        continue;
      }
      // First rejection: sample the residual max(p - q, 0) (roundoff rule: p).
      *accepted = j;
      const float* pp = p;
      if (a.draft_probs) {
        const float* q = q_row(b, j);  // [vocab]
        const cpu::ResidualMass r = cpu::residual_mass(pp, q, a.vocab);
        if (!r.q_valid) {
          const float* bad = std::find_if(
              q, q + a.vocab, [](float v) { return !(v >= 0.0f) || !is_finite(v); });
          OpStatus s = make_status(OpKind::kVerify, StatusCode::kInvalidProbs, b, j);
          s.has_value = true;
          s.value = *bad;
          return s;
        }
        if (residual_usable(fixed_to_float(r.mass))) {
          out[j] = draw(b, j, [pp, q](int64_t i) { return residual_weight(pp[i], q[i]); }, r.mass);
          return OpStatus{};
        }
      } else {
        const int64_t yj = y[j];  // p without y
        const uint64_t residual = cpu::fixed_sum(pp, a.vocab) - fixed_weight(pp[yj]);
        if (residual_usable(fixed_to_float(residual))) {
          out[j] = draw(b, j, [pp, yj](int64_t i) { return i == yj ? 0.0f : pp[i]; }, residual);
          return OpStatus{};
        }
      }
      out[j] = pick_from_p(b, j);
      return OpStatus{};
    }
    // All n accepted: the bonus token from p_n.
    *accepted = n;
    if (greedy) {
      out[n] = static_cast<int32_t>(cpu::argmax_row(logits_at(b, n), a.vocab));
    } else {
      cpu::policy_row(logits_at(b, n), a.vocab, pol, p, *scratch);
      out[n] = pick_from_p(b, n);
    }
    return OpStatus{};
  }
};

}  // namespace

OpStatus verify_cpu(const VerifyArgs& a) {
  OpStatus first = check_verify_args(a);
  if (!first.ok() || a.batch == 0) return first;
  std::vector<float> p(static_cast<size_t>(a.vocab));
  std::vector<float> qfull(a.draft_index ? static_cast<size_t>(a.vocab) : 0);
  cpu::PolicyScratch scratch(a.vocab);
  const int64_t width = a.num_spec + 1;
  cpu::dispatch_dtype(a.target_logits_dtype, a.target_logits, [&](const auto* logits) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(logits)>>;
    VerifyRow<T> v{a, logits, resolve_seed(a.rng), resolve_offset(a.rng), p.data(), &scratch,
                   qfull.empty() ? nullptr : qfull.data()};
    for (int64_t b = 0; b < a.batch; ++b) {
      int32_t* out = a.tokens + b * a.tokens_stride_b;  // [K + 1]
      std::fill(out, out + width, -1);
      const RowPolicy pol = resolve_policy(a.policy, b);
      const int64_t n = a.num_draft ? a.num_draft[b] : a.num_spec;
      int64_t accepted = 0;
      OpStatus s = v.check(b, pol, n);
      const bool block = a.method == VerifyMethod::kBlock && a.draft_probs && !pol.greedy();
      if (s.ok()) s = block ? v.walk_block(b, pol, n, out, &accepted) : v.walk(b, pol, n, out, &accepted);
      if (!s.ok()) {
        std::fill(out, out + width, -1);
        a.num_emitted[b] = 0;
        a.num_accepted[b] = 0;
        if (first.ok()) first = s;
        continue;
      }
      a.num_accepted[b] = static_cast<int32_t>(accepted);
      a.num_emitted[b] = static_cast<int32_t>(accepted + 1);
    }
    return 0;
  });
  return first;
}

}  // namespace verispec

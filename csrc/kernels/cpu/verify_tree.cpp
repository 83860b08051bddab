// verify_tree on the CPU (ops.h): per row, check the tree (parents, tokens, distinct
// siblings where required) and every logits row it may read, then walk from the root,
// computing p of each visited node lazily.
#include <algorithm>
#include <type_traits>
#include <vector>

#include "cpu_policy.h"

namespace verispec {

namespace {

using namespace kernels;

OpStatus tree_status(StatusCode code, int64_t b, int64_t col, bool has_value, double value) {
  OpStatus s = make_status(OpKind::kVerifyTree, code, b, col);
  s.has_value = has_value;
  s.value = value;
  return s;
}

bool bad_prob(float v) { return !(v >= 0.0f) || !is_finite(v); }

template <typename T>
struct TreeRow {
  const VerifyTreeArgs& a;
  const T* logits;  // [batch, N + 1, vocab]
  uint64_t seed;
  uint64_t offset;
  std::vector<float>& p;     // [vocab] p of the current node
  std::vector<float>& r;     // [vocab] the residual after rejected siblings
  std::vector<float>& qbuf;  // [vocab] q without the removed siblings (no replacement)
  std::vector<float>& qfull;  // [vocab] a compact q row scattered (ops.h "Compact q")
  cpu::PolicyScratch& scratch;

  const T* logits_at(int64_t b, int64_t j) const {
    return logits + b * a.target_logits_stride_b + j * a.target_logits_stride_n;
  }
  const float* q_at(int64_t b, int64_t j) const {
    return a.draft_probs + b * a.draft_probs_stride_b + j * a.draft_probs_stride_n;
  }
  // q of row j over the whole vocabulary: the row itself, or a compact one scattered.
  const float* q_row(int64_t b, int64_t j) const {
    if (!a.draft_index) return q_at(b, j);
    const float* q = q_at(b, j);
    for (int64_t x = 0; x < a.vocab; ++x) qfull[x] = compact_q(q, a.draft_index, a.draft_width, x);
    return qfull.data();
  }
  float coin(int64_t b, int64_t position, Purpose purpose) const {
    return uniform(seed, offset, static_cast<uint32_t>(b), static_cast<uint32_t>(position),
                   purpose);
  }
  // The token drawn at the node of target row `row`: the exact inverse CDF over the
  // fixed-point weights of w (a distribution: p or a normalised residual).
  int32_t pick(const float* w, int64_t b, int64_t row) const {
    const uint64_t draw = uniform64(seed, offset, static_cast<uint32_t>(b),
                                    static_cast<uint32_t>(row), Purpose::kTreeEmit);
    return static_cast<int32_t>(pick_fixed([w](int64_t i) { return fixed_weight(w[i]); },
                                           a.vocab, draw_target(draw, cpu::fixed_sum(w, a.vocab))));
  }

  OpStatus check(int64_t b, const RowPolicy& pol, int64_t n, const int32_t* tok,
                 const int32_t* par) const {
    const int32_t field = invalid_policy_field(pol);
    if (field >= 0) return cpu::invalid_policy_status(OpKind::kVerifyTree, b, pol, field);
    if (n < 0 || n > a.max_nodes) {
      return tree_status(StatusCode::kNumDraftOutOfRange, b, -1, true, static_cast<double>(n));
    }
    const bool distinct = !a.draft_probs || !a.replacement;
    for (int64_t i = 0; i < n; ++i) {
      if (par[i] < -1 || par[i] >= i) {
        return tree_status(StatusCode::kInvalidParent, b, i, true, par[i]);
      }
      if (tok[i] < 0 || tok[i] >= a.vocab) {
        return tree_status(StatusCode::kTokenOutOfRange, b, i, true, tok[i]);
      }
      if (distinct) {
        for (int64_t s = par[i] + 1; s < i; ++s) {  // siblings come after their parent
          if (par[s] == par[i] && tok[s] == tok[i]) {
            return tree_status(StatusCode::kDuplicateSibling, b, i, true, tok[i]);
          }
        }
      }
    }
    for (int64_t j = 0; j <= n; ++j) {
      const int64_t bad = cpu::check_logits_row(logits_at(b, j), a.vocab);
      if (bad != kLogitsOk) {
        return tree_status(StatusCode::kNanOrInfLogits, b, j, bad >= 0,
                           bad >= 0 ? to_float(logits_at(b, j)[bad]) : 0.0);
      }
    }
    return OpStatus{};
  }

  // The walk of row b: writes the path's tokens and nodes, returns the depth (accepted
  // nodes) in *depth.
  OpStatus walk(int64_t b, const RowPolicy& pol, int64_t n, const int32_t* tok,
                const int32_t* par, int32_t* out, int32_t* nodes, int64_t* depth) {
    const int64_t V = a.vocab;
    const bool greedy = pol.greedy();
    int64_t cur = -1;
    *depth = 0;
    std::vector<int64_t> children;
    for (;;) {
      const int64_t row = cur + 1;
      children.clear();
      for (int64_t c = cur + 1; c < n; ++c) {
        if (par[c] == cur) children.push_back(c);
      }
      int64_t next = -1;
      int32_t emit = -1;
      if (greedy || !a.draft_probs) {
        int32_t x;
        if (greedy) {
          x = static_cast<int32_t>(cpu::argmax_row(logits_at(b, row), V));
        } else {
          cpu::policy_row(logits_at(b, row), V, pol, p.data(), scratch);
          x = pick(p.data(), b, row);
        }
        for (const int64_t c : children) {
          if (tok[c] == x) {
            next = c;
            break;
          }
        }
        if (next < 0) emit = x;
      } else {
        cpu::policy_row(logits_at(b, row), V, pol, p.data(), scratch);
        const float* q = q_row(b, row);
        const float* rcur = p.data();
        float remaining = 1.0f;  // without replacement: 1 - q mass of the removed
        bool row_checked = false;
        for (const int64_t c : children) {
          const int32_t x = tok[c];
          const float q_x = q[x];
          if (bad_prob(q_x)) return tree_status(StatusCode::kInvalidProbs, b, row, true, q_x);
          const float qi_x = a.replacement ? q_x : renormalised_q(q_x, remaining);
          if (accept_draft(coin(b, c, Purpose::kTreeAccept), rcur[x], qi_x)) {
            next = c;
            break;
          }
          // Rejected: r = norm(max(r - q_i, 0)), p if that mass is roundoff.
          if (!row_checked) {
            const float* bad = std::find_if(q, q + V, bad_prob);
            if (bad != q + V) return tree_status(StatusCode::kInvalidProbs, b, row, true, *bad);
            row_checked = true;
            if (!a.replacement) std::copy(q, q + V, qbuf.begin());
          }
          const float* qs = a.replacement ? q : qbuf.data();
          const float denom = a.replacement ? 1.0f : remaining;
          float* rr = r.data();
          uint64_t mass = 0;
          for (int64_t i = 0; i < V; ++i) {
            const float qi = a.replacement ? qs[i] : renormalised_q(qs[i], denom);
            const float v = residual_weight(rcur[i], qi);
            rr[i] = v;
            mass += fixed_weight(v);
          }
          if (residual_usable(fixed_to_float(mass))) {
            cpu::divide_row(rr, V, fixed_to_float(mass));
          } else {
            std::copy(p.begin(), p.end(), r.begin());
          }
          rcur = rr;
          if (!a.replacement) {
            qbuf[x] = 0.0f;
            remaining -= q_x;
          }
        }
        if (next < 0) emit = pick(rcur, b, row);  // all rejected, or a leaf (rcur = p)
      }
      if (next < 0) {
        out[*depth] = emit;
        return OpStatus{};
      }
      out[*depth] = tok[next];
      nodes[*depth] = static_cast<int32_t>(next);
      ++*depth;
      cur = next;
    }
  }
};

}  // namespace

OpStatus verify_tree_cpu(const VerifyTreeArgs& a) {
  OpStatus first = check_verify_tree_args(a);
  if (!first.ok() || a.batch == 0) return first;
  const size_t v = static_cast<size_t>(a.vocab);
  std::vector<float> p(v), r(v), qbuf(a.draft_probs && !a.replacement ? v : 0);
  std::vector<float> qfull(a.draft_index ? v : 0);
  cpu::PolicyScratch scratch(a.vocab);
  const int64_t width = a.max_nodes + 1;
  cpu::dispatch_dtype(a.target_logits_dtype, a.target_logits, [&](const auto* logits) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(logits)>>;
    TreeRow<T> t{a, logits, resolve_seed(a.rng), resolve_offset(a.rng), p, r, qbuf, qfull, scratch};
    for (int64_t b = 0; b < a.batch; ++b) {
      int32_t* out = a.tokens + b * a.tokens_stride_b;  // [N + 1]
      int32_t* nodes = a.max_nodes > 0 ? a.accepted_nodes + b * a.accepted_nodes_stride_b
                                       : nullptr;       // [N]
      std::fill(out, out + width, -1);
      if (nodes) std::fill(nodes, nodes + a.max_nodes, -1);
      const RowPolicy pol = resolve_policy(a.policy, b);
      const int64_t n = a.num_nodes ? a.num_nodes[b] : a.max_nodes;
      const int32_t* tok = a.max_nodes > 0 ? a.tree_tokens + b * a.tree_tokens_stride_b : nullptr;
      const int32_t* par = a.max_nodes > 0 ? a.parents + b * a.parents_stride_b : nullptr;
      int64_t depth = 0;
      OpStatus s = t.check(b, pol, n, tok, par);
      if (s.ok()) s = t.walk(b, pol, n, tok, par, out, nodes, &depth);
      if (!s.ok()) {
        std::fill(out, out + width, -1);
        if (nodes) std::fill(nodes, nodes + a.max_nodes, -1);
        a.num_emitted[b] = 0;
        if (first.ok()) first = s;
        continue;
      }
      a.num_emitted[b] = static_cast<int32_t>(depth + 1);
    }
    return 0;
  });
  return first;
}

}  // namespace verispec

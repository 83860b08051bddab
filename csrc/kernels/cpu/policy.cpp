// apply_policy on the CPU, row by row (cpu_policy.h): convert + finite check + max,
// softmax weights, normalise; histogram selection only when top-k / top-p is active,
// and one more pass to renormalise when a filter is active.
#include <algorithm>
#include <vector>

#include "cpu_policy.h"

namespace verispec {

OpStatus apply_policy_cpu(const ApplyPolicyArgs& a) {
  using namespace kernels;
  OpStatus first = check_apply_policy_args(a);
  if (!first.ok() || a.rows == 0) return first;
  cpu::PolicyScratch scratch(a.vocab);
  cpu::dispatch_dtype(a.logits_dtype, a.logits, [&](const auto* logits) {
    for (int64_t r = 0; r < a.rows; ++r) {
      const auto* x = logits + r * a.logits_row_stride;  // [vocab]
      float* out = a.probs + r * a.probs_row_stride;     // [vocab]
      const RowPolicy pol = resolve_policy(a.policy, r);
      OpStatus row_status;
      const int32_t field = invalid_policy_field(pol);
      if (field >= 0) {
        row_status = cpu::invalid_policy_status(OpKind::kApplyPolicy, r, pol, field);
      } else {
        const int64_t bad = cpu::policy_row(x, a.vocab, pol, out, scratch);
        if (bad != kLogitsOk) {  // a NaN / +Inf at `bad`, or all -Inf (col -1)
          row_status = make_status(OpKind::kApplyPolicy, StatusCode::kNanOrInfLogits, r,
                                   bad >= 0 ? bad : -1);
          if (bad >= 0) {
            row_status.has_value = true;
            row_status.value = to_float(x[bad]);
          }
        }
      }
      if (!row_status.ok()) {
        std::fill(out, out + a.vocab, 0.0f);
        if (first.ok()) first = row_status;
      }
    }
    return 0;
  });
  return first;
}

}  // namespace verispec

// The CUDA launchers of a build without CUDA: every call reports kCudaNotCompiled.
// Always compiled; empty when CMake enables CUDA (VERISPEC_WITH_CUDA), where
// csrc/kernels/cuda/*.cu define the real launchers.
#ifndef VERISPEC_WITH_CUDA

#include "common.h"

namespace verispec {

namespace {
OpStatus not_compiled() {
  OpStatus s;
  s.code = StatusCode::kCudaNotCompiled;
  s.what = kernels::status_what(OpKind::kApplyPolicy, StatusCode::kCudaNotCompiled, -1);
  return s;
}
}  // namespace

bool cuda_compiled() { return false; }
OpStatus apply_policy_cuda(const ApplyPolicyArgs&, const CudaLaunch&) { return not_compiled(); }
OpStatus sample_cuda(const SampleArgs&, const CudaLaunch&) { return not_compiled(); }
OpStatus verify_cuda(const VerifyArgs&, const CudaLaunch&) { return not_compiled(); }
OpStatus verify_tree_cuda(const VerifyTreeArgs&, const CudaLaunch&) { return not_compiled(); }

}  // namespace verispec

#endif  // VERISPEC_WITH_CUDA

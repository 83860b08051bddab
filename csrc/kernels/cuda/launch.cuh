// Host side of the CUDA launchers: device guard, workspace and error record, and the
// conversion of CUDA errors and device value errors into an OpStatus.
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "../common.h"

namespace verispec {
namespace kernels {
namespace cuda {

OpStatus cuda_error_status(cudaError_t e);

// kernel<<<grid, block, 0, stream>>>(args...): every launch of the launchers goes through
// here, so that the host simulation (csrc/tests/cuda_sim/, which defines
// VERISPEC_CUDA_SIM) runs ops.cu's own launch sequence, grids and block sizes: there,
// each block of the grid runs in turn, one fiber a thread.
template <typename... Params, typename... Args>
void launch_kernel(void (*kernel)(Params...), unsigned grid, int block, cudaStream_t stream,
                   Args&&... args) {
#if defined(VERISPEC_CUDA_SIM)
  cuda_sim::launch(grid, block, stream, [&] { kernel(args...); });
#else
  kernel<<<grid, block, 0, stream>>>(std::forward<Args>(args)...);
#endif
}

// One launcher call: makes launch.device current for its scope, takes the caller's
// workspace or allocates one stream-ordered, and turns the error record into a status.
// Workspace layout: [error record: kCudaErrorRecordBytes][split chunk statistics:
// kCudaSplitBytes][op-specific payload].
class OpLaunch {
 public:
  explicit OpLaunch(const CudaLaunch& launch);
  ~OpLaunch();  // frees an allocated workspace (stream-ordered), then restores the device
  OpLaunch(const OpLaunch&) = delete;
  OpLaunch& operator=(const OpLaunch&) = delete;

  // The device switch's status, then the workspace of `bytes` (the caller's, its size
  // checked, or allocated) with the record reset.
  OpStatus start(size_t bytes);
  cudaStream_t stream() const { return stream_; }
  unsigned long long* record() const { return static_cast<unsigned long long*>(ptr_); }
  void* split() const { return static_cast<char*>(ptr_) + kCudaErrorRecordBytes; }
  void* payload() const { return static_cast<char*>(ptr_) + kCudaWorkspaceHeadBytes; }

  // After the kernels: the launch's status, then (check_errors) the record read back,
  // which synchronises the stream, decoded for `op`; kOk if it was not read.
  OpStatus finish(OpKind op);

 private:
  const CudaLaunch& launch_;
  cudaStream_t stream_;
  int previous_device_ = -1;
  cudaError_t device_error_ = cudaSuccess;
  void* ptr_ = nullptr;
  bool owned_ = false;
};

// The number of SMs of `device` (cached per device; 0 if the runtime cannot tell).
int sm_count(int device);

// Copies one element from device memory (error path only); false on failure.
template <typename T>
bool read_device(const T* ptr, T* out) {
  return ptr && cudaMemcpy(out, ptr, sizeof(T), cudaMemcpyDeviceToHost) == cudaSuccess;
}

// status->value = base[index] read from the device, if base is non-null (error path).
template <typename T>
void fill_value(const T* base, int64_t index, OpStatus* status) {
  T v;
  if (base && read_device(base + index, &v)) {
    status->has_value = true;
    status->value = static_cast<double>(v);
  }
}

// status->value = logits[index] (dtype-converted), read from the device (error path).
void fill_logit_value(const void* logits, LogitsDType dtype, int64_t index, OpStatus* status);

// Calls fn(static_cast<const T*>(ptr)) with T the logits storage type.
template <typename Fn>
void dispatch_dtype(LogitsDType dtype, const void* ptr, Fn&& fn) {
  switch (dtype) {
    case LogitsDType::kBFloat16: fn(static_cast<const BFloat16*>(ptr)); return;
    case LogitsDType::kFloat16: fn(static_cast<const Float16*>(ptr)); return;
    case LogitsDType::kFloat32: break;
  }
  fn(static_cast<const float*>(ptr));
}

// Fills status->value with the per-row policy value at fault (error path only).
void fill_policy_value(const PolicyParams& policy, OpStatus* status);

}  // namespace cuda
}  // namespace kernels
}  // namespace verispec

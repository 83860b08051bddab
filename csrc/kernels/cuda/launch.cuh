// Host side of the CUDA launchers: device guard, workspace and error record, and the
// conversion of CUDA errors and device value errors into an OpStatus.
#pragma once

#include <cuda_runtime.h>

#include "../common.h"

namespace verispec {
namespace kernels {
namespace cuda {

OpStatus cuda_error_status(cudaError_t e);

// Makes `device` current for the scope of one launcher call.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  cudaError_t error() const { return error_; }

 private:
  int previous_ = -1;
  cudaError_t error_ = cudaSuccess;
};

// One launcher call's workspace: the caller's, or a stream-ordered allocation.
// Layout: [error record: kCudaErrorRecordBytes][op-specific].
class OpWorkspace {
 public:
  OpWorkspace() = default;
  ~OpWorkspace();
  OpWorkspace(const OpWorkspace&) = delete;
  OpWorkspace& operator=(const OpWorkspace&) = delete;

  // Takes launch.workspace (checking its size) or allocates `bytes`, and resets the record.
  OpStatus acquire(const CudaLaunch& launch, size_t bytes);
  unsigned long long* record() const { return static_cast<unsigned long long*>(ptr_); }
  void* payload() const { return static_cast<char*>(ptr_) + kCudaErrorRecordBytes; }

  // After the kernels: checks the launch, then (check_errors) reads the record back,
  // synchronising the stream. *record = kNoDeviceError if nothing was read.
  OpStatus finish(const CudaLaunch& launch, uint64_t* record);

 private:
  void* ptr_ = nullptr;
  cudaStream_t stream_ = nullptr;
  bool owned_ = false;
};

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

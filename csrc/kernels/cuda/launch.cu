// Host side of the CUDA launchers (see launch.cuh).
#include "launch.cuh"

#include <atomic>
#include <type_traits>

namespace verispec {

bool cuda_compiled() { return true; }

namespace kernels {
namespace cuda {

OpStatus cuda_error_status(cudaError_t e) {
  OpStatus s;
  s.code = StatusCode::kCudaError;
  s.what = cudaGetErrorString(e);  // static text owned by the runtime
  return s;
}

OpLaunch::OpLaunch(const CudaLaunch& launch)
    : launch_(launch), stream_(static_cast<cudaStream_t>(launch.stream)) {
  device_error_ = cudaGetDevice(&previous_device_);
  if (device_error_ == cudaSuccess && previous_device_ != launch.device) {
    device_error_ = cudaSetDevice(launch.device);
  }
}

OpLaunch::~OpLaunch() {
  if (owned_ && ptr_) cudaFreeAsync(ptr_, stream_);
  int current = -1;
  if (previous_device_ >= 0 && cudaGetDevice(&current) == cudaSuccess &&
      current != previous_device_) {
    cudaSetDevice(previous_device_);
  }
}

OpStatus OpLaunch::start(size_t bytes) {
  if (device_error_ != cudaSuccess) return cuda_error_status(device_error_);
  if (launch_.workspace) {
    if (launch_.workspace_bytes < bytes) {
      return invalid_argument("workspace is smaller than *_cuda_workspace_bytes()");
    }
    ptr_ = launch_.workspace;
  } else {
    const cudaError_t e = cudaMallocAsync(&ptr_, bytes, stream_);
    if (e != cudaSuccess) return cuda_error_status(e);
    owned_ = true;
  }
  // All bytes 0xff: kNoDeviceError.
  const cudaError_t e = cudaMemsetAsync(ptr_, 0xff, sizeof(unsigned long long), stream_);
  return e == cudaSuccess ? OpStatus{} : cuda_error_status(e);
}

OpStatus OpLaunch::finish(OpKind op) {
  cudaError_t e = cudaGetLastError();  // launch configuration errors
  if (e != cudaSuccess) return cuda_error_status(e);
  if (!launch_.check_errors) return OpStatus{};
  unsigned long long host = kNoDeviceError;
  e = cudaMemcpyAsync(&host, ptr_, sizeof host, cudaMemcpyDeviceToHost, stream_);
  if (e == cudaSuccess) e = cudaStreamSynchronize(stream_);
  if (e != cudaSuccess) return cuda_error_status(e);
  return decode_device_error(op, host);
}

int sm_count(int device) {
  static std::atomic<int> cache[64];  // 0: not asked yet
  if (device < 0 || device >= 64) return 0;
  int n = cache[device].load(std::memory_order_relaxed);
  if (n == 0 && cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) == cudaSuccess) {
    cache[device].store(n, std::memory_order_relaxed);
  }
  return n;
}

void fill_logit_value(const void* logits, LogitsDType dtype, int64_t index, OpStatus* s) {
  dispatch_dtype(dtype, logits, [&](const auto* base) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(base)>>;
    T v;
    if (read_device(base + index, &v)) {
      s->has_value = true;
      s->value = to_float(v);
    }
  });
}

void fill_policy_value(const PolicyParams& policy, OpStatus* s) {
  switch (static_cast<PolicyField>(s->col)) {
    case PolicyField::kTemperature: return fill_value(policy.temperature_per_row, s->row, s);
    case PolicyField::kTopK: return fill_value(policy.top_k_per_row, s->row, s);
    case PolicyField::kTopP: return fill_value(policy.top_p_per_row, s->row, s);
    case PolicyField::kMinP: return fill_value(policy.min_p_per_row, s->row, s);
  }
}

}  // namespace cuda
}  // namespace kernels
}  // namespace verispec

// Stand-in for the CUDA runtime in the host simulation (cuda_sim.h): what the launchers
// of kernels/cuda/ops.cu and launch.cu call, so that they run whole on the host, their
// launches (launch.cuh launch_kernel) in the simulation at their own grids and block
// sizes. Streams are in order and synchronous. Simulated devices differ in their SM count
// only, which decides the launchers' split of rows over blocks (split_kernels.cuh
// split_plan): cuda_sim::kDeviceSms. Device memory from cudaMallocAsync starts as garbage,
// as it does on a GPU.
#pragma once

#include <cstdlib>
#include <cstring>

#include "cuda_sim.h"

enum cudaError {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidDevice = 101,
};
typedef enum cudaError cudaError_t;
typedef struct CUstream_st* cudaStream_t;
enum cudaDeviceAttr { cudaDevAttrMultiProcessorCount = 16 };
enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4,
};

namespace cuda_sim {

// The SM count of each simulated device: an H200's, none that the runtime reports (every
// row one block), a small GPU's.
constexpr int kDeviceSms[] = {132, 0, 8};
constexpr int kDevices = static_cast<int>(sizeof kDeviceSms / sizeof kDeviceSms[0]);

struct Runtime {
  int device = 0;
  cudaError_t last_error = cudaSuccess;
  unsigned garbage = 0;  // which byte the next allocation starts filled with
  unsigned long long launches = 0;
  unsigned long long allocations = 0, frees = 0;
};
inline Runtime runtime;

inline cudaError_t fail(cudaError_t e) {
  runtime.last_error = e;
  return e;
}

// A launch: the kernel's blocks in turn (run_grid); a configuration a GPU refuses is the
// launch's error, as cudaGetLastError reports it after <<<...>>>.
template <typename Fn>
void launch(unsigned grid, int block, cudaStream_t, Fn&& fn) {
  if (grid == 0 || block < 1 || block > 1024) {
    fail(cudaErrorInvalidConfiguration);
    return;
  }
  ++runtime.launches;
  run_grid(grid, block, fn);
}

}  // namespace cuda_sim

inline const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
  }
  return "unknown error";
}

inline cudaError_t cudaGetLastError() {
  const cudaError_t e = cuda_sim::runtime.last_error;
  cuda_sim::runtime.last_error = cudaSuccess;
  return e;
}

inline cudaError_t cudaGetDevice(int* device) {
  *device = cuda_sim::runtime.device;
  return cudaSuccess;
}

inline cudaError_t cudaSetDevice(int device) {
  if (device < 0 || device >= cuda_sim::kDevices) return cuda_sim::fail(cudaErrorInvalidDevice);
  cuda_sim::runtime.device = device;
  return cudaSuccess;
}

inline cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (device < 0 || device >= cuda_sim::kDevices) return cuda_sim::fail(cudaErrorInvalidDevice);
  if (attr != cudaDevAttrMultiProcessorCount) return cuda_sim::fail(cudaErrorInvalidValue);
  *value = cuda_sim::kDeviceSms[device];
  return cudaSuccess;
}

inline cudaError_t cudaMallocAsync(void** ptr, size_t bytes, cudaStream_t) {
  static const unsigned char kBytes[] = {0xa5, 0xff, 0x5a, 0x81};
  *ptr = std::malloc(bytes == 0 ? 1 : bytes);
  if (*ptr == nullptr) return cuda_sim::fail(cudaErrorMemoryAllocation);
  std::memset(*ptr, kBytes[cuda_sim::runtime.garbage++ % sizeof kBytes], bytes);
  ++cuda_sim::runtime.allocations;
  return cudaSuccess;
}

inline cudaError_t cudaFreeAsync(void* ptr, cudaStream_t) {
  std::free(ptr);
  ++cuda_sim::runtime.frees;
  return cudaSuccess;
}

inline cudaError_t cudaMemsetAsync(void* ptr, int value, size_t bytes, cudaStream_t) {
  std::memset(ptr, value, bytes);
  return cudaSuccess;
}

inline cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind,
                                   cudaStream_t) {
  std::memcpy(dst, src, bytes);
  return cudaSuccess;
}

inline cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  return cudaMemcpyAsync(dst, src, bytes, kind, nullptr);
}

inline cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }

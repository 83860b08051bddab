// Runtime probes of a CUDA build. The module links the CUDA runtime statically, so
// these work (and report 0 devices) on a machine with no driver at all.
#include <cuda_runtime.h>

#include "verispec/device.h"

namespace verispec {

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error for later calls
    return 0;
  }
  return n;
}

int cuda_runtime_version() {
  int v = 0;
  cudaRuntimeGetVersion(&v);
  return v;
}

}  // namespace verispec

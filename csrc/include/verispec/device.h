// Runtime probes of the CUDA build (defined only when built with CUDA; callers guard
// with VERISPEC_WITH_CUDA).
#pragma once

namespace verispec {

// Number of usable devices; 0 when there is no driver or no GPU (never throws).
int cuda_device_count();
// The CUDA runtime version the module was compiled against (e.g. 13000).
int cuda_runtime_version();

}  // namespace verispec

// VERISPEC_HD marks an inline function that runs on the host and on the device: the
// headers that hold a rule both backends share (philox.h, sampling_math.h,
// slot_mapping.h) define it once, for the CPU kernels and the CUDA kernels alike.
#pragma once

#if defined(__CUDACC__)
#define VERISPEC_HD __host__ __device__
#else
#define VERISPEC_HD
#endif

// VERISPEC_HD marks an inline function that runs on the host and on the device: the
// headers that hold a rule both backends share (philox.h, sampling_math.h,
// slot_mapping.h) define it once, for the CPU kernels and the CUDA kernels alike.
// The host simulation of the device code (csrc/tests/cuda_sim/cuda_sim.h) compiles the
// device branches of these functions on the host: there they carry an ABI tag, so that
// they are symbols of their own beside the host versions the CPU kernels link to.
#pragma once

#if defined(__CUDACC__)
#define VERISPEC_HD __host__ __device__
#elif defined(VERISPEC_CUDA_SIM)
#define VERISPEC_HD __attribute__((abi_tag("cuda_sim")))
#else
#define VERISPEC_HD
#endif

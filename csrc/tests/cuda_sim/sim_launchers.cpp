// The CUDA launchers themselves (kernels/cuda/launch.cu and ops.cu), compiled for the
// host simulation: their checks, workspace, kernel choice, grids and block sizes (512 a
// row, 256 a chunk of a split row, 32) run as on a GPU, each launch in the simulation
// (cuda_sim.h; the runtime's stand-in is cuda_runtime.h). test_cuda_sim_kernels.cpp calls
// apply_policy_cuda & co. from here and compares them with the CPU launchers.
//
// These definitions take the place of the library's cuda_stubs.cpp (a build without CUDA),
// which defines the same five functions: the linker then never pulls the stubs in.
#include "cuda_sim.h"  // first: __CUDA_ARCH__, __device__, threadIdx, __syncthreads, ...

#include "../../kernels/cuda/launch.cu"
#include "../../kernels/cuda/ops.cu"

// verispec._C: the private native module. The public API is python/verispec.
#include <dlpack/dlpack.h>
#include <pybind11/pybind11.h>

#include <string>

#include "bindings.h"
#include "tensor_view.h"
#include "verispec/errors.h"
#include "verispec/layers/linear.h"
#include "verispec/nvtx.h"
#ifdef VERISPEC_WITH_CUDA
#include "verispec/device.h"
#endif

#ifndef VERISPEC_VERSION
#define VERISPEC_VERSION "0.0.0+unknown"
#endif
#ifndef VERISPEC_CUDA_ARCHITECTURES
#define VERISPEC_CUDA_ARCHITECTURES ""
#endif

namespace py = pybind11;

namespace verispec {

void register_errors(py::module_& m) {
  static py::exception<CacheFullError> cache_full(m, "CacheFullError", PyExc_RuntimeError);
  cache_full.doc() =
      "The KV block pool has too few free blocks for the request; nothing was changed.";
  static py::exception<StepInProgressError> step_in_progress(m, "StepInProgressError",
                                                             PyExc_RuntimeError);
  step_in_progress.doc() =
      "SpecDecoder: a step was started while another is running (one step at a time).";
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const CacheFullError& e) {
      py::set_error(cache_full, e.what());
    } catch (const StepInProgressError& e) {
      py::set_error(step_in_progress, e.what());
    } catch (const UnknownSequenceError& e) {
      py::set_error(PyExc_KeyError, e.what());
    } catch (const InvalidArgumentError& e) {
      py::set_error(PyExc_ValueError, e.what());
    }
  });
}

namespace {

py::dict build_info() {
  py::dict info;
  info["version"] = VERISPEC_VERSION;
  info["dlpack_version"] = std::to_string(DLPACK_MAJOR_VERSION) + "." +
                           std::to_string(DLPACK_MINOR_VERSION);
#if defined(__clang__)
  info["compiler"] = std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
  info["compiler"] = std::string("gcc ") + __VERSION__;
#else
  info["compiler"] = "unknown";
#endif
#ifdef VERISPEC_WITH_CUDA
  info["cuda_compiled"] = true;
  info["cuda_architectures"] = std::string(VERISPEC_CUDA_ARCHITECTURES);
  info["cuda_runtime_version"] = cuda_runtime_version();
  const int n = cuda_device_count();
  info["num_gpus"] = n;
  info["gpu_available"] = n > 0;
#else
  info["cuda_compiled"] = false;
  info["cuda_architectures"] = "";
  info["cuda_runtime_version"] = py::none();
  info["num_gpus"] = 0;
  info["gpu_available"] = false;
#endif
  // Tensors whose type offers a DLPack C exchange API (torch >= 2.10) are imported
  // without calling __dlpack__ (DLPack header >= 1.3).
  info["dlpack_c_exchange_api"] = TensorView::exchange_api_compiled();
  info["nvtx"] = kNvtxCompiled;  // NVTX3 ranges around the decoder's phases
  // The instruction set of the CPU linear kernel on this machine (verispec.ops.linear).
  info["cpu_linear_isa"] = linear_isa_name(linear_best_isa());
  return info;
}

}  // namespace
}  // namespace verispec

PYBIND11_MODULE(_C, m) {
  m.doc() = "verispec native core: paged KV block allocator and sampling kernels";
  verispec::register_errors(m);
  verispec::register_cache(m);
  verispec::register_decoder(m);
  verispec::register_ops(m);
  verispec::register_layers(m);
  m.def("_dlpack_import_path", &verispec::TensorView::import_path, py::arg("obj"),
        "How the ops import obj: 'c_exchange_api' or '__dlpack__'.");
  m.def("build_info", &verispec::build_info,
        "Version, whether CUDA was compiled in (and for which architectures), and "
        "whether a GPU is usable now.");
}

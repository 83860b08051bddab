// NVTX ranges for Nsight Systems: the phases of a decoder step, in the "verispec" domain.
//
// Header-only NVTX3 from the CUDA toolkit when the build found one (VERISPEC_WITH_NVTX);
// otherwise every range is a no-op. With no profiler attached NVTX3 costs a pointer
// check per range, so the ranges stay on in release builds.
#pragma once

#if defined(VERISPEC_WITH_NVTX)
#include <nvtx3/nvToolsExt.h>
#endif

namespace verispec {

#if defined(VERISPEC_WITH_NVTX)
// One range, open for the lifetime of the object (names must be string literals).
class NvtxRange {
 public:
  explicit NvtxRange(const char* name) {
    nvtxEventAttributes_t attr{};
    attr.version = NVTX_VERSION;
    attr.size = NVTX_EVENT_ATTRIB_STRUCT_SIZE;
    attr.messageType = NVTX_MESSAGE_TYPE_ASCII;
    attr.message.ascii = name;
    nvtxDomainRangePushEx(domain(), &attr);
  }
  ~NvtxRange() { nvtxDomainRangePop(domain()); }
  NvtxRange(const NvtxRange&) = delete;
  NvtxRange& operator=(const NvtxRange&) = delete;

 private:
  static nvtxDomainHandle_t domain() {
    static const nvtxDomainHandle_t d = nvtxDomainCreateA("verispec");
    return d;
  }
};
constexpr bool kNvtxCompiled = true;
#else
class NvtxRange {
 public:
  explicit NvtxRange(const char*) {}
};
constexpr bool kNvtxCompiled = false;
#endif

}  // namespace verispec

// The int8 arithmetic's AVX-512 VNNI path (quant_int8.cpp): quant_int8_body.inc
// compiled for AVX-512 only here, so no other path holds an AVX-512 instruction.
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "quant_int8_internal.h"
#include "quant_internal.h"

namespace verispec {
namespace quant_detail {

#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
#define VS_NS vnni512
#define VS_ZMM 1
#define VS_VNNI 1
#include "quant_int8_body.inc"

}  // namespace quant_detail
}  // namespace verispec
#endif

// The int8 arithmetic's AVX-VNNI path (quant_int8.cpp): quant_int8_body.inc with
// 256-bit vpdpbusd.
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "quant_int8_internal.h"
#include "quant_internal.h"

namespace verispec {
namespace quant_detail {

#pragma GCC target("avxvnni,avx2,fma,f16c")
#define VS_NS avxvnni
#define VS_VNNI 1
#define VS_DOTACC(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#include "quant_int8_body.inc"

}  // namespace quant_detail
}  // namespace verispec
#endif

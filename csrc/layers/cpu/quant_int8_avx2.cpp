// The int8 arithmetic's AVX2 path (quant_int8.cpp): quant_int8_body.inc with the
// four-product sums built from vpmaddubsw + vpmaddwd: pairs of u8 x s8 in int16 (at most
// 2 * 128 * 127 = 32512 here, Q8_0 as |w| times x with w's sign: no saturation), then
// pairs of those in int32, the same lane sums as vpdpbusd.
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "quant_int8_internal.h"
#include "quant_internal.h"

namespace verispec {
namespace quant_detail {

#pragma GCC target("avx2,fma,f16c")
#define VS_NS avx2
#define VS_VNNI 0
#define VS_DOTACC(acc, u, s) \
  _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)))
#include "quant_int8_body.inc"

}  // namespace quant_detail
}  // namespace verispec
#endif

// Philox4x32-10 counter-based RNG and verispec's single random-stream layout.
//
// Framework-free and header-only: the same inline functions run on the host (CPU
// kernels, tests) and on the device (CUDA kernels), so both backends draw the same
// coin for the same (seed, offset, row, position, purpose).
//
// Stream layout (the one place it is defined):
//
//   key     = { lo32(seed), hi32(seed) }                      seed: any 64-bit value
//   counter = { position,                                     ctr[0]
//               row,                                          ctr[1]
//               lo32(offset),                                 ctr[2]
//               (hi32(offset) & 0x0fffffff) | purpose << 28 } ctr[3]
//   coin    = uniform24(philox4x32_10(counter, key)[0])       in [0, 1)
//   draw    = word 1 << 32 | word 0 of the same block           a 64-bit coin
//
// A coin u is an acceptance test's (u * q(y) < p(y); block verification's keep test).
// A draw picks a token by the exact inverse CDF over fixed-point weights
// (sampling_math.h draw_target: target = floor(draw * total / 2^64)): the correction or
// bonus of verify (kCorrection), sample (kSample), a tree node's token (kTreeEmit).
//
// Philox is a bijection of the counter for a fixed key, so distinct counters give
// independent coins. The layout is collision-free for offset < 2^60, row < 2^32,
// position < 2^32 and 16 purposes; callers keep offset in [0, 2^60) (the Python
// layer checks it; larger offsets wrap modulo 2^60).
//
// Convention: one op call uses one offset and addresses its coins by (row, position,
// purpose); the caller gives each call its own offset (SpecDecoder: verify at the step's
// base offset, draft pass j at base + 1 + j, the next step at base + K + 1), so a
// stream never repeats and every rank of a sharded run draws the same coins without
// communication. A coin uses word 0 of its block, a draw words 0 and 1; words 2..3 are
// reserved.
//
// Tree verification (verify_tree) addresses its coins by node: position = i for the
// acceptance coin of draft node i (Purpose::kTreeAccept), and position = the node's row in
// target_logits (0 = the root, i + 1 = node i) for the one token drawn there
// (Purpose::kTreeEmit): the deterministic-candidate draw x of every node the walk passes,
// and the correction / bonus at the node where it stops. A walk visits a node at most
// once, so no coin is used twice. Block verification (verify, method "block") uses the
// chain's addresses: eta_j = (row, j, kAccept) for draft position j, and the final token at
// position tau with kCorrection.
//
// The keyed stream (Purpose::kRace, per-request reproducible sampling) is laid out
// differently: it is addressed by a request's own seed and a token's position in its
// sequence, never by a call's offset or a batch row, so a request draws the same
// coins alone or in any batch, at any step:
//
//   key     = { lo32(request seed), hi32(request seed) }
//   counter = { lo32(position), token / 4, hi32(position), kRace << 28 }
//   E(seed, position, token) = -log(((word[token % 4] >> 9) + 0.5) * 2^-23)   in (0, 16.7]
//   (log: sampling_math.h log_reduced, the same bits on both backends)
//
// one exponential per vocabulary entry, four to a Philox block (all four words used).
// The purpose bits keep it apart from the offset-addressed stream.
#pragma once

#include <cmath>
#include <cstdint>

#include "verispec/host_device.h"

namespace verispec {

// What a coin is for. Values are part of the stream layout: never renumber.
enum class Purpose : uint32_t {
  kAccept = 0,      // u for the acceptance test of draft position j (verify)
  kCorrection = 1,  // u for the residual sample at the first rejection, or the bonus
  kSample = 2,      // u for the plain sample op (position 0)
  kDraft = 3,       // reserved: sampling draft proposals
  kRace = 4,        // the keyed stream: exponentials of a keyed sample (layout above)
  kTreeAccept = 5,  // verify_tree: u for the acceptance test of draft node i (position i)
  kTreeEmit = 6,    // verify_tree: u for the token drawn at a node (position = its row)
};

constexpr uint64_t kPhiloxMaxOffset = uint64_t{1} << 60;  // offsets must stay below

struct Philox4x32 {
  uint32_t v[4];
};

namespace philox_detail {

constexpr uint32_t kM0 = 0xD2511F53u;  // round multipliers (Salmon et al., SC'11)
constexpr uint32_t kM1 = 0xCD9E8D57u;
constexpr uint32_t kW0 = 0x9E3779B9u;  // Weyl key increments
constexpr uint32_t kW1 = 0xBB67AE85u;

VERISPEC_HD inline uint32_t mulhilo(uint32_t a, uint32_t b, uint32_t* hi) {
#if defined(__CUDA_ARCH__)
  *hi = __umulhi(a, b);
  return a * b;
#else
  const uint64_t product = static_cast<uint64_t>(a) * static_cast<uint64_t>(b);
  *hi = static_cast<uint32_t>(product >> 32);
  return static_cast<uint32_t>(product);
#endif
}

VERISPEC_HD inline Philox4x32 round(const Philox4x32& c, uint32_t k0, uint32_t k1) {
  uint32_t hi0, hi1;
  const uint32_t lo0 = mulhilo(kM0, c.v[0], &hi0);
  const uint32_t lo1 = mulhilo(kM1, c.v[2], &hi1);
  return Philox4x32{{hi1 ^ c.v[1] ^ k0, lo1, hi0 ^ c.v[3] ^ k1, lo0}};
}

}  // namespace philox_detail

// The Philox4x32 bijection with 10 rounds (Random123's philox4x32_10).
VERISPEC_HD inline Philox4x32 philox4x32_10(Philox4x32 counter, uint32_t key0, uint32_t key1) {
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int r = 0; r < 10; ++r) {
    counter = philox_detail::round(counter, key0, key1);
    key0 += philox_detail::kW0;
    key1 += philox_detail::kW1;
  }
  return counter;
}

// The counter of the stream layout above.
VERISPEC_HD inline Philox4x32 philox_counter(uint64_t offset, uint32_t row, uint32_t position,
                                             Purpose purpose) {
  const uint32_t hi = static_cast<uint32_t>(offset >> 32) & 0x0fffffffu;
  return Philox4x32{{position, row, static_cast<uint32_t>(offset),
                     hi | (static_cast<uint32_t>(purpose) << 28)}};
}

// The 64-bit coin of a draw (an inverse-CDF pick, sampling_math.h draw_target): words 1
// and 0 of the block, so c / 2^64 is uniform on [0, 1) in steps of 2^-64.
VERISPEC_HD inline uint64_t uniform64(uint64_t seed, uint64_t offset, uint32_t row,
                                      uint32_t position, Purpose purpose) {
  const Philox4x32 out =
      philox4x32_10(philox_counter(offset, row, position, purpose),
                    static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  return (static_cast<uint64_t>(out.v[1]) << 32) | out.v[0];
}

// Top 24 bits of x as a float in [0, 1): every value is exact and 1.0f is never returned.
VERISPEC_HD inline float uniform24(uint32_t x) {
  return static_cast<float>(x >> 8) * (1.0f / 16777216.0f);
}

// The coin for (seed, offset, row, position, purpose), uniform on [0, 1) in steps of 2^-24.
VERISPEC_HD inline float uniform(uint64_t seed, uint64_t offset, uint32_t row, uint32_t position,
                                 Purpose purpose) {
  const Philox4x32 out =
      philox4x32_10(philox_counter(offset, row, position, purpose),
                    static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  return uniform24(out.v[0]);
}

// The Philox block holding the keyed-stream words of tokens 4 * quad .. 4 * quad + 3.
VERISPEC_HD inline Philox4x32 race_block(uint64_t seed, uint64_t position, uint32_t quad) {
  const Philox4x32 counter{{static_cast<uint32_t>(position), quad,
                            static_cast<uint32_t>(position >> 32),
                            static_cast<uint32_t>(Purpose::kRace) << 28}};
  return philox4x32_10(counter, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}

}  // namespace verispec

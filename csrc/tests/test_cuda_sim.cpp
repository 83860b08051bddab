// The CUDA block algorithms of cuda/block_ops.cuh, run on the host in the simulation of
// cuda_sim/ (a fiber per GPU thread, real barriers and warp shuffles, stand-ins
// for the two CUB classes used): the policy of a row (max, normaliser, the filter
// threshold by radix selection), and the inverse-CDF pick. Checked
// against the CPU kernels, which share the rules (sampling_math.h) but not the code.
// This is the device code itself, compiled for the host: a GPU run checks the rest
// (memory, launch, the real CUB), but a logic error shows here, without a GPU.
#include "cuda_sim.h"  // first: __device__, threadIdx, __syncthreads, ...

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <functional>
#include <memory>
#include <random>
#include <vector>

#include "../kernels/cuda/block_ops.cuh"
#include "native_check.h"

using namespace verispec;
using namespace verispec::kernels;
using namespace verispec::kernels::cuda;

namespace {

constexpr int kSimBlock = 64;  // two warps: small enough to simulate, large enough to split

using Ops = BlockOps<kSimBlock>;

RowPolicy make_policy(float temperature, int32_t top_k, float top_p, float min_p) {
  RowPolicy p;
  p.temperature = temperature;
  p.top_k = top_k;
  p.top_p = top_p;
  p.min_p = min_p;
  return p;
}

struct SimStats {
  int verdict;
  RowStats stats;
  bool same_in_every_thread;
};

template <bool FILTER>
SimStats sim_row_stats(const std::vector<float>& x, const RowPolicy& pol) {
  auto ops = std::make_unique<Ops>();
  std::vector<RowStats> per_thread(kSimBlock);
  std::vector<int> verdicts(kSimBlock);
  const int V = static_cast<int>(x.size());
  cuda_sim::run_block(kSimBlock, [&] {
    RowStats s{};
    const int r = compute_row_stats<float, kSimBlock, FILTER>(x.data(), V, pol, pol.greedy(), *ops, &s);
    per_thread[threadIdx.x] = s;
    verdicts[threadIdx.x] = r;
  });
  SimStats out{verdicts[0], per_thread[0], true};
  for (int t = 1; t < kSimBlock; ++t) {
    out.same_in_every_thread &= verdicts[t] == verdicts[0];
    if (verdicts[0] == kLogitsOk) {
      out.same_in_every_thread &=
          std::memcmp(&per_thread[t], &per_thread[0], sizeof(RowStats)) == 0;
    }
  }
  return out;
}

std::vector<float> probs_from(const std::vector<float>& x, const RowStats& s, const RowPolicy& pol) {
  std::vector<float> p(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    p[i] = policy_prob(x[i], static_cast<int>(i), s, pol.temperature, pol.greedy());
  }
  return p;
}

// The CPU launcher's probabilities of one row (the library's host code: this file
// compiles the device branches of the shared math, see cuda_sim.h).
bool cpu_policy_row(const std::vector<float>& x, const RowPolicy& pol, std::vector<float>* out) {
  ApplyPolicyArgs a;
  a.logits = x.data();
  a.logits_row_stride = static_cast<int64_t>(x.size());
  a.rows = 1;
  a.vocab = static_cast<int64_t>(x.size());
  a.policy.temperature = pol.temperature;
  a.policy.top_k = pol.top_k;
  a.policy.top_p = pol.top_p;
  a.policy.min_p = pol.min_p;
  a.probs = out->data();
  a.probs_row_stride = a.vocab;
  return apply_policy_cpu(a).ok();
}

std::vector<float> random_logits(std::mt19937& rng, int V, float scale) {
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> x(static_cast<size_t>(V));
  for (auto& v : x) v = normal(rng);
  return x;
}

void test_row_stats_match_the_cpu_policy() {
  std::mt19937 rng(21);
  const RowPolicy policies[] = {
      make_policy(1.0f, 0, 1.0f, 0.0f),     make_policy(0.6f, 0, 1.0f, 0.0f),
      make_policy(0.0f, 0, 1.0f, 0.0f),     make_policy(1.0f, 20, 1.0f, 0.0f),
      make_policy(1.0f, 1, 1.0f, 0.0f),     make_policy(1.0f, 0, 0.8f, 0.0f),
      make_policy(1.0f, 0, 0.999f, 0.0f),   make_policy(1.0f, 0, 1.0f, 0.05f),
      make_policy(1.3f, 50, 0.9f, 0.02f),   make_policy(0.7f, 3, 0.95f, 0.3f),
  };
  for (int V : {1, 2, 63, 64, 65, 700, 3001}) {
    const std::vector<float> x = random_logits(rng, V, 3.0f);
    for (const RowPolicy& pol : policies) {
      const SimStats sim = sim_row_stats<true>(x, pol);
      CHECK(sim.verdict == kLogitsOk);
      CHECK(sim.same_in_every_thread);
      const std::vector<float> got = probs_from(x, sim.stats, pol);
      std::vector<float> want(x.size());
      CHECK(cpu_policy_row(x, pol, &want));
      // The same bits: exact fixed-point sums, uncontracted float math on both sides.
      CHECK(std::memcmp(got.data(), want.data(), want.size() * sizeof(float)) == 0);
      if (pol.top_k > 0 && pol.top_k < V && pol.top_p >= 1.0f && pol.min_p == 0.0f &&
          !pol.greedy()) {
        int kept = 0;
        for (float v : got) kept += v > 0.0f;
        CHECK(kept == pol.top_k);
      }
      if (!top_k_active(pol.top_k, V) && !top_p_active(pol.top_p) && !min_p_active(pol.min_p)) {
        // Without a filter, the kernels compiled without one give the same bits.
        const SimStats plain = sim_row_stats<false>(x, pol);
        CHECK(plain.verdict == kLogitsOk && plain.same_in_every_thread);
        CHECK(std::memcmp(&plain.stats, &sim.stats, sizeof(RowStats)) == 0);
      }
    }
  }
}

void test_row_stats_ties_and_bad_logits() {
  // Ties at the top-k threshold are kept (as on the CPU): 5 logits equal to the 3rd largest.
  std::vector<float> x = {0.0f, 2.0f, 1.0f, 1.0f, -1.0f, 1.0f, 1.0f, 3.0f, 1.0f, -4.0f};
  const RowPolicy top3 = make_policy(1.0f, 3, 1.0f, 0.0f);
  const SimStats sim = sim_row_stats<true>(x, top3);
  const std::vector<float> p = probs_from(x, sim.stats, top3);
  int kept = 0;
  for (float v : p) kept += v > 0.0f;
  CHECK(kept == 7);  // 3.0, 2.0 and the five 1.0s
  // NaN / +Inf: the lowest bad index; all -Inf: kLogitsAllMasked.
  x[6] = std::nanf("");
  x[8] = INFINITY;
  CHECK(sim_row_stats<true>(x, top3).verdict == 6);
  CHECK(sim_row_stats<false>(x, make_policy(1.0f, 0, 1.0f, 0.0f)).verdict == 6);
  const std::vector<float> masked(100, -INFINITY);
  CHECK(sim_row_stats<true>(masked, top3).verdict == static_cast<int>(kLogitsAllMasked));
}

// radix selection (radix_hist_add, radix_select: the filters' thresholds) against brute force over sets built for
// its edges: ties, zeros, values one ulp apart (the answer decided in the last digit),
// fewer values than bins, and both kinds of enough (a count, a fraction of the mass).
void test_radix_select() {
  std::mt19937 rng(8);
  auto ops = std::make_unique<Ops>();
  auto scratch = std::make_unique<RadixScratch>();
  int cases = 0;
  for (int trial = 0; trial < 60; ++trial) {
    const int n = trial % 3 == 0 ? 1 + static_cast<int>(rng() % 40) : 500 + static_cast<int>(rng() % 3000);
    std::vector<float> p(static_cast<size_t>(n));
    std::uniform_real_distribution<float> unit(0.0f, 1.0f);
    for (int i = 0; i < n; ++i) {
      switch (trial % 4) {
        case 0: p[static_cast<size_t>(i)] = unit(rng) / static_cast<float>(n); break;
        case 1: p[static_cast<size_t>(i)] = static_cast<float>(rng() % 5) * 0.01f; break;  // ties, zeros
        case 2: p[static_cast<size_t>(i)] = std::nextafter(0.25f, 0.0f) - static_cast<float>(rng() % 7) * 1.4901161e-8f; break;  // ulps
        default: p[static_cast<size_t>(i)] = std::ldexp(unit(rng), -static_cast<int>(rng() % 60)); break;
      }
    }
    std::vector<float> sorted = p;
    std::sort(sorted.begin(), sorted.end(), std::greater<float>());
    auto stat_at = [&p](float t) {
      RadixStat st{0, 0};
      for (float v : p) {
        if (v >= t) {
          ++st.count;
          st.mass += fixed_weight(v);
        }
      }
      return st;
    };
    const int k = 1 + static_cast<int>(rng() % static_cast<uint32_t>(n));
    const float fraction = trial % 5 == 0 ? 1e-6f : unit(rng);
    const uint64_t total = stat_at(0.0f).mass;
    for (int kind = 0; kind < 2; ++kind) {
      auto enough = [&](const RadixStat& st) {
        return kind == 0 ? st.count >= static_cast<unsigned long long>(k)
                         : mass_at_least(st.mass, fraction, total);
      };
      if (kind == 1 && total == 0) continue;  // no mass: enough never holds
      float want = 0.0f;  // the largest value with enough
      for (float v : sorted) {
        if (enough(stat_at(v))) {
          want = v;
          break;
        }
      }
      // The search alone: top-k (kind 0) or top-p without top-k (kind 1, of every value's
      // mass), its passes as filter_threshold runs them.
      const RowPolicy pol = kind == 0 ? make_policy(1.0f, k, 1.0f, 0.0f)
                                      : make_policy(1.0f, 0, fraction, 0.0f);
      std::vector<FilterRun> got(kSimBlock);
      cuda_sim::run_block(kSimBlock, [&] {
        FilterRun run = filter_run_start();
        for (int pass = 0; pass < kRadixPasses; ++pass) {
          radix_hist_clear<kSimBlock>(scratch->hist());
          __syncthreads();
          radix_hist_add<kSimBlock>([&p](int i) { return p[static_cast<size_t>(i)]; }, 0, n, pass,
                                    run.prefix, scratch->hist());
          __syncthreads();
          radix_select<kSimBlock>(&run, kind, pass, pol, scratch->hist(), *ops);
        }
        got[threadIdx.x] = run;
      });
      const RadixStat want_at = stat_at(want);
      for (int t = 0; t < kSimBlock; ++t) {  // every thread holds the answer
        const FilterRun& r = got[static_cast<size_t>(t)];
        CHECK(r.threshold == want && r.kept_known == 1);
        CHECK(r.kept.count == want_at.count && r.kept.mass == want_at.mass);
        if (kind == 1) CHECK(r.survivors == total);
      }
      ++cases;
    }
  }
  CHECK(cases >= 100);
}

struct SimPick {
  int token;
  unsigned long long total;
};

SimPick sim_pick(const std::vector<uint64_t>& w, uint64_t draw) {
  auto ops = std::make_unique<Ops>();
  const int V = static_cast<int>(w.size());
  std::vector<SimPick> per_thread(kSimBlock);
  cuda_sim::run_block(kSimBlock, [&] {
    auto weight = [&w](int i) { return static_cast<unsigned long long>(w[static_cast<size_t>(i)]); };
    const WeightTotal t = block_total<kSimBlock>(weight, V, *ops);
    const int token = block_pick<kSimBlock>(weight, V, draw, t, *ops);
    per_thread[threadIdx.x] = SimPick{token, t.total};
  });
  for (int t = 1; t < kSimBlock; ++t) {
    CHECK(per_thread[t].token == per_thread[0].token);
    CHECK(per_thread[t].total == per_thread[0].total);
  }
  return per_thread[0];
}

// The block's pick is the sequential exact inverse CDF (pick_fixed), token for token: the
// chunk sums, their scan and the walk are integer arithmetic.
void test_pick_is_the_inverse_cdf() {
  std::mt19937_64 rng(13);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  int trials = 0;
  for (int V : {1, 5, 63, 64, 65, 130, 1000, 4099}) {
    for (int rep = 0; rep < 12; ++rep) {
      std::vector<uint64_t> w(static_cast<size_t>(V));
      for (auto& v : w) v = fixed_weight(unit(rng));
      if (rep % 3 == 1) {  // leading zeros: the first chunks have no mass
        for (int i = 0; i < V * 3 / 4; ++i) w[static_cast<size_t>(i)] = 0;
      }
      if (rep % 3 == 2) {  // sparse
        for (auto& v : w) v = unit(rng) < 0.9f ? 0 : v;
      }
      uint64_t total = 0;
      for (uint64_t v : w) total += v;
      for (uint64_t draw : {uint64_t{0}, rng(), rng(), rng(), ~uint64_t{0}}) {
        const SimPick sim = sim_pick(w, draw);
        CHECK(sim.total == total);
        if (total == 0) {
          CHECK(sim.token == -1);
          continue;
        }
        ++trials;
        const int64_t want = pick_fixed([&w](int64_t i) { return w[static_cast<size_t>(i)]; }, V,
                                        draw_target(draw, total));
        CHECK(sim.token == want);
        CHECK(sim.token >= 0 && sim.token < V && w[static_cast<size_t>(sim.token)] > 0);
      }
    }
  }
  CHECK(trials > 200);
  // All zero: -1.
  CHECK(sim_pick(std::vector<uint64_t>(70, 0), 12345).token == -1);
}

// ---- the device branches of the shared math ----------------------------------------------
// This file compiles them (cuda_sim.h defines __CUDA_ARCH__): each against its rule, derived
// here another way, so that a change to a device branch alone fails here as well as in the
// kernels' comparisons with the CPU (test_cuda_sim_kernels.cpp).

// floor(a * b / 2^shift) of 64-bit integers by 32-bit limbs (shift in [40, 64]).
uint64_t product_shifted(uint64_t a, uint64_t b, int shift) {
  const uint64_t a0 = a & 0xffffffffu, a1 = a >> 32, b0 = b & 0xffffffffu, b1 = b >> 32;
  const uint64_t p00 = a0 * b0, p01 = a0 * b1, p10 = a1 * b0, p11 = a1 * b1;
  const uint64_t mid = (p00 >> 32) + (p01 & 0xffffffffu) + (p10 & 0xffffffffu);
  const uint64_t lo = (mid << 32) | (p00 & 0xffffffffu);
  const uint64_t hi = p11 + (p01 >> 32) + (p10 >> 32) + (mid >> 32);
  return shift == 64 ? hi : (hi << (64 - shift)) | (lo >> shift);
}

void test_device_branches_follow_their_rules() {
  // fixed_weight = floor(min(w, 8) * 2^40) (__float2ull_rz): exact in double for w < 8.
  // Every 61st float of [0, 8], then the edges.
  int64_t wrong = 0, checked = 0;
  auto check_weight = [&](float w) {
    const double c = w < 8.0f ? static_cast<double>(w) : 8.0;
    wrong += fixed_weight(w) != static_cast<uint64_t>(std::floor(std::ldexp(c, kFixedBits)));
    ++checked;
  };
  for (uint32_t b = 0; b <= float_bits(8.0f); b += 61) check_weight(bits_float(b));
  for (float w : {0.0f, -0.0f, 1e-45f, 9.094947e-13f, 9.094948e-13f, 0.5f, 1.0f,
                  std::nextafter(1.0f, 0.0f), std::nextafter(8.0f, 0.0f), 8.0f, 9.0f, 1e30f,
                  INFINITY}) {
    check_weight(w);
  }
  CHECK(fixed_weight(NAN) == uint64_t{8} << kFixedBits);  // NaN fails w < 8: the cap
  // fixed_to_float = the nearest float to u * 2^-40 (__ull2float_rn): u < 2^53 is exact in
  // double, whose one conversion to float rounds to nearest.
  std::mt19937_64 rng(40);
  for (int i = 0; i < 200000; ++i) {
    const uint64_t u = rng() >> (11 + i % 40);
    wrong += fixed_to_float(u) != static_cast<float>(std::ldexp(static_cast<double>(u), -kFixedBits));
    ++checked;
  }
  // draw_target = floor(c * total / 2^64) and fixed_rescale = floor(sum * scale / 2^40)
  // (__umul64hi), against the product by limbs; fixed_rescale within its contract (sum
  // below 2^51, scale at most 2^40).
  for (int i = 0; i < 200000; ++i) {
    const uint64_t coin = i % 7 == 0 ? ~uint64_t{0} : rng(), total = rng() >> (i % 64);
    wrong += draw_target(coin, total) != product_shifted(coin, total, 64);
    const uint64_t sum = rng() >> (13 + i % 50), scale = rng() >> (24 + i % 40);
    wrong += fixed_rescale(sum, scale) != product_shifted(sum, scale, kFixedBits);
    checked += 2;
  }
  CHECK(fixed_rescale(uint64_t{1} << 50, uint64_t{1} << 40) == uint64_t{1} << 50);
  // fp16_to_float (cvt.f32.f16): every half, against the compiler's _Float16.
  for (uint32_t h = 0; h < 65536; ++h) {
    _Float16 half;
    const auto bits = static_cast<uint16_t>(h);
    std::memcpy(&half, &bits, sizeof half);
    const float want = static_cast<float>(half), got = fp16_to_float(bits);
    wrong += std::isnan(want) ? !std::isnan(got) : float_bits(got) != float_bits(want);
    ++checked;
  }
  // fp_mul / fp_add / fp_sub (__fmul_rn, ...): each one IEEE operation, rounded to nearest:
  // against double arithmetic, exact for these operands, rounded once to float.
  std::uniform_real_distribution<float> unit(-4.0f, 4.0f);
  for (int i = 0; i < 200000; ++i) {
    const float a = std::ldexp(unit(rng), static_cast<int>(rng() % 40) - 20), b = unit(rng);
    wrong += float_bits(fp_mul(a, b)) != float_bits(static_cast<float>(static_cast<double>(a) * b));
    wrong += float_bits(fp_add(a, b)) != float_bits(static_cast<float>(static_cast<double>(a) + b));
    wrong += float_bits(fp_sub(a, b)) != float_bits(static_cast<float>(static_cast<double>(a) - b));
    checked += 3;
  }
  const int64_t off_before_exp = wrong;
  // exp_reduced, built of those: about one ulp of exp (sampling_math.h), where exp is a
  // normal float.
  for (float x = -87.0f; x <= 0.0f; x += 0.0137f) {
    const double want = std::exp(static_cast<double>(x));
    wrong += std::fabs(exp_reduced(x) - want) > 2.0 * want * 5.96e-8;
    ++checked;
  }
  std::printf("device branches: %lld values, %lld off their rule (%lld of exp)\n",
              static_cast<long long>(checked), static_cast<long long>(wrong),
              static_cast<long long>(wrong - off_before_exp));
  CHECK(wrong == 0 && checked > 1000000);
  // Philox's __umulhi: Random123's known answers (kat_vectors, philox4x32 10).
  const Philox4x32 zero = philox4x32_10(Philox4x32{{0, 0, 0, 0}}, 0, 0);
  CHECK(zero.v[0] == 0x6627e8d5u && zero.v[1] == 0xe169c58du && zero.v[2] == 0xbc57ac4cu &&
        zero.v[3] == 0x9b00dbd8u);
  const Philox4x32 ones = philox4x32_10(Philox4x32{{~0u, ~0u, ~0u, ~0u}}, ~0u, ~0u);
  CHECK(ones.v[0] == 0x408f276du && ones.v[1] == 0x41c83b0eu && ones.v[2] == 0xa20bc7c6u &&
        ones.v[3] == 0x6d5451fdu);
}

}  // namespace

namespace cuda_sim {
// A kernel that reads its shared word before writing it (the simulation poisons the
// __shared__ objects of namespace cuda_sim, as those of the device code).
template <int BLOCK>
void read_before_write_kernel(std::vector<unsigned>* seen) {
  __shared__ unsigned left;
  if (threadIdx.x == 0) (*seen)[blockIdx.x] = left;  // before this block writes it
  __syncthreads();
  if (threadIdx.x == 0) left = 0x12345678u;
}
}  // namespace cuda_sim

namespace {

// Shared memory starts every block as garbage: a read before the block's own write sees
// neither the last block's value nor zero; and the kernels' own shared objects are found
// (a template's among them, e.g. BlockOps<64>'s).
void test_simulation_poisons_shared_memory() {
  constexpr unsigned kBlocks = 6;
  std::vector<unsigned> seen(kBlocks, 0);
  cuda_sim::run_grid(kBlocks, 32, [&] { cuda_sim::read_before_write_kernel<32>(&seen); });
  for (unsigned b = 0; b < kBlocks; ++b) CHECK(seen[b] != 0x12345678u && seen[b] != 0);
  CHECK(seen[1] != seen[2]);  // not one constant either
  size_t bytes = 0;
  for (const auto& o : cuda_sim::shared_objects()) bytes += o.bytes;
  std::printf("shared memory: %zu objects, %zu bytes poisoned before each block\n",
              cuda_sim::shared_objects().size(), bytes);
  CHECK(cuda_sim::shared_objects().size() >= 3 && bytes > 24 * 1024);  // RadixScratch: 24 KB
}

// The simulation itself. A read of shared memory without its barrier must be seen to go
// wrong (fibers resume in a shuffled order at each release), and with the barrier never.
int stale_reads(bool with_barrier) {
  int stale = 0;
  for (int round = 0; round < 20; ++round) {
    static int shared_value;
    shared_value = -1;
    cuda_sim::run_block(kSimBlock, [&] {
      __syncthreads();
      if (threadIdx.x == 0) shared_value = round;
      if (with_barrier) __syncthreads();
      stale += shared_value != round;
    });
  }
  return stale;
}

void test_simulation_exposes_a_missing_barrier() {
  CHECK(stale_reads(true) == 0);
  CHECK(stale_reads(false) > 20 * kSimBlock / 4);  // ~half the threads run before thread 0
}

// A barrier that some thread never reaches: on a GPU a hang (or worse), in the simulation
// an abort with a message, never a hang. Checked in a child process.
void test_simulation_reports_a_deadlock() {
  std::fflush(nullptr);
  const pid_t child = fork();
  if (child == 0) {
    std::freopen("/dev/null", "w", stderr);  // the expected message
    cuda_sim::run_block(kSimBlock, [] {
      if (threadIdx.x == 3) return;  // the bug: an early return before a barrier
      __syncthreads();
    });
    _exit(0);  // not reached if the deadlock is reported
  }
  int status = 0;
  CHECK(child > 0 && waitpid(child, &status, 0) == child);
  CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT);
}

}  // namespace

int main() {
  test_device_branches_follow_their_rules();
  test_simulation_poisons_shared_memory();
  test_simulation_exposes_a_missing_barrier();
  test_simulation_reports_a_deadlock();
  test_radix_select();
  test_row_stats_match_the_cpu_policy();
  test_row_stats_ties_and_bad_logits();
  test_pick_is_the_inverse_cdf();
  return native_check::check_summary("test_cuda_sim");
}

// The CUDA launchers of the sampling ops (cuda/ops.cu: apply_policy_cuda, sample_cuda,
// verify_cuda, verify_tree_cuda), whole, run on the host in the simulation of cuda_sim/
// (their kernels at ops.cu's own grids and block sizes, the device branches of the shared
// math compiled, shared memory and workspaces garbage until written) and compared with
// the CPU launchers on the same inputs, seed and offset: apply_policy (per-row policies,
// both kernel variants, bf16 logits), sample, verify and verify_tree (one block a row and
// rows split over blocks), including rows at fault and the error record. What a GPU run
// adds is the real hardware: memory, the real CUB, timing; the kernels' logic is checked
// here.
//
// Everything must match exactly: probabilities bit for bit, every token, status and
// padding. Both backends sum fixed-point integers (sampling_math.h), which no block order
// changes, and compute each float the same way (no FMA contraction on either side).
#include "cuda_sim.h"  // first: __device__, threadIdx, __syncthreads, ...

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "../kernels/cuda/split_kernels.cuh"
#include "cuda_runtime.h"  // the simulation's: its devices' SM counts
#include "native_check.h"
#include "verify_case.h"

using namespace verispec;
using namespace verispec::kernels;
using namespace verispec::kernels::cuda;
using namespace verify_case;

namespace {

// Logits in their storage types (truncating; the CPU and the simulation read the same bits).
float to_storage(float x, float) { return x; }
BFloat16 to_storage(float x, BFloat16) { return BFloat16{static_cast<uint16_t>(float_bits(x) >> 16)}; }
Float16 to_storage(float x, Float16) {
  const uint32_t f = float_bits(x);
  const auto sign = static_cast<uint16_t>((f >> 16) & 0x8000u);
  if ((f & 0x7fffffffu) > 0x7f800000u) return Float16{static_cast<uint16_t>(sign | 0x7e00u)};  // NaN
  const int exponent = static_cast<int>((f >> 23) & 0xffu) - 127 + 15;
  if (exponent <= 0) return Float16{sign};                                      // to zero
  if (exponent >= 31) return Float16{static_cast<uint16_t>(sign | 0x7c00u)};   // to Inf
  return Float16{static_cast<uint16_t>(sign | (exponent << 10) | ((f >> 13) & 0x3ffu))};
}

template <typename T>
std::vector<T> convert(const std::vector<float>& x) {
  std::vector<T> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = to_storage(x[i], T{});
  return out;
}

template <typename T>
LogitsDType dtype_of() {
  if (std::is_same<T, BFloat16>::value) return LogitsDType::kBFloat16;
  return std::is_same<T, Float16>::value ? LogitsDType::kFloat16 : LogitsDType::kFloat32;
}

bool same_fault(const OpStatus& a, const OpStatus& b) {
  return a.code == b.code && a.row == b.row && a.col == b.col;
}

// ---- launches: ops.cu's own launchers, in the simulation ----------------------------
// apply_policy_cuda & co. are the launchers of kernels/cuda/ops.cu compiled for the
// simulation (cuda_sim/sim_launchers.cpp): their checks, workspace (garbage until
// written, as on a GPU), kernel choice, grids and block sizes (512 threads a row, 256 a
// chunk of a split row, 32). The simulated device decides the split (cuda_runtime.h
// kDeviceSms): an H200's 132 SMs by default; kNoSplit reports none (every row one block).
constexpr int kH200 = 0;
constexpr int kNoSplit = 1;
int g_sim_device = kH200;

CudaLaunch sim_launch() {
  CudaLaunch launch;
  launch.device = g_sim_device;
  return launch;
}
// The SM count the launchers see (split_plan's third argument).
int sim_sms() { return cuda_sim::kDeviceSms[g_sim_device]; }

OpStatus sim_apply_policy(const ApplyPolicyArgs& a) { return apply_policy_cuda(a, sim_launch()); }
OpStatus sim_sample(const SampleArgs& a) { return sample_cuda(a, sim_launch()); }
OpStatus sim_verify(const VerifyArgs& a) { return verify_cuda(a, sim_launch()); }

// apply_policy's one-block kernel at a block size of its own (the launchers' is
// kLaunchBlock): tiles, sums and the filters' searches fall to other warps and threads,
// and must give the same bits.
template <typename T, int BLOCK>
OpStatus sim_apply_policy_block(const ApplyPolicyArgs& a) {
  unsigned long long record = kNoDeviceError;
  const bool filter = policy_may_filter(a.policy, a.vocab);
  cuda_sim::run_grid(static_cast<unsigned>(a.rows), BLOCK, [&] {
    if (filter) {
      apply_policy_kernel<T, BLOCK, true>(a, &record);
    } else {
      apply_policy_kernel<T, BLOCK, false>(a, &record);
    }
  });
  return decode_device_error(OpKind::kApplyPolicy, static_cast<uint64_t>(record));
}

// ---- apply_policy --------------------------------------------------------------------

// Rows whose probabilities are not bit for bit the CPU's. Returns how many.
int policy_rows_differ(const std::vector<float>& got, const std::vector<float>& want, int rows,
                       int V) {
  int differ = 0;
  for (int r = 0; r < rows; ++r) {
    bool bad = false;
    bad = std::memcmp(&got[static_cast<size_t>(r * V)], &want[static_cast<size_t>(r * V)],
                      static_cast<size_t>(V) * sizeof(float)) != 0;
    differ += bad;
  }
  return differ;
}

template <typename T>
void check_apply_policy(int V, uint32_t seed) {
  std::mt19937 rng(seed);
  constexpr int kRows = 8;
  const std::vector<float> x = random_logits(rng, static_cast<size_t>(kRows * V), 3.0f);
  const std::vector<T> xt = convert<T>(x);
  // Per-row: plain, cooled, greedy, top-k, top-1, top-p, min-p, everything at once.
  std::vector<float> temperature = {1.0f, 0.5f, 0.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.3f};
  std::vector<int32_t> top_k = {0, 0, 0, 10, 1, 0, 0, 50};
  std::vector<float> top_p = {1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 0.8f, 1.0f, 0.9f};
  std::vector<float> min_p = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.1f, 0.02f};
  ApplyPolicyArgs a;
  a.logits = xt.data();
  a.logits_dtype = dtype_of<T>();
  a.logits_row_stride = V;
  a.rows = kRows;
  a.vocab = V;
  a.policy.temperature_per_row = temperature.data();
  a.policy.top_k_per_row = top_k.data();
  a.policy.top_p_per_row = top_p.data();
  a.policy.min_p_per_row = min_p.data();
  a.probs_row_stride = V;
  std::vector<float> got(static_cast<size_t>(kRows * V), -1.0f), want(got.size(), -1.0f);
  a.probs = got.data();
  const OpStatus sim = sim_apply_policy(a);
  a.probs = want.data();
  const OpStatus cpu = apply_policy_cpu(a);
  CHECK(sim.ok() && cpu.ok());
  CHECK(policy_rows_differ(got, want, kRows, V) == 0);

  // Scalars without a filter: the kernel compiled without the filter code.
  ApplyPolicyArgs plain = a;
  plain.policy = PolicyParams();
  plain.policy.temperature = 0.8f;
  plain.probs = got.data();
  CHECK(sim_apply_policy(plain).ok());
  plain.probs = want.data();
  CHECK(apply_policy_cpu(plain).ok());
  CHECK(policy_rows_differ(got, want, kRows, V) == 0);

  // Faults: an out-of-range top_p in row 2, NaN in row 5. The lowest row is reported,
  // rows at fault are 0, the others are unaffected.
  std::vector<float> bad_x = x;
  bad_x[static_cast<size_t>(5 * V + V / 2)] = std::nanf("");
  const std::vector<T> bad_xt = convert<T>(bad_x);
  top_p[2] = 1.5f;
  a.logits = bad_xt.data();
  std::fill(got.begin(), got.end(), -1.0f);
  std::fill(want.begin(), want.end(), -1.0f);
  a.probs = got.data();
  const OpStatus sim_bad = sim_apply_policy(a);
  a.probs = want.data();
  const OpStatus cpu_bad = apply_policy_cpu(a);
  CHECK(sim_bad.code == StatusCode::kInvalidPolicy && sim_bad.row == 2 &&
        sim_bad.col == static_cast<int64_t>(PolicyField::kTopP));
  CHECK(same_fault(sim_bad, cpu_bad));
  for (int r : {2, 5}) {
    for (int i = 0; i < V; ++i) CHECK(got[static_cast<size_t>(r * V + i)] == 0.0f);
  }
  int differ = policy_rows_differ(got, want, kRows, V);
  CHECK(differ == 0);
  // The NaN alone: its row and column.
  top_p[2] = 1.0f;
  a.probs = got.data();
  const OpStatus sim_nan = sim_apply_policy(a);
  CHECK(sim_nan.code == StatusCode::kNanOrInfLogits && sim_nan.row == 5 && sim_nan.col == V / 2);
  a.probs = want.data();
  CHECK(same_fault(sim_nan, apply_policy_cpu(a)));
}

void test_apply_policy() {
  for (int V : {1, 70, 1000}) {
    check_apply_policy<float>(V, 100u + static_cast<uint32_t>(V));
    check_apply_policy<BFloat16>(V, 200u + static_cast<uint32_t>(V));
    check_apply_policy<Float16>(V, 300u + static_cast<uint32_t>(V));
  }
}

// ---- sample ----------------------------------------------------------------------------

void test_sample() {
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  int rows_total = 0, differ = 0;
  for (int V : {1, 7, 65, 300}) {
    constexpr int kRows = 40;
    std::vector<float> w(static_cast<size_t>(kRows * V));
    for (auto& v : w) v = unit(rng);
    for (int r = 0; r < kRows; r += 3) {  // leading zeros: empty chunks before the mass
      for (int i = 0; i < V - 1 - V / 4; ++i) w[static_cast<size_t>(r * V + i)] = 0.0f;
    }
    SampleArgs a;
    a.probs = w.data();
    a.probs_row_stride = V;
    a.rows = kRows;
    a.vocab = V;
    a.rng.seed = 17;
    a.rng.offset = static_cast<uint64_t>(V);
    std::vector<int32_t> got(kRows, -2), want(kRows, -2);
    a.tokens = got.data();
    CHECK(sim_sample(a).ok());
    a.tokens = want.data();
    CHECK(sample_cpu(a).ok());
    for (int r = 0; r < kRows; ++r) {
      CHECK(got[r] >= 0 && got[r] < V && w[static_cast<size_t>(r * V + got[r])] > 0.0f);
      differ += got[r] != want[r];
    }
    rows_total += kRows;

    if (V < 7) continue;
    // Faults: all zero in row 1, a negative value in row 3: the lowest row, -1 padding.
    std::vector<float> bad = w;
    for (int i = 0; i < V; ++i) bad[static_cast<size_t>(V + i)] = 0.0f;
    bad[static_cast<size_t>(3 * V + 4)] = -0.25f;
    a.probs = bad.data();
    a.tokens = got.data();
    const OpStatus sim_bad = sim_sample(a);
    a.tokens = want.data();
    const OpStatus cpu_bad = sample_cpu(a);
    CHECK(sim_bad.code == StatusCode::kInvalidProbs && sim_bad.row == 1 && sim_bad.col == -1);
    CHECK(same_fault(sim_bad, cpu_bad));
    CHECK(got[1] == -1 && got[3] == -1 && want[1] == -1 && want[3] == -1);
    for (int r : {0, 2, 4}) CHECK(got[r] >= 0);
  }
  CHECK(differ == 0);
}

// Keyed: the race compares the same float scores in any order with the same tie rule,
// so the kernel and the CPU pick the same token on every row; a row's token depends only
// on its weights, seed and position (moving it to another row changes nothing), and
// zero weights are never picked.
void test_sample_keyed() {
  std::mt19937 rng(9);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  for (int V : {1, 5, 66, 301}) {
    constexpr int kRows = 24;
    std::vector<float> w(static_cast<size_t>(kRows * V));
    for (auto& v : w) v = unit(rng);
    for (int r = 0; r < kRows; r += 4) {  // sparse rows: whole blocks of four at zero
      for (int i = 0; i < V - 1; ++i) w[static_cast<size_t>(r * V + i)] *= (i % 9 < 5) ? 0.0f : 1.0f;
    }
    std::vector<int64_t> seeds(kRows), positions(kRows);
    for (int r = 0; r < kRows; ++r) {
      seeds[static_cast<size_t>(r)] = static_cast<int64_t>(0x9E3779B97F4A7C15ull * (r % 5 + 1));
      positions[static_cast<size_t>(r)] = r < 12 ? r : (int64_t{1} << 40) + r;  // high word too
    }
    SampleArgs a;
    a.probs = w.data();
    a.probs_row_stride = V;
    a.rows = kRows;
    a.vocab = V;
    a.row_seeds = seeds.data();
    a.row_positions = positions.data();
    std::vector<int32_t> got(kRows, -2), want(kRows, -2), moved(kRows, -2);
    a.tokens = got.data();
    CHECK(sim_sample(a).ok());
    a.tokens = want.data();
    CHECK(sample_cpu(a).ok());
    CHECK(got == want);
    for (int r = 0; r < kRows; ++r) {
      CHECK(got[r] >= 0 && got[r] < V && w[static_cast<size_t>(r * V + got[r])] > 0.0f);
    }
    // The rows in reverse order: each row's token moves with it.
    std::vector<float> rw(w.size());
    std::vector<int64_t> rs(kRows), rp(kRows);
    for (int r = 0; r < kRows; ++r) {
      const int from = kRows - 1 - r;
      std::copy(w.begin() + from * V, w.begin() + (from + 1) * V, rw.begin() + r * V);
      rs[static_cast<size_t>(r)] = seeds[static_cast<size_t>(from)];
      rp[static_cast<size_t>(r)] = positions[static_cast<size_t>(from)];
    }
    a.probs = rw.data();
    a.row_seeds = rs.data();
    a.row_positions = rp.data();
    a.tokens = moved.data();
    CHECK(sim_sample(a).ok());
    for (int r = 0; r < kRows; ++r) CHECK(moved[r] == want[kRows - 1 - r]);
    // A zero-mass row is a fault (-1), as unkeyed.
    std::fill(rw.begin(), rw.begin() + V, 0.0f);
    const OpStatus bad = sim_sample(a);
    CHECK(bad.code == StatusCode::kInvalidProbs && bad.row == 0 && bad.col == -1 && moved[0] == -1);
  }
}

// ---- verify ----------------------------------------------------------------------------

// Target logits, and drafts drawn from q = softmax(target + noise) (so that some
// proposals pass and some fail); ragged num_draft.
VerifyCase perturbed_case(int64_t vocab, uint32_t seed, float noise) {
  std::mt19937 rng(seed);
  VerifyCase c;
  c.batch = 8;
  c.k = 3;
  c.vocab = vocab;
  c.logits = random_logits(rng, static_cast<size_t>(c.batch * (c.k + 1) * vocab), 2.0f);
  c.draft_probs.resize(static_cast<size_t>(c.batch * c.k * vocab));
  c.drafts.resize(static_cast<size_t>(c.batch * c.k));
  std::normal_distribution<float> normal(0.0f, noise);
  for (int64_t b = 0; b < c.batch; ++b) {
    for (int64_t j = 0; j < c.k; ++j) {
      float* q = &c.draft_probs[static_cast<size_t>((b * c.k + j) * vocab)];
      const float* t = &c.logits[static_cast<size_t>((b * (c.k + 1) + j) * vocab)];
      double total = 0.0;
      for (int64_t i = 0; i < vocab; ++i) total += q[i] = std::exp(t[i] + normal(rng));
      for (int64_t i = 0; i < vocab; ++i) q[i] = static_cast<float>(q[i] / total);
      std::discrete_distribution<int> draw(q, q + vocab);
      c.drafts[static_cast<size_t>(b * c.k + j)] = draw(rng);
    }
  }
  c.num_draft = {3, 0, 2, 3, 1, 3, 3, 2};
  return c;
}

struct Tally {
  int rows = 0, differ = 0, rejected = 0, bonus = 0, accepted = 0;  // accepted: 1+ drafts
};

// The simulated kernels and the CPU on case c: both OK, every row well formed and
// identical to the CPU's.
void compare_verify(const VerifyCase& c, Tally* tally) {
  const VerifyOut sim = c.run_with(sim_verify), cpu = c.run();
  CHECK(sim.status.ok() && cpu.status.ok());
  for (int64_t b = 0; b < c.batch; ++b) {
    c.check_row(sim, b);
    const bool same = sim.row_equal(cpu, b, c.k);
    const bool greedy = c.policy.temperature_per_row
                            ? c.policy.temperature_per_row[b] == 0.0f
                            : c.policy.temperature == 0.0f;
    (void)greedy;
    CHECK(same);
    tally->differ += !same;
    ++tally->rows;
    tally->rejected += sim.accepted[static_cast<size_t>(b)] < c.n(b);
    tally->bonus += sim.accepted[static_cast<size_t>(b)] == c.n(b);
    tally->accepted += sim.accepted[static_cast<size_t>(b)] > 0;
  }
}

PolicyParams scalar_policy(float temperature, int32_t top_k, float top_p, float min_p) {
  PolicyParams p;
  p.temperature = temperature, p.top_k = top_k, p.top_p = top_p, p.min_p = min_p;
  return p;
}

void test_verify_matches_the_cpu() {
  Tally tally;
  const float row_temperature[] = {1.0f, 0.0f, 0.7f, 1.0f, 0.0f, 1.5f, 1.0f, 0.9f};
  const int32_t row_top_k[] = {0, 0, 5, 0, 0, 0, 2, 0};
  const float row_top_p[] = {1.0f, 1.0f, 1.0f, 0.8f, 1.0f, 0.95f, 1.0f, 1.0f};
  const float row_min_p[] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.05f, 0.0f, 0.2f};
  PolicyParams per_row;
  per_row.temperature_per_row = row_temperature;
  per_row.top_k_per_row = row_top_k;
  per_row.top_p_per_row = row_top_p;
  per_row.min_p_per_row = row_min_p;
  const PolicyParams policies[] = {
      scalar_policy(1.0f, 0, 1.0f, 0.0f),   scalar_policy(0.6f, 0, 1.0f, 0.0f),
      scalar_policy(1.0f, 8, 1.0f, 0.0f),   scalar_policy(1.0f, 0, 0.85f, 0.0f),
      scalar_policy(1.2f, 20, 0.9f, 0.05f), per_row,
  };
  for (int64_t V : {40, 130}) {
    VerifyCase c = perturbed_case(V, 31u + static_cast<uint32_t>(V), 1.0f);
    const std::vector<float> q = c.draft_probs;
    for (uint64_t seed = 1; seed <= 2; ++seed) {
      c.seed = seed;
      c.offset = seed * 3;
      for (const PolicyParams& pol : policies) {
        c.policy = pol;
        c.draft_probs = q;
        compare_verify(c, &tally);
        c.draft_probs.clear();  // one-hot proposals
        compare_verify(c, &tally);
      }
      c.draft_probs = q;
      c.policy = scalar_policy(0.0f, 0, 1.0f, 0.0f);  // greedy
      compare_verify(c, &tally);
      c.logits_bf16 = convert<BFloat16>(c.logits);
      c.policy = policies[4];
      compare_verify(c, &tally);
      c.policy.temperature = 0.0f;  // greedy, with filters (which never drop the argmax)
      c.draft_probs.clear();
      compare_verify(c, &tally);
      c.logits_bf16.clear();
    }
  }
  std::printf("verify: %d rows, %d differ from the CPU, %d rejected, %d bonus\n", tally.rows,
              tally.differ, tally.rejected, tally.bonus);
  CHECK(tally.rejected * 5 >= tally.rows && tally.bonus * 5 >= tally.rows);  // both paths ran
  CHECK(tally.differ == 0);
}

void test_verify_faults() {
  const int64_t V = 40;
  // Faults: row 1 num_draft 5 > K; row 3 a proposal out of range; row 4 NaN at position
  // 1 <= n; row 6 a NaN draft probability at its first proposal. Row 0 has +Inf in the
  // padding (position 3 > n = 2): not read, no fault.
  VerifyCase c = perturbed_case(V, 77, 1.0f);
  c.seed = 4;
  c.num_draft = {2, 5, 2, 3, 1, 3, 3, 2};
  c.drafts[3 * 3 + 2] = V + 3;
  c.logits[static_cast<size_t>((4 * 4 + 1) * V + 9)] = std::nanf("");
  c.logits[static_cast<size_t>((0 * 4 + 3) * V + 1)] = INFINITY;
  c.draft_probs[static_cast<size_t>((6 * 3 + 0) * V + c.drafts[6 * 3])] = std::nanf("");
  const bool fault[] = {false, true, false, true, true, false, true, false};
  const std::vector<float> q = c.draft_probs;
  for (bool with_q : {true, false}) {
    c.draft_probs = with_q ? q : std::vector<float>();
    const VerifyOut sim = c.run_with(sim_verify), cpu = c.run();
    CHECK(sim.status.code == StatusCode::kNumDraftOutOfRange && sim.status.row == 1);
    CHECK(same_fault(sim.status, cpu.status));
    int differ = 0;
    for (int64_t b = 0; b < c.batch; ++b) {
      const bool at_fault = fault[b] && (b != 6 || with_q);
      c.check_row(sim, b, at_fault);
      c.check_row(cpu, b, at_fault);
      differ += !sim.row_equal(cpu, b, c.k);
    }
    CHECK(differ == 0);
    // One fault at a time: each reports its own code and column, as on the CPU.
    VerifyCase one = perturbed_case(V, 77, 1.0f);
    one.draft_probs = c.draft_probs.empty() ? std::vector<float>() : one.draft_probs;
    one.drafts[3 * 3 + 2] = V + 3;
    const VerifyOut s1 = one.run_with(sim_verify), c1 = one.run();
    CHECK(s1.status.code == StatusCode::kTokenOutOfRange && s1.status.row == 3 && s1.status.col == 2);
    CHECK(same_fault(s1.status, c1.status));
    one.drafts[3 * 3 + 2] = 0;
    one.num_draft[4] = 1;
    one.logits[static_cast<size_t>((4 * 4 + 1) * V + 9)] = std::nanf("");
    const VerifyOut s2 = one.run_with(sim_verify), c2 = one.run();
    CHECK(s2.status.code == StatusCode::kNanOrInfLogits && s2.status.row == 4 && s2.status.col == 1);
    CHECK(same_fault(s2.status, c2.status));
  }
}

// Seed and offset read through pointers (how a CUDA graph replays with new values) draw
// the coins of the scalars; K = 0 (no draft tokens at all) emits one token from p.
void test_verify_seed_pointers_and_no_drafts() {
  VerifyCase c = perturbed_case(60, 91, 1.0f);
  c.policy = scalar_policy(0.9f, 12, 1.0f, 0.0f);
  c.seed = 8;
  c.offset = 21;
  const VerifyOut by_value = c.run_with(sim_verify), cpu = c.run();
  const int64_t seed = 8, offset = 21;
  const VerifyOut by_pointer = c.run_with([&](VerifyArgs a) {
    a.rng = RandomParams();
    a.rng.seed_ptr = &seed;
    a.rng.offset_ptr = &offset;
    return sim_verify(a);
  });
  CHECK(by_value.status.ok() && by_pointer.status.ok() && cpu.status.ok());
  int differ = 0;
  for (int64_t b = 0; b < c.batch; ++b) {
    CHECK(by_value.row_equal(by_pointer, b, c.k));
    differ += !by_pointer.row_equal(cpu, b, c.k);
  }
  CHECK(differ == 0);

  VerifyCase k0;
  k0.batch = 8;
  k0.k = 0;
  k0.vocab = 60;
  k0.logits = c.logits;  // the first 8 * 60 logits: [8, 1, 60]
  k0.logits.resize(8 * 60);
  k0.seed = 3;
  const VerifyOut s0 = k0.run_with(sim_verify), c0 = k0.run();
  CHECK(s0.status.ok() && c0.status.ok());
  differ = 0;
  for (int64_t b = 0; b < k0.batch; ++b) {
    k0.check_row(s0, b);
    differ += !s0.row_equal(c0, b, 0);
  }
  CHECK(differ == 0);
}

// Block verification: the simulated kernels against the CPU on sampled drafts, every
// policy of test_verify_matches_the_cpu.
void test_block_verify_matches_the_cpu() {
  Tally tally;
  const PolicyParams policies[] = {
      scalar_policy(1.0f, 0, 1.0f, 0.0f), scalar_policy(0.6f, 0, 1.0f, 0.0f),
      scalar_policy(1.2f, 20, 0.9f, 0.05f), scalar_policy(0.0f, 0, 1.0f, 0.0f)};
  for (int64_t V : {40, 130}) {
    for (float noise : {0.3f, 1.0f}) {
      VerifyCase c = perturbed_case(V, 7u + static_cast<uint32_t>(V), noise);
      c.method = VerifyMethod::kBlock;
      for (uint64_t seed = 1; seed <= 2; ++seed) {
        c.seed = seed;
        c.offset = seed * 5;
        for (const PolicyParams& pol : policies) {
          c.policy = pol;
          compare_verify(c, &tally);
        }
      }
    }
  }
  std::printf("block verify: %d rows, %d differ from the CPU, %d rejected, %d bonus\n",
              tally.rows, tally.differ, tally.rejected, tally.bonus);
  CHECK(tally.rejected * 10 >= tally.rows && tally.bonus * 10 >= tally.rows);
  CHECK(tally.differ == 0);
  // A bad q row read by the block walk is reported alike.
  VerifyCase c = perturbed_case(40, 3u, 0.5f);
  c.method = VerifyMethod::kBlock;
  c.draft_probs[static_cast<size_t>((2 * c.k + 1) * c.vocab + 5)] = -1.0f;  // row 2, j = 1
  const VerifyOut sim = c.run_with(sim_verify), cpu = c.run();
  CHECK(!cpu.status.ok() && same_fault(sim.status, cpu.status));
  CHECK(cpu.status.code == StatusCode::kInvalidProbs && cpu.status.row == 2 && cpu.status.col == 1);
}

// ---- verify_tree ------------------------------------------------------------------------

// A tree case: SHAPE-like trees per row, q rows from the logits plus noise.
struct TreeCase {
  int64_t batch = 8, n = 6, vocab = 40;
  std::vector<float> logits, q;  // [batch, n + 1, vocab] ([.., W] with draft_index)
  std::vector<int32_t> tokens, parents, num_nodes;
  std::vector<int32_t> draft_index;  // [vocab] or empty: ops.h "Compact q"
  int64_t draft_width = 0;
  bool sampled = true, replacement = true;
  PolicyParams policy;
  uint64_t seed = 1, offset = 0;

  struct Out {
    OpStatus status;
    std::vector<int32_t> tokens, emitted, nodes;
  };

  VerifyTreeArgs args(Out* o) const {
    o->tokens.assign(static_cast<size_t>(batch * (n + 1)), 12345);
    o->emitted.assign(static_cast<size_t>(batch), 12345);
    o->nodes.assign(static_cast<size_t>(batch * n), 12345);
    VerifyTreeArgs a;
    a.target_logits = logits.data();
    a.target_logits_stride_b = (n + 1) * vocab;
    a.target_logits_stride_n = vocab;
    a.batch = batch;
    a.max_nodes = n;
    a.vocab = vocab;
    a.tree_tokens = tokens.data();
    a.tree_tokens_stride_b = n;
    a.parents = parents.data();
    a.parents_stride_b = n;
    if (sampled) {
      const int64_t w = draft_index.empty() ? vocab : draft_width;
      a.draft_probs = q.data();
      a.draft_probs_stride_b = (n + 1) * w;
      a.draft_probs_stride_n = w;
      a.draft_index = draft_index.empty() ? nullptr : draft_index.data();
      a.draft_width = draft_index.empty() ? 0 : draft_width;
    }
    a.num_nodes = num_nodes.empty() ? nullptr : num_nodes.data();
    a.replacement = replacement;
    a.policy = policy;
    a.rng.seed = seed;
    a.rng.offset = offset;
    a.tokens = o->tokens.data();
    a.tokens_stride_b = n + 1;
    a.num_emitted = o->emitted.data();
    a.accepted_nodes = o->nodes.data();
    a.accepted_nodes_stride_b = n;
    return a;
  }
  Out cpu() const {
    Out o;
    o.status = verify_tree_cpu(args(&o));
    return o;
  }
  Out sim() const {
    Out o;
    const VerifyTreeArgs a = args(&o);
    o.status = verify_tree_cuda(a, sim_launch());
    return o;
  }
  bool row_equal(const Out& x, const Out& y, int64_t b) const {
    for (int64_t j = 0; j <= n; ++j) {
      if (x.tokens[static_cast<size_t>(b * (n + 1) + j)] != y.tokens[static_cast<size_t>(b * (n + 1) + j)]) return false;
    }
    for (int64_t j = 0; j < n; ++j) {
      if (x.nodes[static_cast<size_t>(b * n + j)] != y.nodes[static_cast<size_t>(b * n + j)]) return false;
    }
    return x.emitted[static_cast<size_t>(b)] == y.emitted[static_cast<size_t>(b)];
  }
};

// Two children at the root, two under each; tokens: the top two of q (distinct), or
// draws from q (i.i.d.), or two distinct draws (without replacement).
TreeCase tree_case(int64_t vocab, uint32_t seed, bool sampled, bool replacement) {
  std::mt19937 rng(seed);
  TreeCase c;
  c.vocab = vocab;
  c.sampled = sampled;
  c.replacement = replacement;
  const size_t rows = static_cast<size_t>(c.batch * (c.n + 1));
  c.logits = random_logits(rng, rows * static_cast<size_t>(vocab), 2.0f);
  c.q.resize(rows * static_cast<size_t>(vocab));
  std::normal_distribution<float> normal(0.0f, 0.6f);
  for (size_t r = 0; r < rows; ++r) {
    double total = 0.0;
    float* q = &c.q[r * static_cast<size_t>(vocab)];
    const float* t = &c.logits[r * static_cast<size_t>(vocab)];
    for (int64_t i = 0; i < vocab; ++i) total += q[i] = std::exp(t[i] + normal(rng));
    for (int64_t i = 0; i < vocab; ++i) q[i] = static_cast<float>(q[i] / total);
  }
  const int32_t shape[] = {-1, -1, 0, 0, 1, 1};
  for (int64_t b = 0; b < c.batch; ++b) {
    for (int64_t i = 0; i < c.n; i += 2) {
      const float* q = &c.q[static_cast<size_t>((b * (c.n + 1) + shape[i] + 1) * vocab)];
      std::discrete_distribution<int> draw(q, q + vocab);
      int x = draw(rng), y = draw(rng);
      while (!replacement && y == x) y = draw(rng);
      if (!sampled) {  // the top two of q
        x = static_cast<int>(std::max_element(q, q + vocab) - q);
        y = x == 0 ? 1 : 0;
        for (int64_t t = 0; t < vocab; ++t) {
          if (t != x && q[t] > q[y]) y = static_cast<int>(t);
        }
      }
      c.tokens.push_back(x);
      c.tokens.push_back(y);
      c.parents.push_back(shape[i]);
      c.parents.push_back(shape[i + 1]);
    }
  }
  c.num_nodes = {6, 0, 3, 6, 1, 6, 5, 6};
  return c;
}

void test_verify_tree_matches_the_cpu() {
  int rows = 0, differ = 0, deep = 0;
  const PolicyParams policies[] = {
      scalar_policy(1.0f, 0, 1.0f, 0.0f), scalar_policy(0.7f, 8, 1.0f, 0.0f),
      scalar_policy(1.2f, 20, 0.9f, 0.05f), scalar_policy(0.0f, 0, 1.0f, 0.0f)};
  for (int mode = 0; mode < 3; ++mode) {
    for (int64_t V : {40, 130, 12289}) {  // 12289: node rows split over 4 blocks
      TreeCase c = tree_case(V, 100u + static_cast<uint32_t>(V + mode), mode > 0, mode != 2);
      for (uint64_t seed = 1; seed <= 2; ++seed) {
        c.seed = seed;
        c.offset = seed + 11;
        for (const PolicyParams& pol : policies) {
          c.policy = pol;
          const TreeCase::Out sim = c.sim(), cpu = c.cpu();
          CHECK(sim.status.ok() && cpu.status.ok());
          for (int64_t b = 0; b < c.batch; ++b) {
            const bool same = c.row_equal(sim, cpu, b);
            CHECK(same);
            differ += !same;
            deep += cpu.emitted[static_cast<size_t>(b)] > 1;
            ++rows;
          }
        }
      }
    }
  }
  std::printf("verify_tree: %d rows, %d differ from the CPU, %d accepted a node\n", rows, differ,
              deep);
  CHECK(deep * 4 >= rows);
  CHECK(differ == 0);
}

void test_verify_tree_faults() {
  struct Fault {
    int64_t index;  // into tokens / parents / logits
    int what;       // 0: parent, 1: token, 2: duplicate sibling, 3: NaN logit
  };
  for (const Fault f : {Fault{2 * 6 + 2, 0}, Fault{3 * 6 + 4, 1}, Fault{5 * 6 + 1, 2},
                        Fault{(6 * 7 + 3) * 40 + 9, 3}}) {
    TreeCase c = tree_case(40, 5u, true, false);
    switch (f.what) {
      case 0: c.parents[static_cast<size_t>(f.index)] = 4; break;
      case 1: c.tokens[static_cast<size_t>(f.index)] = 40; break;
      case 2: c.tokens[static_cast<size_t>(f.index)] = c.tokens[static_cast<size_t>(f.index - 1)]; break;
      default: c.logits[static_cast<size_t>(f.index)] = NAN; break;
    }
    const TreeCase::Out sim = c.sim(), cpu = c.cpu();
    CHECK(!cpu.status.ok() && same_fault(sim.status, cpu.status));
    const int64_t row = cpu.status.row;
    CHECK(sim.emitted[static_cast<size_t>(row)] == 0 && cpu.emitted[static_cast<size_t>(row)] == 0);
    for (int64_t b = 0; b < c.batch; ++b) CHECK(c.row_equal(sim, cpu, b) || b != row);
  }
}

// The launchers at a 128k vocabulary, with filters, on both of their paths: split over
// 32 blocks of 256 threads a row (an H200's SMs to fill), and one block of 512 threads a
// row (no SM count: the path of many rows), whose shapes are a real launch's (251 values
// a thread, a 16-warp sum_each and scan).
void test_launchers_at_a_large_vocabulary() {
  const int64_t V = 128256;
  VerifyCase c = perturbed_case(V, 5, 0.5f);
  c.batch = 2;  // the first two rows of the case
  c.num_draft = {2, 3};
  const float temperature[] = {1.0f, 0.7f};
  const int32_t top_k[] = {50, 0};
  const float top_p[] = {0.9f, 1.0f};
  const float min_p[] = {0.0f, 0.05f};
  c.policy.temperature_per_row = temperature;
  c.policy.top_k_per_row = top_k;
  c.policy.top_p_per_row = top_p;
  c.policy.min_p_per_row = min_p;
  for (int device : {kH200, kNoSplit}) {
    g_sim_device = device;
    CHECK(split_plan(c.batch * (c.k + 1), V, sim_sms()).chunks == (device == kH200 ? 32 : 1));
    for (uint64_t seed : {1, 2}) {
      if (device == kNoSplit && seed == 2) continue;  // one seed: every row one block
      c.seed = seed;
      const VerifyOut sim = c.run_with(sim_verify), cpu = c.run();
      CHECK(sim.status.ok() && cpu.status.ok());
      for (int64_t b = 0; b < c.batch; ++b) {
        c.check_row(sim, b);
        CHECK(sim.row_equal(cpu, b, c.k));
      }
    }
    // apply_policy on the same rows (positions 0 of both rows).
    ApplyPolicyArgs a;
    a.logits = c.logits.data();
    a.logits_row_stride = (c.k + 1) * V;
    a.rows = 2;
    a.vocab = V;
    a.policy = c.policy;
    a.probs_row_stride = V;
    std::vector<float> got(static_cast<size_t>(2 * V), -1.0f), want(got.size());
    a.probs = got.data();
    CHECK(sim_apply_policy(a).ok());
    a.probs = want.data();
    CHECK(apply_policy_cpu(a).ok());
    CHECK(policy_rows_differ(got, want, 2, static_cast<int>(V)) == 0);
    int kept = 0;
    for (int64_t i = 0; i < V; ++i) kept += got[static_cast<size_t>(i)] > 0.0f;
    CHECK(kept >= 1 && kept <= 50);  // top-k 50, then top-p 0.9
  }
  g_sim_device = kH200;
}

// apply_policy's arguments over rows of V logits, float32 (x) or bf16 (xb).
ApplyPolicyArgs rows_args(const std::vector<float>& x, const std::vector<BFloat16>& xb, bool bf16,
                          int rows, int V) {
  ApplyPolicyArgs a;
  a.logits = bf16 ? static_cast<const void*>(xb.data()) : static_cast<const void*>(x.data());
  a.logits_dtype = bf16 ? LogitsDType::kBFloat16 : LogitsDType::kFloat32;
  a.logits_row_stride = V;
  a.rows = rows;
  a.vocab = V;
  a.probs_row_stride = V;
  return a;
}

// ---- the normaliser in tiles -------------------------------------------------------------

// Rows whose tiles differ in kind: a tile of masked logits only, the maximum in the last
// (partial) tile, a tile whose maximum is far below the row's (its weights all round to
// 0 at the row's maximum, not at its own), ties of the maximum across tiles. apply_policy
// through the one-block kernel (several block sizes, so tiles fall to different warps) and
// the split kernels: the CPU's bits.
void test_tiles_match_the_cpu() {
  const int V = 9 * kStatsTile + 77;  // 3 chunks where the split is on
  std::mt19937 rng(1234);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  constexpr int kRows = 4;
  std::vector<float> x(static_cast<size_t>(kRows * V));
  for (auto& v : x) v = normal(rng);
  float* r0 = x.data();
  std::fill(r0 + kStatsTile, r0 + 2 * kStatsTile, -INFINITY);
  r0[V - 1] = 25.0f;
  float* r1 = x.data() + V;
  for (int i = 2 * kStatsTile; i < 3 * kStatsTile; ++i) r1[i] -= 120.0f;
  float* r2 = x.data() + 2 * V;
  r2[3] = r2[kStatsTile + 5] = r2[V - 2] = 11.0f;  // tied maxima in three tiles
  float* r3 = x.data() + 3 * V;
  std::fill(r3, r3 + V, -INFINITY);
  r3[7 * kStatsTile + 1] = -3.0f;  // one finite logit
  const std::vector<BFloat16> xb = convert<BFloat16>(x);
  for (float temperature : {1.0f, 0.6f}) {
    for (bool bf16 : {false, true}) {
      ApplyPolicyArgs a = rows_args(x, xb, bf16, kRows, V);
      a.policy.temperature = temperature;
      std::vector<float> want(x.size()), got(x.size());
      a.probs = want.data();
      CHECK(apply_policy_cpu(a).ok());
      a.probs = got.data();
      CHECK((bf16 ? sim_apply_policy_block<BFloat16, 32>(a) : sim_apply_policy_block<float, 32>(a)).ok());
      CHECK(policy_rows_differ(got, want, kRows, V) == 0);
      CHECK((bf16 ? sim_apply_policy_block<BFloat16, 96>(a) : sim_apply_policy_block<float, 96>(a)).ok());
      CHECK(policy_rows_differ(got, want, kRows, V) == 0);
      for (int device : {kNoSplit, kH200}) {  // the launcher: 512 threads a row, or split
        g_sim_device = device;
        std::fill(got.begin(), got.end(), -1.0f);
        CHECK(sim_apply_policy(a).ok());
        CHECK(policy_rows_differ(got, want, kRows, V) == 0);
      }
      g_sim_device = kH200;
      // Row 3: all of its mass on the one finite logit; row 0: the maximum's probability
      // is 1 / Z (its weight is exactly 1).
      CHECK(want[static_cast<size_t>(3 * V + 7 * kStatsTile + 1)] == 1.0f);
      const float p_max = want[static_cast<size_t>(V - 1)];
      CHECK(p_max > 0.99f && p_max <= 1.0f);
    }
  }
}

// ---- the filters' radix selection (block_ops.cuh filter_threshold) ---------------------

// Rows built to meet the selection's edges, each under several filters, one-block kernels
// of 32, 64 and 512 threads against the CPU's bits: values tied at the threshold (few
// distinct logits), a threshold whose bits differ from its neighbours' only in the last
// digit (logits one ulp apart), thresholds at 0 (the k-th largest probability underflows),
// top-k = V - 1, top-p tiny and near 1, min-p over either, and a vocabulary smaller than
// one histogram.
void test_filters_match_the_cpu() {
  struct Row {
    const char* name;
    std::vector<float> x;
  };
  std::mt19937 rng(99);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<Row> rows;
  const int V = 3000;
  {
    Row r{"few levels", std::vector<float>(V)};
    for (auto& v : r.x) v = static_cast<float>(static_cast<int>(rng() % 6));
    rows.push_back(r);
  }
  {
    Row r{"ulp apart", std::vector<float>(V)};
    float v = 2.0f;
    for (auto& e : r.x) {
      e = v;
      v = std::nextafter(v, 0.0f);
    }
    std::shuffle(r.x.begin(), r.x.end(), rng);
    rows.push_back(r);
  }
  {
    Row r{"underflow", std::vector<float>(V)};
    for (auto& e : r.x) e = 40.0f * normal(rng);
    rows.push_back(r);
  }
  {
    Row r{"normal", std::vector<float>(V)};
    for (auto& e : r.x) e = normal(rng);
    rows.push_back(r);
  }
  {
    Row r{"small vocabulary", std::vector<float>(37)};
    for (auto& e : r.x) e = normal(rng);
    r.x[5] = r.x[9] = r.x[20];  // a tie
    rows.push_back(r);
  }
  struct Filter {
    int top_k;
    float top_p, min_p;
  };
  const Filter filters[] = {{1, 1.0f, 0.0f},     {7, 1.0f, 0.0f},     {500, 1.0f, 0.0f},
                            {0, 0.5f, 0.0f},     {0, 1e-6f, 0.0f},    {0, 0.999f, 0.0f},
                            {50, 0.9f, 0.0f},    {2999, 0.3f, 0.0f},  {36, 1.0f, 0.0f},
                            {10, 0.9f, 0.05f},   {0, 0.95f, 0.5f},    {0, 1.0f, 0.01f}};
  int cases = 0, differ = 0, kept_ties = 0;
  for (const Row& row : rows) {
    const int n = static_cast<int>(row.x.size());
    for (const Filter& f : filters) {
      if (f.top_k >= n) continue;
      for (float temperature : {1.0f, 0.4f}) {
        ApplyPolicyArgs a;
        a.logits = row.x.data();
        a.logits_row_stride = n;
        a.rows = 1;
        a.vocab = n;
        a.policy.temperature = temperature;
        a.policy.top_k = f.top_k;
        a.policy.top_p = f.top_p;
        a.policy.min_p = f.min_p;
        a.probs_row_stride = n;
        std::vector<float> want(static_cast<size_t>(n)), got(static_cast<size_t>(n));
        a.probs = want.data();
        CHECK(apply_policy_cpu(a).ok());
        a.probs = got.data();
        CHECK((sim_apply_policy_block<float, 32>(a).ok()));
        differ += policy_rows_differ(got, want, 1, n);
        CHECK((sim_apply_policy_block<float, 64>(a).ok()));
        differ += policy_rows_differ(got, want, 1, n);
        CHECK(sim_apply_policy(a).ok());
        differ += policy_rows_differ(got, want, 1, n);
        ++cases;
        // Ties are kept together: equal logits get equal probabilities, kept or not; count
        // the cases whose smallest kept logit has copies.
        std::vector<int> order(static_cast<size_t>(n));
        std::iota(order.begin(), order.end(), 0);
        std::sort(order.begin(), order.end(), [&row](int i, int j) {
          return row.x[static_cast<size_t>(i)] < row.x[static_cast<size_t>(j)];
        });
        float smallest_kept = INFINITY;
        for (size_t i = 1; i < order.size(); ++i) {
          const auto a_i = static_cast<size_t>(order[i - 1]), b_i = static_cast<size_t>(order[i]);
          if (row.x[a_i] == row.x[b_i]) CHECK(want[a_i] == want[b_i]);
        }
        for (int i = 0; i < n; ++i) {
          if (want[static_cast<size_t>(i)] > 0.0f) smallest_kept = std::min(smallest_kept, row.x[static_cast<size_t>(i)]);
        }
        kept_ties += std::count(row.x.begin(), row.x.end(), smallest_kept) > 1;
      }
    }
  }
  std::printf("filters: %d cases, %d differ from the CPU, %d with ties at the threshold\n", cases,
              differ, kept_ties);
  CHECK(differ == 0);
  CHECK(kept_ties >= 10);  // the tied rows did tie at their thresholds
}

// ---- memory traffic and parallelism, the stand-ins for speed -------------------------

struct Traffic {
  double logit_passes;  // the most bytes read of one logits row / its size
  double q_passes;      // the same for q (verify with sampled drafts)
  double write_passes;  // probabilities written (apply_policy)
  size_t blocks;        // the most blocks of one launch that touched one logits row
};

// One op through its launcher (ops.cu, on the simulated H200: rows split) on B = 1 row
// (verify: K = 4 positions, drafts from q, a rejection at position 0) of a Llama-3
// vocabulary, counted by the simulation (cuda_sim.h Traffic).
Traffic measure(const std::string& op, const PolicyParams& policy) {
  const int64_t V = 128256;
  std::mt19937 rng(42);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  cuda_sim::traffic.clear();
  Traffic t{0.0, 0.0, 0.0, 0};
  if (op == "apply_policy" || op == "sample") {
    std::vector<float> logits(static_cast<size_t>(V)), probs(static_cast<size_t>(V));
    for (auto& x : logits) x = normal(rng);
    ApplyPolicyArgs a;
    a.logits = logits.data();
    a.logits_row_stride = V;
    a.rows = 1;
    a.vocab = V;
    a.policy = policy;
    a.probs = probs.data();
    a.probs_row_stride = V;
    if (op == "apply_policy") {
      cuda_sim::traffic.watch("logits", logits.data(), 1, V * sizeof(float));
      cuda_sim::traffic.watch("probs", probs.data(), 1, V * sizeof(float));
      CHECK(sim_apply_policy(a).ok());
      t.logit_passes = cuda_sim::traffic.max_read_passes("logits");
      t.write_passes = cuda_sim::traffic.max_write_passes("probs");
      t.blocks = cuda_sim::traffic.max_blocks_per_row("logits");
      return t;
    }
    CHECK(apply_policy_cpu(a).ok());
    SampleArgs s;
    s.probs = probs.data();
    s.probs_row_stride = V;
    s.rows = 1;
    s.vocab = V;
    int32_t token = -1;
    s.tokens = &token;
    cuda_sim::traffic.watch("probs", probs.data(), 1, V * sizeof(float));
    CHECK(sim_sample(s).ok() && token >= 0);
    t.logit_passes = cuda_sim::traffic.max_read_passes("probs");
    t.blocks = cuda_sim::traffic.max_blocks_per_row("probs");
    return t;
  }
  if (op == "verify_tree") {  // one row, the 6-node tree of tree_case, drafts from q
    TreeCase c = tree_case(V, 3u, true, true);
    c.batch = 1;
    c.num_nodes = {6};
    c.policy = policy;
    cuda_sim::traffic.watch("logits", c.logits.data(), 7, V * sizeof(float));
    cuda_sim::traffic.watch("q", c.q.data(), 7, V * sizeof(float));
    const TreeCase::Out out = c.sim();
    CHECK(out.status.ok() && out.emitted[0] >= 1);
    t.logit_passes = cuda_sim::traffic.max_read_passes("logits");
    t.q_passes = cuda_sim::traffic.max_read_passes("q");
    t.blocks = cuda_sim::traffic.max_blocks_per_row("logits");
    return t;
  }
  VerifyCase c;
  c.batch = 1;
  c.k = 4;
  c.vocab = V;
  c.logits.resize(static_cast<size_t>(5 * V));
  for (auto& x : c.logits) x = normal(rng);
  // q puts 0.99 on the proposal y_j = j and spreads the rest: the target gives y_0 little
  // mass (none under top-k), so position 0 is rejected and its residual drawn.
  c.draft_probs.assign(static_cast<size_t>(4 * V), 0.01f / static_cast<float>(V - 1));
  for (int64_t j = 0; j < 4; ++j) c.draft_probs[static_cast<size_t>(j * V + j)] = 0.99f;
  c.drafts = {0, 1, 2, 3};
  c.policy = policy;
  if (op == "block_verify") c.method = VerifyMethod::kBlock;
  VerifyOut out;
  const VerifyArgs a = c.args(&out);
  cuda_sim::traffic.watch("logits", c.logits.data(), 5, V * sizeof(float));
  cuda_sim::traffic.watch("q", c.draft_probs.data(), 4, V * sizeof(float));
  CHECK(sim_verify(a).ok());
  t.logit_passes = cuda_sim::traffic.max_read_passes("logits");
  t.q_passes = cuda_sim::traffic.max_read_passes("q");
  t.blocks = cuda_sim::traffic.max_blocks_per_row("logits");
  return t;
}

// The pins: what the kernels cost now, per row, at B = 1, V = 128256. A change that reads
// the logits more often, or spreads a row over fewer blocks, fails here. The target of
// the GPU work (issue: at most two reads of each logit at temperature 1, a row split over
// several blocks when there are fewer rows than SMs) moves these numbers down (passes)
// and up (blocks); update the pins with it.
void test_memory_traffic() {
  PolicyParams plain;  // temperature 1
  PolicyParams knobs;
  knobs.top_k = 50;
  knobs.top_p = 0.9f;
  struct Pin {
    const char* op;
    const PolicyParams* policy;
    double logit_passes;  // at most
    double q_passes;      // at most
    size_t blocks;        // exactly
  };
  // Measured when they were set: without a filter the rows split over 32 blocks (4096
  // values each, whole tiles: split_kernels.cuh) and read the logits twice: apply_policy
  // 2.000 (the statistics in one pass, sampling_math.h tiles; the write), sample 2.032
  // (max, sum, the target's chunk), verify 2.002 (the statistics of every position in one
  // pass; the residual's total and the walk along one thread's chunk), q 1.002 (its check
  // in the residual's pass); with top-k + top-p they read them 8 times (statistics 1,
  // each threshold's radix selection 3, the write or the residual 1), the row split over
  // 32 blocks too (the chunks' histograms added a row: split_kernels.cuh, rows with a
  // filter; one block a row before). Before the tiles and the radix selection: 3, 2.033,
  // 3.002, q 2.002, 31 blocks; 20 / 21 with top-k + top-p (8-way threshold searches).
  // Block verification (the same case, method kBlock): logits 2.002 / 8.001, q 2.002; its
  // residual masses and q's checks are found for every position at once
  // (block_residual_kernel, 32 blocks a row) where one block a row walked the positions'
  // rows in turn (the same passes, read by one SM: q 2 passes, a check and the mass).
  // verify_tree (B = 1, tree_case's 6 nodes, drafts from q): logits 2.004 / 8.004, q
  // 2.008 / 3.008 (2.006 / 8.000, q 2.001 / 3.001 with the simulation's old 64-thread
  // blocks in place of ops.cu's): every node row's statistics in parallel (tree_policy_kernel or the
  // split kernels, 32 blocks a row) before the walk, whose one block reads a row again
  // only for its draws and residuals; before, the walk's block checked every row (a
  // pass), then computed each visited row's statistics itself (1, or 7 with top-k +
  // top-p), one block a row.
  const Pin pins[] = {
      {"apply_policy", &plain, 2.0, 0.0, 32},
      {"apply_policy", &knobs, 8.0, 0.0, 32},
      {"sample", &plain, 2.04, 0.0, 32},
      {"verify", &plain, 2.01, 1.01, 32},
      {"verify", &knobs, 8.01, 1.01, 32},
      {"block_verify", &plain, 2.01, 2.01, 32},
      {"block_verify", &knobs, 8.01, 2.01, 32},
      {"verify_tree", &plain, 2.01, 2.01, 32},
      {"verify_tree", &knobs, 8.01, 3.01, 32},
  };
  for (const Pin& pin : pins) {
    const Traffic t = measure(pin.op, *pin.policy);
    std::printf("traffic: %-12s %-13s logits %.3f passes, q %.3f, written %.3f, %zu block(s) a row\n",
                pin.op, pin.policy == &plain ? "temperature 1" : "top-k + top-p", t.logit_passes,
                t.q_passes, t.write_passes, t.blocks);
    CHECK(t.logit_passes <= pin.logit_passes);
    CHECK(t.q_passes <= pin.q_passes);
    CHECK(t.logit_passes >= 1.0);  // every op reads its rows
    if (std::string(pin.op) != "apply_policy" && std::string(pin.op) != "sample") {
      CHECK(t.q_passes > 1.0);  // the rejection read q's row
    }
    CHECK(t.blocks == pin.blocks);
    if (std::string(pin.op) == "apply_policy") CHECK(t.write_passes == 1.0);
  }
  cuda_sim::traffic.clear();
}

// ---- rows split over blocks (split_kernels.cuh) ----------------------------------------

// The split kernels against the CPU on vocabularies of 2 to 5 chunks, few rows, every
// unfiltered policy, both dtypes: the same bits, tokens and faults; and the plan itself.
void test_split_rows_match_the_cpu() {
  // Chunks are whole tiles (kStatsTile values), at least kSplitMinChunk = 3 tiles.
  CHECK(split_plan(1, 128256, 132).chunks == 32 && split_plan(1, 128256, 132).chunk_len == 4096);
  CHECK(split_plan(1, 6143, 132).chunks == 1 && split_plan(1, 8191, 132).chunks == 2);
  CHECK(split_plan(1, 9216, 132).chunks == 3 && split_plan(1, 9216, 132).chunk_len == 3072);
  CHECK(split_plan(200, 128256, 132).chunks == 1);  // many rows: one block each
  CHECK(split_plan(5, 1 << 20, 132).chunks == 32);  // at most kCudaSplitMaxChunks
  CHECK(split_plan(40, 1 << 20, 132).chunks == 7);  // two blocks an SM: ceil(264 / 40)
  for (int64_t V : {8192, 12289, 20000}) {
    const SplitPlan plan = split_plan(2, V, sim_sms());
    CHECK(plan.chunks >= 2 && plan.chunks * plan.chunk_len >= V &&
          (plan.chunks - 1) * plan.chunk_len < V);
    // apply_policy, then sample, on two rows.
    std::mt19937 rng(static_cast<uint32_t>(V));
    std::normal_distribution<float> normal(0.0f, 3.0f);
    std::vector<float> x(static_cast<size_t>(2 * V));
    for (auto& v : x) v = normal(rng);
    for (float temperature : {1.0f, 0.7f, 0.0f}) {
      ApplyPolicyArgs a;
      a.logits = x.data();
      a.logits_row_stride = V;
      a.rows = 2;
      a.vocab = V;
      a.policy.temperature = temperature;
      a.probs_row_stride = V;
      std::vector<float> got(x.size()), want(x.size());
      a.probs = got.data();
      CHECK(sim_apply_policy(a).ok());
      a.probs = want.data();
      CHECK(apply_policy_cpu(a).ok());
      CHECK(policy_rows_differ(got, want, 2, static_cast<int>(V)) == 0);
      if (temperature == 0.0f) continue;
      SampleArgs s;
      s.probs = want.data();
      s.probs_row_stride = V;
      s.rows = 2;
      s.vocab = V;
      for (uint64_t offset = 0; offset < 20; ++offset) {
        s.rng.offset = offset;
        int32_t sim_tokens[2] = {-7, -7}, cpu_tokens[2] = {-7, -7};
        s.tokens = sim_tokens;
        CHECK(sim_sample(s).ok());
        s.tokens = cpu_tokens;
        CHECK(sample_cpu(s).ok());
        CHECK(sim_tokens[0] == cpu_tokens[0] && sim_tokens[1] == cpu_tokens[1]);
      }
    }
    // Faults: the lowest bad index of a row, wherever its chunk; zero mass; all -Inf.
    std::vector<float> bad = x;
    bad[static_cast<size_t>(V + V - 3)] = std::nanf("");
    bad[static_cast<size_t>(V + plan.chunk_len + 1)] = INFINITY;
    ApplyPolicyArgs a;
    a.logits = bad.data();
    a.logits_row_stride = V;
    a.rows = 2;
    a.vocab = V;
    a.probs_row_stride = V;
    std::vector<float> got(x.size(), 5.0f), want(x.size(), 5.0f);
    a.probs = got.data();
    const OpStatus sim_bad = sim_apply_policy(a);
    a.probs = want.data();
    const OpStatus cpu_bad = apply_policy_cpu(a);
    CHECK(sim_bad.code == StatusCode::kNanOrInfLogits && sim_bad.row == 1 &&
          sim_bad.col == plan.chunk_len + 1);
    CHECK(same_fault(sim_bad, cpu_bad));
    CHECK(policy_rows_differ(got, want, 2, static_cast<int>(V)) == 0);  // row 1: zeros
    std::fill(bad.begin(), bad.begin() + V, -INFINITY);
    bad[static_cast<size_t>(V + V - 3)] = 1.0f;
    bad[static_cast<size_t>(V + plan.chunk_len + 1)] = 1.0f;
    a.probs = got.data();
    const OpStatus masked = sim_apply_policy(a);
    CHECK(masked.code == StatusCode::kNanOrInfLogits && masked.row == 0 && masked.col == -1);
    std::vector<float> probs(static_cast<size_t>(2 * V), 0.0f);
    probs[static_cast<size_t>(V + 5)] = 1.0f;
    probs[static_cast<size_t>(V - 1)] = -1.0f;  // row 0, last chunk
    SampleArgs s;
    s.probs = probs.data();
    s.probs_row_stride = V;
    s.rows = 2;
    s.vocab = V;
    int32_t tokens[2] = {0, 0};
    s.tokens = tokens;
    const OpStatus neg = sim_sample(s);
    CHECK(neg.code == StatusCode::kInvalidProbs && neg.row == 0 && neg.col == V - 1);
    CHECK(tokens[0] == -1 && tokens[1] == 5);
    probs[static_cast<size_t>(V - 1)] = 0.0f;  // row 0: zero mass
    const OpStatus zero = sim_sample(s);
    CHECK(zero.code == StatusCode::kInvalidProbs && zero.row == 0 && zero.col == -1);
    // verify: sampled and one-hot drafts, ragged, token and block, three temperatures.
    for (bool with_q : {true, false}) {
      VerifyCase c = perturbed_case(V, 31u + static_cast<uint32_t>(V), 1.0f);
      c.batch = 2;
      c.num_draft = {3, 1};
      if (!with_q) c.draft_probs.clear();
      for (float temperature : {1.0f, 0.8f, 0.0f}) {
        for (VerifyMethod method : {VerifyMethod::kToken, VerifyMethod::kBlock}) {
          c.policy = PolicyParams{};
          c.policy.temperature = temperature;
          c.method = method;
          for (uint64_t seed = 1; seed <= 6; ++seed) {
            c.seed = seed;
            const VerifyOut sim = c.run_with(sim_verify), cpu = c.run();
            CHECK(sim.status.ok() && cpu.status.ok());
            for (int64_t b = 0; b < c.batch; ++b) CHECK(sim.row_equal(cpu, b, c.k));
          }
        }
      }
    }
  }
  // Without the split (no SMs to fill), the same results: the split changes nothing.
  g_sim_device = kNoSplit;
  VerifyCase c = perturbed_case(12289, 9, 1.0f);
  c.batch = 2;
  c.num_draft = {3, 2};
  c.policy = PolicyParams{};
  const VerifyOut one_block = c.run_with(sim_verify);
  g_sim_device = kH200;
  const VerifyOut split = c.run_with(sim_verify);
  for (int64_t b = 0; b < c.batch; ++b) CHECK(split.row_equal(one_block, b, c.k));
}


// Rows with a filter split over blocks (split_kernels.cuh, rows with a filter): the
// chunks' radix histograms added a row must give the one-block threshold and kept mass,
// so the CPU's bits. Vocabularies of 2 to 5 chunks (12289: a last chunk of one value),
// rows built to meet the selection's edges (ties at the threshold, values one ulp apart,
// thresholds that underflow), scalar filters and per-row mixes (each filter alone, none,
// greedy, a bad policy), both dtypes, split and unsplit launches; then verify.
void test_split_filters_match_the_cpu() {
  struct Filter {
    int top_k;
    float top_p, min_p;
  };
  const Filter filters[] = {{1, 1.0f, 0.0f},  {50, 1.0f, 0.0f},   {0, 0.5f, 0.0f},
                            {0, 1e-6f, 0.0f}, {0, 0.999f, 0.0f},  {50, 0.9f, 0.0f},
                            {10, 0.9f, 0.05f}, {0, 0.95f, 0.5f},  {0, 1.0f, 0.01f},
                            {4000, 0.3f, 0.0f}};
  constexpr int kRows = 4;
  int cases = 0, differ = 0, split_cases = 0;
  for (int V : {8192, 12289, 20000}) {
    CHECK(split_plan(kRows, V, 132).chunks >= 2);
    std::mt19937 rng(static_cast<uint32_t>(V) + 5u);
    std::normal_distribution<float> normal(0.0f, 3.0f);
    std::vector<float> x(static_cast<size_t>(kRows * V));
    for (int i = 0; i < V; ++i) x[static_cast<size_t>(i)] = static_cast<float>(rng() % 6);  // few levels
    float v = 2.0f;
    for (int i = 0; i < V; ++i) {  // one ulp apart, shuffled
      x[static_cast<size_t>(V + i)] = v;
      v = std::nextafter(v, 0.0f);
    }
    std::shuffle(x.begin() + V, x.begin() + 2 * V, rng);
    for (int i = 0; i < V; ++i) x[static_cast<size_t>(2 * V + i)] = 40.0f * normal(rng);  // underflow
    for (int i = 0; i < V; ++i) x[static_cast<size_t>(3 * V + i)] = normal(rng);
    const std::vector<BFloat16> xb = convert<BFloat16>(x);
    // Per row: top-k only, top-p only, min-p only, then every filter; or none, greedy, a
    // bad top_p (row 2), top-k + min-p.
    const float t_mix[2][kRows] = {{1.0f, 0.8f, 1.0f, 1.2f}, {1.0f, 0.0f, 0.7f, 1.0f}};
    const int32_t k_mix[2][kRows] = {{20, 0, 0, 30}, {0, 5, 0, 3}};
    const float p_mix[2][kRows] = {{1.0f, 0.9f, 1.0f, 0.8f}, {1.0f, 0.5f, 1.5f, 1.0f}};
    const float m_mix[2][kRows] = {{0.0f, 0.0f, 0.1f, 0.02f}, {0.0f, 0.0f, 0.0f, 0.3f}};
    std::vector<PolicyParams> policies;
    for (const Filter& f : filters) {
      for (float temperature : {1.0f, 0.4f}) policies.push_back(scalar_policy(temperature, f.top_k, f.top_p, f.min_p));
    }
    for (int m = 0; m < 2; ++m) {
      PolicyParams p;
      p.temperature_per_row = t_mix[m];
      p.top_k_per_row = k_mix[m];
      p.top_p_per_row = p_mix[m];
      p.min_p_per_row = m_mix[m];
      policies.push_back(p);
    }
    for (const PolicyParams& pol : policies) {
      for (bool bf16 : {false, true}) {
        if (bf16 && V != 12289) continue;
        ApplyPolicyArgs a = rows_args(x, xb, bf16, kRows, V);
        a.policy = pol;
        std::vector<float> want(x.size(), 7.0f), got(x.size(), 7.0f);
        a.probs = want.data();
        const OpStatus cpu = apply_policy_cpu(a);
        for (int device : {kH200, kNoSplit}) {
          g_sim_device = device;
          std::fill(got.begin(), got.end(), 7.0f);
          a.probs = got.data();
          const OpStatus sim = sim_apply_policy(a);
          CHECK(same_fault(sim, cpu));
          differ += policy_rows_differ(got, want, kRows, V);
          split_cases += device == kH200;
          ++cases;
        }
        g_sim_device = kH200;
      }
    }
    // A fault in a filtered split row: the lowest bad index of its row, its probabilities 0.
    std::vector<float> bad = x;
    bad[static_cast<size_t>(3 * V + V - 2)] = std::nanf("");
    bad[static_cast<size_t>(3 * V + split_plan(kRows, V, 132).chunk_len + 3)] = INFINITY;
    std::fill(bad.begin() + V, bad.begin() + 2 * V, -INFINITY);  // row 1: all masked
    ApplyPolicyArgs a = rows_args(bad, xb, false, kRows, V);
    a.policy = scalar_policy(1.0f, 50, 0.9f, 0.0f);
    std::vector<float> got(x.size(), 7.0f), want(x.size(), 7.0f);
    a.probs = got.data();
    const OpStatus sim_bad = sim_apply_policy(a);
    a.probs = want.data();
    const OpStatus cpu_bad = apply_policy_cpu(a);
    CHECK(!cpu_bad.ok() && same_fault(sim_bad, cpu_bad));
    CHECK(policy_rows_differ(got, want, kRows, V) == 0);
  }
  std::printf("split filters: %d cases (%d split), %d rows differ from the CPU\n", cases,
              split_cases, differ);
  CHECK(differ == 0);
  // verify with filters on split rows: token and block, sampled and one-hot drafts.
  const float row_temperature[] = {1.0f, 0.0f};
  const int32_t row_top_k[] = {8, 0};
  const float row_top_p[] = {0.9f, 1.0f};
  const float row_min_p[] = {0.0f, 0.1f};
  PolicyParams per_row;
  per_row.temperature_per_row = row_temperature;
  per_row.top_k_per_row = row_top_k;
  per_row.top_p_per_row = row_top_p;
  per_row.min_p_per_row = row_min_p;
  const PolicyParams verify_policies[] = {scalar_policy(1.0f, 50, 0.9f, 0.0f),
                                          scalar_policy(0.7f, 0, 0.8f, 0.05f),
                                          scalar_policy(1.2f, 3, 1.0f, 0.0f), per_row};
  Tally tally;
  for (bool with_q : {true, false}) {
    VerifyCase c = perturbed_case(12289, 77u, 1.0f);
    c.batch = 2;
    c.num_draft = {3, 2};
    for (int64_t j = 0; j < 2; ++j) {  // row 0 proposes the target's top tokens: accepted
      const float* t = &c.logits[static_cast<size_t>(j * c.vocab)];
      c.drafts[static_cast<size_t>(j)] = static_cast<int32_t>(std::max_element(t, t + c.vocab) - t);
    }
    if (!with_q) c.draft_probs.clear();
    for (const PolicyParams& pol : verify_policies) {
      for (VerifyMethod method : {VerifyMethod::kToken, VerifyMethod::kBlock}) {
        c.policy = pol;
        c.method = method;
        for (uint64_t seed = 1; seed <= 4; ++seed) {
          c.seed = seed;
          compare_verify(c, &tally);
        }
      }
    }
  }
  std::printf("split filters, verify: %d rows, %d differ from the CPU, %d rejected, %d accepted a draft\n",
              tally.rows, tally.differ, tally.rejected, tally.accepted);
  CHECK(tally.differ == 0 && tally.rejected * 5 >= tally.rows && tally.accepted * 5 >= tally.rows);
}

// Runs one test and says how long it took (the suite's time is watched: make test).
void run(const char* name, void (*test)()) {
  const auto start = std::chrono::steady_clock::now();
  test();
  const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
  std::printf("%-40s %6.1f s\n", name, took.count());
}

}  // namespace

// ---- compact q (ops.h) -----------------------------------------------------------------

// A draft vocabulary of the tokens x with x % 3 != 1 (and x < vocab - 2): full q rows
// [rows, vocab] are zeroed outside it in place and returned compact ([rows, W]) with the
// index (target id -> column, -1 outside).
struct Compact {
  std::vector<float> q;
  std::vector<int32_t> index;
  int64_t width = 0;
};
Compact compact_rows(std::vector<float>* full, int64_t vocab) {
  Compact c;
  c.index.assign(static_cast<size_t>(vocab), -1);
  for (int64_t x = 0; x < vocab; ++x) {
    if (x % 3 != 1 && x < vocab - 2) c.index[static_cast<size_t>(x)] = static_cast<int32_t>(c.width++);
  }
  const int64_t rows = static_cast<int64_t>(full->size()) / vocab;
  c.q.assign(static_cast<size_t>(rows * c.width), 0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    float* row = &(*full)[static_cast<size_t>(r * vocab)];
    double total = 0.0;
    for (int64_t x = 0; x < vocab; ++x) {
      if (c.index[static_cast<size_t>(x)] < 0) row[x] = 0.0f;
      total += row[x];
    }
    for (int64_t x = 0; x < vocab; ++x) {
      row[x] = static_cast<float>(row[x] / total);
      const int32_t m = c.index[static_cast<size_t>(x)];
      if (m >= 0) c.q[static_cast<size_t>(r * c.width + m)] = row[x];
    }
  }
  return c;
}

void test_compact_q_matches_the_full_q() {
  Tally tally;
  int tree_rows = 0, tree_deep = 0;
  const PolicyParams policies[] = {
      scalar_policy(1.0f, 0, 1.0f, 0.0f), scalar_policy(0.7f, 8, 1.0f, 0.0f),
      scalar_policy(1.2f, 20, 0.9f, 0.05f), scalar_policy(0.0f, 0, 1.0f, 0.0f)};
  for (int64_t V : {40, 130, 12289}) {
    for (VerifyMethod method : {VerifyMethod::kToken, VerifyMethod::kBlock}) {
      VerifyCase full = perturbed_case(V, 900u + static_cast<uint32_t>(V), 0.5f);
      full.method = method;
      const Compact cq = compact_rows(&full.draft_probs, V);
      VerifyCase compact = full;
      compact.draft_probs = cq.q;
      compact.draft_index = cq.index;
      compact.draft_width = cq.width;
      for (uint64_t seed = 1; seed <= 2; ++seed) {
        full.seed = compact.seed = seed;
        for (const PolicyParams& pol : policies) {
          full.policy = compact.policy = pol;
          const VerifyOut ref = full.run(), cpu = compact.run(), sim = compact.run_with(sim_verify);
          CHECK(ref.status.ok() && cpu.status.ok() && sim.status.ok());
          for (int64_t b = 0; b < full.batch; ++b) {
            const bool same = ref.row_equal(cpu, b, full.k) && ref.row_equal(sim, b, full.k);
            CHECK(same);
            tally.differ += !same;
            ++tally.rows;
            tally.rejected += ref.accepted[static_cast<size_t>(b)] < full.n(b);
            tally.bonus += ref.accepted[static_cast<size_t>(b)] == full.n(b);
          }
        }
      }
    }
    for (bool replacement : {true, false}) {
      TreeCase full = tree_case(V, 950u + static_cast<uint32_t>(V), true, replacement);
      const Compact cq = compact_rows(&full.q, V);
      TreeCase compact = full;
      compact.q = cq.q;
      compact.draft_index = cq.index;
      compact.draft_width = cq.width;
      for (const PolicyParams& pol : policies) {
        full.policy = compact.policy = pol;
        const TreeCase::Out ref = full.cpu(), cpu = compact.cpu(), sim = compact.sim();
        CHECK(ref.status.ok() && cpu.status.ok() && sim.status.ok());
        for (int64_t b = 0; b < full.batch; ++b) {
          const bool same = full.row_equal(ref, cpu, b) && full.row_equal(ref, sim, b);
          CHECK(same);
          tally.differ += !same;
          ++tree_rows;
          tree_deep += ref.emitted[static_cast<size_t>(b)] > 1;
        }
      }
    }
  }
  std::printf("compact q: %d chain rows (%d rejected, %d bonus), %d tree rows (%d accepted a "
              "node), %d differ from the full q\n", tally.rows, tally.rejected, tally.bonus,
              tree_rows, tree_deep, tally.differ);
  CHECK(tally.rejected * 10 >= tally.rows && tally.bonus * 10 >= tally.rows && tree_deep * 4 >= tree_rows);
  CHECK(tally.differ == 0);
  // An index entry past the row reads as NaN: kInvalidProbs where read, alike on both.
  VerifyCase c = perturbed_case(40, 5u, 0.5f);
  const Compact cq = compact_rows(&c.draft_probs, 40);
  c.draft_probs = cq.q;
  c.draft_index = cq.index;
  c.draft_width = cq.width;
  c.policy = scalar_policy(1.0f, 0, 1.0f, 0.0f);
  c.draft_index[static_cast<size_t>(c.drafts[0])] = static_cast<int32_t>(cq.width);  // row 0, j = 0
  const VerifyOut sim = c.run_with(sim_verify), cpu = c.run();
  CHECK(cpu.status.code == StatusCode::kInvalidProbs && cpu.status.row == 0 && cpu.status.col == 0);
  CHECK(same_fault(sim.status, cpu.status));
  // draft_index without a width is an argument error.
  c.draft_width = 0;
  CHECK(c.run().status.code == StatusCode::kInvalidArgument);
}

int main() {
  run("apply_policy", test_apply_policy);
  run("sample", test_sample);
  run("sample_keyed", test_sample_keyed);
  run("verify_matches_the_cpu", test_verify_matches_the_cpu);
  run("verify_faults", test_verify_faults);
  run("verify_seed_pointers_and_no_drafts", test_verify_seed_pointers_and_no_drafts);
  run("block_verify_matches_the_cpu", test_block_verify_matches_the_cpu);
  run("verify_tree_matches_the_cpu", test_verify_tree_matches_the_cpu);
  run("verify_tree_faults", test_verify_tree_faults);
  run("compact_q_matches_the_full_q", test_compact_q_matches_the_full_q);
  run("launchers_at_a_large_vocabulary", test_launchers_at_a_large_vocabulary);
  run("split_rows_match_the_cpu", test_split_rows_match_the_cpu);
  run("tiles_match_the_cpu", test_tiles_match_the_cpu);
  run("filters_match_the_cpu", test_filters_match_the_cpu);
  run("split_filters_match_the_cpu", test_split_filters_match_the_cpu);
  run("memory_traffic", test_memory_traffic);
  // The launchers freed every workspace they allocated.
  std::printf("launchers: %llu kernel launches, %llu workspaces allocated, %llu freed\n",
              cuda_sim::runtime.launches, cuda_sim::runtime.allocations, cuda_sim::runtime.frees);
  CHECK(cuda_sim::runtime.launches > 1000 && cuda_sim::runtime.allocations > 100);
  CHECK(cuda_sim::runtime.allocations == cuda_sim::runtime.frees);
  // Every kernel's shared memory was poisoned before each block (cuda_sim.h): the objects
  // of the launchers' kernels are found (BlockOps, RadixScratch, tile records, ...).
  size_t shared_bytes = 0;
  for (const auto& o : cuda_sim::shared_objects()) shared_bytes += o.bytes;
  std::printf("shared memory: %zu objects, %zu bytes poisoned before each block\n",
              cuda_sim::shared_objects().size(), shared_bytes);
  CHECK(cuda_sim::shared_objects().size() >= 40 && shared_bytes > 500000);
  return native_check::check_summary("test_cuda_sim_kernels");
}

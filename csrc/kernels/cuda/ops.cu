// The CUDA launchers of the sampling ops: host checks, the device and workspace of the
// call (OpLaunch, launch.cuh), the kernels of row_kernels.cuh with 512 threads a block on
// the caller's stream, and the error record turned into a status with the bad value.
#include <climits>
#include <type_traits>

#include "launch.cuh"
#include "split_kernels.cuh"

namespace verispec {

namespace {

using namespace kernels;
using namespace kernels::cuda;

constexpr int kBlock = kLaunchBlock;
constexpr int kSplitBlock = 256;  // a split block's chunk is 3072+ values: 12+ a thread

// The filters of split rows (split_kernels.cuh, rows with a filter), after
// split_stats_kernel: the rows' statistics, then each step's pass over every chunk and
// (but min-p's) its selection a row.
template <typename T, typename Rows>
void split_filter_launches(const Rows& rows, int64_t n_rows, const PolicyParams& policy,
                           int64_t vocab, const SplitPlan& plan, ChunkStats* chunks,
                           cudaStream_t stream) {
  const auto grid = static_cast<unsigned>(n_rows);
  const auto split_grid = static_cast<unsigned>(n_rows * plan.chunks);
  launch_kernel(split_filter_begin_kernel<kSplitBlock, Rows>, grid, kSplitBlock, stream, rows,
                vocab, plan, chunks);
  for_each_filter_step(policy, vocab, [&](int step) {
    launch_kernel(split_filter_pass_kernel<T, kSplitBlock, Rows>, split_grid, kSplitBlock, stream,
                  rows, vocab, plan, chunks, step);
    if (step < kFilterSteps) {
      launch_kernel(split_filter_select_kernel<kSplitBlock, Rows>, grid, kSplitBlock, stream, rows,
                    vocab, chunks, step);
    }
  });
}

}  // namespace

// apply_policy: one block per row, compiled with or without the filter code
// (policy_may_filter); without a filter, few rows are each split over several blocks
// (split_kernels.cuh). Napkin math (V = 32000, bf16, no filter): 2 reads of 64 KB (the
// statistics in one, sampling_math.h tiles; then the write) + one 128 KB write per row;
// each active top-k / top-p adds 3 read passes (radix selection, block_ops.cuh).
OpStatus apply_policy_cuda(const ApplyPolicyArgs& a, const CudaLaunch& launch) {
  OpStatus s = check_apply_policy_args(a);
  if (!s.ok() || a.rows == 0) return s;
  OpLaunch op(launch);
  s = op.start(apply_policy_cuda_workspace_bytes());
  if (!s.ok()) return s;
  const bool filter = policy_may_filter(a.policy, a.vocab);
  const SplitPlan plan = split_plan(a.rows, a.vocab, sm_count(launch.device));
  dispatch_dtype(a.logits_dtype, a.logits, [&](const auto* logits) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(logits)>>;
    const auto grid = static_cast<unsigned>(a.rows);
    if (plan.chunks > 1) {  // few rows: each split over plan.chunks blocks
      auto* chunks = static_cast<ChunkStats*>(op.split());
      const auto split_grid = static_cast<unsigned>(a.rows * plan.chunks);
      const PolicyRows<T> rows{a};
      launch_kernel(split_stats_kernel<T, kSplitBlock, PolicyRows<T>>, split_grid, kSplitBlock,
                    op.stream(), rows, a.vocab, plan, chunks);
      if (filter) {
        split_filter_launches<T>(rows, a.rows, a.policy, a.vocab, plan, chunks, op.stream());
        launch_kernel(apply_policy_split_write_kernel<T, kSplitBlock, true>, split_grid,
                      kSplitBlock, op.stream(), a, plan, chunks, op.record());
      } else {
        launch_kernel(apply_policy_split_write_kernel<T, kSplitBlock, false>, split_grid,
                      kSplitBlock, op.stream(), a, plan, chunks, op.record());
      }
    } else if (filter) {
      launch_kernel(apply_policy_kernel<T, kBlock, true>, grid, kBlock, op.stream(), a,
                    op.record());
    } else {
      launch_kernel(apply_policy_kernel<T, kBlock, false>, grid, kBlock, op.stream(), a,
                    op.record());
    }
  });
  s = op.finish(OpKind::kApplyPolicy);
  if (s.code == StatusCode::kInvalidPolicy) fill_policy_value(a.policy, &s);
  if (s.code == StatusCode::kNanOrInfLogits && s.col >= 0) {
    fill_logit_value(a.logits, a.logits_dtype, s.row * a.logits_row_stride + s.col, &s);
  }
  return s;
}

// sample: one block per row; with few rows and no keys, the statistics split over several
// blocks a row, then one block a row walks the chunk that holds the target.
OpStatus sample_cuda(const SampleArgs& a, const CudaLaunch& launch) {
  OpStatus s = check_sample_args(a);
  if (!s.ok() || a.rows == 0) return s;
  OpLaunch op(launch);
  s = op.start(sample_cuda_workspace_bytes());
  if (!s.ok()) return s;
  const SplitPlan plan = a.row_seeds ? SplitPlan{1, static_cast<int>(a.vocab)}
                                     : split_plan(a.rows, a.vocab, sm_count(launch.device));
  if (plan.chunks > 1) {  // few rows: the statistics split, one block a row walks its chunk
    auto* chunks = static_cast<ChunkStats*>(op.split());
    const auto split_grid = static_cast<unsigned>(a.rows * plan.chunks);
    const SampleRows rows{a};
    launch_kernel(split_max_kernel<kSplitBlock>, split_grid, kSplitBlock, op.stream(), rows,
                  a.vocab, plan, chunks);
    launch_kernel(split_sum_kernel<kSplitBlock>, split_grid, kSplitBlock, op.stream(), rows,
                  a.vocab, plan, chunks);
    launch_kernel(sample_split_pick_kernel<kSplitBlock>, static_cast<unsigned>(a.rows), kSplitBlock,
                  op.stream(), a, plan, chunks, op.record());
  } else {
    launch_kernel(sample_kernel<kBlock>, static_cast<unsigned>(a.rows), kBlock, op.stream(), a,
                  op.record());
  }
  s = op.finish(OpKind::kSample);
  if (s.code == StatusCode::kInvalidProbs && s.col >= 0) {
    fill_value(a.probs, s.row * a.probs_row_stride + s.col, &s);
  }
  return s;
}

// verify: verify_policy_kernel, one block per row position (or, with few positions, the
// split kernels), into the RowStats of the workspace payload; block verification's
// residual masses, every position in parallel (block_residual_kernel, split alike); then
// verify_sample_kernel, one block per row.
OpStatus verify_cuda(const VerifyArgs& a, const CudaLaunch& launch) {
  OpStatus s = check_verify_args(a);
  if (!s.ok() || a.batch == 0) return s;
  if (a.batch * (a.num_spec + 1) > INT_MAX) {
    return invalid_argument("batch * (K + 1) must be < 2^31 on CUDA");
  }
  OpLaunch op(launch);
  s = op.start(verify_cuda_workspace_bytes(a.batch, a.num_spec));
  if (!s.ok()) return s;
  auto* stats = static_cast<RowStats*>(op.payload());
  const bool filter = verify_may_filter(a);
  const int64_t width = a.num_spec + 1;
  const SplitPlan plan = split_plan(a.batch * width, a.vocab, sm_count(launch.device));
  dispatch_dtype(a.target_logits_dtype, a.target_logits, [&](const auto* logits) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(logits)>>;
    const auto positions = static_cast<unsigned>(a.batch * width);
    if (plan.chunks > 1) {  // few positions: each split over plan.chunks blocks
      auto* chunks = static_cast<ChunkStats*>(op.split());
      const auto split_grid = static_cast<unsigned>(a.batch * width * plan.chunks);
      const VerifyRows<T> rows{a};
      launch_kernel(split_stats_kernel<T, kSplitBlock, VerifyRows<T>>, split_grid, kSplitBlock,
                    op.stream(), rows, a.vocab, plan, chunks);
      if (filter) {
        split_filter_launches<T>(rows, a.batch * width, a.policy, a.vocab, plan, chunks,
                                 op.stream());
        launch_kernel(verify_split_stats_kernel<T, true>, positions, 32, op.stream(), a, plan,
                      chunks, stats, op.record());
      } else {
        launch_kernel(verify_split_stats_kernel<T, false>, positions, 32, op.stream(), a, plan,
                      chunks, stats, op.record());
      }
    } else if (filter) {
      launch_kernel(verify_policy_kernel<T, kBlock, true>, positions, kBlock, op.stream(), a, stats,
                    op.record());
    } else {
      launch_kernel(verify_policy_kernel<T, kBlock, false>, positions, kBlock, op.stream(), a,
                    stats, op.record());
    }
    if (verify_needs_block_residuals(a) && plan.chunks > 1) {
      launch_kernel(block_residual_kernel<T, kSplitBlock>,
                    static_cast<unsigned>(a.batch * width * plan.chunks), kSplitBlock, op.stream(),
                    a, plan, stats);
    } else if (verify_needs_block_residuals(a)) {
      launch_kernel(block_residual_kernel<T, kBlock>, positions, kBlock, op.stream(), a, plan,
                    stats);
    }
    launch_kernel(verify_sample_kernel<T, kBlock>, static_cast<unsigned>(a.batch), kBlock,
                  op.stream(), a, stats, op.record());
  });
  s = op.finish(OpKind::kVerify);
  switch (s.code) {
    case StatusCode::kInvalidPolicy: fill_policy_value(a.policy, &s); break;
    case StatusCode::kNumDraftOutOfRange: fill_value(a.num_draft, s.row, &s); break;
    case StatusCode::kTokenOutOfRange:
      fill_value(a.draft_tokens, s.row * a.draft_tokens_stride_b + s.col, &s);
      break;
    default: break;
  }
  return s;
}

// verify_tree: the policy of every node row in parallel (tree_policy_kernel, or with few
// node rows the split kernels), then one block per row walks its tree; the workspace
// payload holds each row's residual and sibling-q rows, then the node rows' RowStats.
OpStatus verify_tree_cuda(const VerifyTreeArgs& a, const CudaLaunch& launch) {
  OpStatus s = check_verify_tree_args(a);
  if (!s.ok() || a.batch == 0) return s;
  if (a.batch * (a.max_nodes + 1) > INT_MAX) {
    return invalid_argument("batch * (N + 1) must be < 2^31 on CUDA");
  }
  OpLaunch op(launch);
  s = op.start(verify_tree_cuda_workspace_bytes(a.batch, a.max_nodes, a.vocab));
  if (!s.ok()) return s;
  auto* scratch = static_cast<float*>(op.payload());
  auto* stats = reinterpret_cast<RowStats*>(scratch + a.batch * 2 * a.vocab);
  const bool all_greedy = !a.policy.temperature_per_row && a.policy.temperature == 0.0f;
  const bool filter = !all_greedy && policy_may_filter(a.policy, a.vocab);
  const int64_t positions = a.batch * (a.max_nodes + 1);
  const SplitPlan plan = split_plan(positions, a.vocab, sm_count(launch.device));
  dispatch_dtype(a.target_logits_dtype, a.target_logits, [&](const auto* logits) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(logits)>>;
    const auto grid = static_cast<unsigned>(positions);
    if (plan.chunks > 1) {  // few node rows: each split over plan.chunks blocks
      auto* chunks = static_cast<ChunkStats*>(op.split());
      const TreeRows<T> rows{a};
      launch_kernel(split_stats_kernel<T, kSplitBlock, TreeRows<T>>,
                    static_cast<unsigned>(positions * plan.chunks), kSplitBlock, op.stream(), rows,
                    a.vocab, plan, chunks);
      if (filter) {
        split_filter_launches<T>(rows, positions, a.policy, a.vocab, plan, chunks, op.stream());
        launch_kernel(tree_split_stats_kernel<true>, grid, 32, op.stream(), a, plan, chunks, stats);
      } else {
        launch_kernel(tree_split_stats_kernel<false>, grid, 32, op.stream(), a, plan, chunks,
                      stats);
      }
    } else if (filter) {
      launch_kernel(tree_policy_kernel<T, kBlock, true>, grid, kBlock, op.stream(), a, stats);
    } else {
      launch_kernel(tree_policy_kernel<T, kBlock, false>, grid, kBlock, op.stream(), a, stats);
    }
    launch_kernel(verify_tree_kernel<T, kBlock>, static_cast<unsigned>(a.batch), kBlock,
                  op.stream(), a, scratch, stats, op.record());
  });
  s = op.finish(OpKind::kVerifyTree);
  switch (s.code) {
    case StatusCode::kInvalidPolicy: fill_policy_value(a.policy, &s); break;
    case StatusCode::kNumDraftOutOfRange: fill_value(a.num_nodes, s.row, &s); break;
    case StatusCode::kTokenOutOfRange:
    case StatusCode::kDuplicateSibling:
      fill_value(a.tree_tokens, s.row * a.tree_tokens_stride_b + s.col, &s);
      break;
    case StatusCode::kInvalidParent:
      fill_value(a.parents, s.row * a.parents_stride_b + s.col, &s);
      break;
    default: break;
  }
  return s;
}

}  // namespace verispec

// Bindings of the sampling ops (csrc/include/verispec/ops.h): apply_policy, sample,
// verify. Destination passing: every output is a tensor the caller allocated. Each
// binding checks dtype, shape, strides and device of every tensor (TensorView), picks
// the CPU or CUDA launcher from the device, releases the GIL around the kernels, and
// turns an OpStatus into ValueError (bad values) or RuntimeError (CUDA), naming the op
// and the row at fault. Per-row policy values and seed/offset may be tensors on the
// tensors' device: CUDA kernels read them at run time, so a CUDA graph can replay them.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <limits>
#include <optional>
#include <string>

#include "bindings.h"
#include "tensor_view.h"
#include "verispec/ops.h"
#include "verispec/policy_rules.h"

namespace py = pybind11;

namespace verispec {
namespace {

// ---- argument helpers ---------------------------------------------------------------

// Launch settings shared by every op.
struct Launch {
  intptr_t stream;
  bool check_errors;
  std::optional<TensorView> workspace;
};

Launch make_launch(const char* op, intptr_t stream, bool check_errors,
                   const py::object& workspace, const TensorView& like) {
  Launch l{stream, check_errors, std::nullopt};
  if (!workspace.is_none()) {
    l.workspace.emplace(TensorView::from(workspace, op, "workspace", /*writable=*/true));
    l.workspace->expect({DType::kUInt8}, {{"bytes", kAnyDim}}).expect_contiguous();
    l.workspace->expect_same_device(like);
  }
  return l;
}

CudaLaunch cuda_launch(const Launch& l, const TensorView& like) {
  CudaLaunch c;
  c.stream = reinterpret_cast<void*>(l.stream);
  c.device = like.device_id();
  c.check_errors = l.check_errors;
  if (l.workspace) {
    c.workspace = l.workspace->raw_data();
    c.workspace_bytes = static_cast<size_t>(l.workspace->numel());
  }
  return c;
}

LogitsDType logits_dtype(const TensorView& v) {
  switch (v.dtype()) {
    case DType::kBFloat16: return LogitsDType::kBFloat16;
    case DType::kFloat16: return LogitsDType::kFloat16;
    default: return LogitsDType::kFloat32;
  }
}

// A Python int as int64, saturated (sets *saturated): a top_k past int32 is "off" anyway,
// and policy_error saturates it to int32 the same way.
int64_t saturating_int64(const py::handle& value, bool* saturated) {
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(value.ptr(), &overflow);
  if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
  *saturated = overflow != 0;
  if (overflow > 0) return std::numeric_limits<int64_t>::max();
  if (overflow < 0) return std::numeric_limits<int64_t>::min();
  return v;
}

// The policy rule (policy_rules.h) on scalars as the caller gave them; throws ValueError
// with `prefix` + its message. top_k: a Python int of any size.
void check_policy_values(const std::string& prefix, double temperature, const py::handle& top_k,
                         double top_p, double min_p) {
  bool saturated = false;
  const int64_t k = saturating_int64(top_k, &saturated);
  const int32_t field = policy_error_field(temperature, k, top_p, min_p);
  if (field < 0) return;
  if (static_cast<PolicyField>(field) == PolicyField::kTopK && saturated) {
    throw py::value_error(prefix + policy_violation(PolicyField::kTopK, std::string(py::str(top_k))));
  }
  throw py::value_error(prefix + policy_error(temperature, k, top_p, min_p));
}

// _C.check_policy: the rule for Python callers (verispec.ops, verispec.reference, the
// CLI), who prefix the message with their own name.
void check_policy(double temperature, const py::int_& top_k, double top_p, double min_p) {
  check_policy_values("", temperature, top_k, top_p, min_p);
}

// A policy parameter: a Python number, or a per-row 1-D tensor [rows] of `dtype` on the
// op's device (kept alive in `view`). A number is also returned as given (`given`), for
// the range check; per-row values are range-checked by the kernels.
template <typename T>
void policy_param(const char* op, const char* name, const py::object& value, int64_t rows,
                  DType dtype, const TensorView& like, std::optional<TensorView>* view,
                  T* scalar, const T** per_row, py::object* given) {
  if (py::isinstance<py::bool_>(value)) {
    throw py::type_error(std::string(op) + ": " + name + " must be a number or a tensor [" +
                         std::to_string(rows) + "], got a bool");
  }
  if (py::isinstance<py::int_>(value) || py::isinstance<py::float_>(value)) {
    if (std::is_integral<T>::value && !py::isinstance<py::int_>(value)) {
      throw py::type_error(std::string(op) + ": " + name + " must be an int, got " +
                           std::string(py::repr(value)));
    }
    if (std::is_integral<T>::value) {
      bool saturated = false;
      *scalar = static_cast<T>(saturate_top_k(saturating_int64(value, &saturated)));
    } else {
      *scalar = static_cast<T>(value.cast<double>());
    }
    *per_row = nullptr;
    *given = value;
    return;
  }
  view->emplace(TensorView::from(value, op, name));
  (*view)->expect({dtype}, {{"N", rows}}).expect_contiguous();
  (*view)->expect_same_device(like);
  *per_row = (*view)->template data<const T>();
}

struct PolicyViews {
  std::optional<TensorView> temperature, top_k, top_p, min_p;
};

PolicyParams policy_params(const char* op, int64_t rows, const TensorView& like,
                           const py::object& temperature, const py::object& top_k,
                           const py::object& top_p, const py::object& min_p, PolicyViews* views) {
  PolicyParams p;
  // Per-row parameters keep their defaults here: the kernels check them row by row.
  py::object t = py::float_(p.temperature), k = py::int_(p.top_k), tp = py::float_(p.top_p),
             mp = py::float_(p.min_p);
  policy_param<float>(op, "temperature", temperature, rows, DType::kFloat32, like,
                      &views->temperature, &p.temperature, &p.temperature_per_row, &t);
  policy_param<int32_t>(op, "top_k", top_k, rows, DType::kInt32, like, &views->top_k, &p.top_k,
                        &p.top_k_per_row, &k);
  policy_param<float>(op, "top_p", top_p, rows, DType::kFloat32, like, &views->top_p, &p.top_p,
                      &p.top_p_per_row, &tp);
  policy_param<float>(op, "min_p", min_p, rows, DType::kFloat32, like, &views->min_p, &p.min_p,
                      &p.min_p_per_row, &mp);
  check_policy_values(std::string(op) + ": ", t.cast<double>(), k, tp.cast<double>(),
                      mp.cast<double>());
  return p;
}

// seed / offset: a Python int (two's complement for seeds >= 2^63), or a one-element
// int64 tensor on the op's device.
struct RandomViews {
  std::optional<TensorView> seed, offset;
};

void random_param(const char* op, const char* name, const py::object& value, bool is_seed,
                  const TensorView& like, std::optional<TensorView>* view, uint64_t* scalar,
                  const int64_t** ptr) {
  if (py::isinstance<py::int_>(value) && !py::isinstance<py::bool_>(value)) {
    const py::int_ big(value);
    const uint64_t limit_bits = is_seed ? 64 : 60;
    if (big < py::int_(0) || big.attr("bit_length")().cast<uint64_t>() > limit_bits) {
      throw py::value_error(std::string(op) + ": " + name + " must be an int in [0, 2**" +
                            std::to_string(limit_bits) + "), got " + std::string(py::str(value)));
    }
    *scalar = value.cast<uint64_t>();
    *ptr = nullptr;
    return;
  }
  if (!py::hasattr(value, "__dlpack__")) {
    throw py::type_error(std::string(op) + ": " + name +
                         " must be an int or a one-element int64 tensor, got " +
                         std::string(py::repr(value)));
  }
  view->emplace(TensorView::from(value, op, name));
  if ((*view)->dtype() != DType::kInt64 || (*view)->numel() != 1) {
    throw py::value_error(std::string(op) + ": " + name +
                          " must be an int or a one-element int64 tensor, got " +
                          dtype_name((*view)->dtype()) + " " + (*view)->shape_str());
  }
  (*view)->expect_same_device(like);
  *ptr = (*view)->template data<const int64_t>();
}

RandomParams random_params(const char* op, const TensorView& like, const py::object& seed,
                           const py::object& offset, RandomViews* views) {
  RandomParams r;
  random_param(op, "seed", seed, true, like, &views->seed, &r.seed, &r.seed_ptr);
  random_param(op, "offset", offset, false, like, &views->offset, &r.offset, &r.offset_ptr);
  return r;
}

// ---- status -> exception ---------------------------------------------------------------

// Where a value error sits, in the op's own terms.
std::string location(OpKind op, const OpStatus& s) {
  const std::string row = std::to_string(s.row), col = std::to_string(s.col);
  if (op == OpKind::kVerifyTree) {
    switch (s.code) {
      case StatusCode::kNumDraftOutOfRange: return "num_nodes[" + row + "]";
      case StatusCode::kTokenOutOfRange:
      case StatusCode::kDuplicateSibling: return "tree_tokens[" + row + ", " + col + "]";
      case StatusCode::kInvalidParent: return "parents[" + row + ", " + col + "]";
      default: break;
    }
  }
  switch (s.code) {
    case StatusCode::kInvalidPolicy:
      return std::string(policy_field_name(static_cast<PolicyField>(s.col))) + "[" + row + "]";
    case StatusCode::kNumDraftOutOfRange:
      return "num_draft[" + row + "]";
    case StatusCode::kTokenOutOfRange:
      return "draft_tokens[" + row + ", " + col + "]";
    case StatusCode::kNanOrInfLogits:
      if (op == OpKind::kVerify || op == OpKind::kVerifyTree) {
        return "target_logits[" + row + ", " + col + "]";
      }
      return s.col >= 0 ? "logits[" + row + ", " + col + "]" : "logits[" + row + "]";
    case StatusCode::kInvalidProbs:
      if (op == OpKind::kVerify || op == OpKind::kVerifyTree) {
        return "draft_probs[" + row + ", " + col + "]";
      }
      return s.col >= 0 ? "probs[" + row + ", " + col + "]" : "probs[" + row + "]";
    default:
      return "";
  }
}

// `sizes`: the op's K and V, to spell out the ranges of num_draft and draft_tokens.
void raise_status(const char* op_name, OpKind op, const OpStatus& s, int64_t k = -1,
                  int64_t v = -1) {
  if (s.ok()) return;
  const std::string prefix = std::string(op_name) + ": ";
  switch (s.code) {
    case StatusCode::kCudaError:
      throw std::runtime_error(prefix + "CUDA error: " + s.what);
    case StatusCode::kCudaNotCompiled:
      throw std::runtime_error(prefix +
                               "got CUDA tensors, but this build of verispec has no CUDA "
                               "kernels (rebuild with nvcc on PATH)");
    case StatusCode::kInvalidArgument:
      throw py::value_error(prefix + s.what +
                            (s.has_value ? ", got " + format_value(s.value) : std::string()));
    default: {
      std::string msg = prefix;
      // A per-row value reads as the same value given as a scalar would, plus its row.
      const std::string policy_message =
          s.code == StatusCode::kInvalidPolicy && s.has_value
              ? policy_value_error(static_cast<PolicyField>(s.col), s.value)
              : std::string();
      if (!policy_message.empty()) {
        msg += policy_message;
      } else {
        msg += s.what;
        if (s.code == StatusCode::kNumDraftOutOfRange && k >= 0) msg += " = [0, " + std::to_string(k) + "]";
        if (s.code == StatusCode::kTokenOutOfRange && v >= 0) msg += " = [0, " + std::to_string(v) + ")";
        if (s.has_value) msg += ", got " + format_value(s.value);
      }
      const std::string where = location(op, s);
      if (!where.empty()) msg += " at " + where;
      throw py::value_error(msg);
    }
  }
}

bool on_cuda(const TensorView& v) { return v.device_kind() == DeviceKind::kCUDA; }

// ---- ops ------------------------------------------------------------------------------------

void apply_policy(const py::handle& logits_obj, const py::handle& probs_obj,
                  const py::object& temperature, const py::object& top_k,
                  const py::object& top_p, const py::object& min_p, intptr_t stream,
                  bool check_errors, const py::object& workspace) {
  constexpr const char* op = "apply_policy";
  auto logits = TensorView::from(logits_obj, op, "logits");
  logits.expect({DType::kFloat32, DType::kBFloat16, DType::kFloat16}, {{"N", kAnyDim}, {"V", kAnyDim}})
      .expect_last_dim_contiguous();
  const int64_t n = logits.size(0), v = logits.size(1);
  auto probs = TensorView::from(probs_obj, op, "probs", /*writable=*/true);
  probs.expect({DType::kFloat32}, {{"N", n}, {"V", v}}).expect_last_dim_contiguous();
  expect_same_device({&logits, &probs});
  if (n > 0 && v == 0) throw py::value_error("apply_policy: logits must have V >= 1, got V = 0");
  PolicyViews pv;
  ApplyPolicyArgs a;
  a.logits = logits.raw_data();
  a.logits_dtype = logits_dtype(logits);
  a.logits_row_stride = logits.stride(0);
  a.rows = n;
  a.vocab = v;
  a.policy = policy_params(op, n, logits, temperature, top_k, top_p, min_p, &pv);
  a.probs = probs.data<float>();
  a.probs_row_stride = probs.stride(0);
  const Launch l = make_launch(op, stream, check_errors, workspace, logits);
  OpStatus s;
  {
    py::gil_scoped_release release;
    s = on_cuda(logits) ? apply_policy_cuda(a, cuda_launch(l, logits)) : apply_policy_cpu(a);
  }
  raise_status(op, OpKind::kApplyPolicy, s);
}

void sample(const py::handle& probs_obj, const py::handle& tokens_obj, const py::object& seed,
            const py::object& offset, intptr_t stream, bool check_errors,
            const py::object& workspace, const py::object& row_seeds_obj,
            const py::object& row_positions_obj) {
  constexpr const char* op = "sample";
  auto probs = TensorView::from(probs_obj, op, "probs");
  probs.expect({DType::kFloat32}, {{"N", kAnyDim}, {"V", kAnyDim}}).expect_last_dim_contiguous();
  const int64_t n = probs.size(0), v = probs.size(1);
  auto tokens = TensorView::from(tokens_obj, op, "tokens", /*writable=*/true);
  tokens.expect({DType::kInt32}, {{"N", n}}).expect_contiguous();
  if (row_seeds_obj.is_none() != row_positions_obj.is_none()) {
    throw py::value_error("sample: seeds and positions must be given together (keyed) or "
                          "not at all");
  }
  std::optional<TensorView> row_seeds, row_positions;
  if (!row_seeds_obj.is_none()) {
    row_seeds.emplace(TensorView::from(row_seeds_obj, op, "seeds"));
    row_seeds->expect({DType::kInt64}, {{"N", n}}).expect_contiguous();
    row_positions.emplace(TensorView::from(row_positions_obj, op, "positions"));
    row_positions->expect({DType::kInt64}, {{"N", n}}).expect_contiguous();
  }
  expect_same_device({&probs, &tokens, row_seeds ? &*row_seeds : nullptr,
                      row_positions ? &*row_positions : nullptr});
  if (n > 0 && v == 0) throw py::value_error("sample: probs must have V >= 1, got V = 0");
  RandomViews rv;
  SampleArgs a;
  if (row_seeds) {
    a.row_seeds = row_seeds->data<int64_t>();
    a.row_positions = row_positions->data<int64_t>();
  }
  a.probs = probs.data<float>();
  a.probs_row_stride = probs.stride(0);
  a.rows = n;
  a.vocab = v;
  a.rng = random_params(op, probs, seed, offset, &rv);
  a.tokens = tokens.data<int32_t>();
  const Launch l = make_launch(op, stream, check_errors, workspace, probs);
  OpStatus s;
  {
    py::gil_scoped_release release;
    s = on_cuda(probs) ? sample_cuda(a, cuda_launch(l, probs)) : sample_cpu(a);
  }
  raise_status(op, OpKind::kSample, s);
}

// draft_probs [lead..., W] float32 and, for a compact q (ops.h), draft_index [V] int32 with
// W >= 1 columns; without draft_index, W must be V.
void compact_q_views(const char* op, const py::object& draft_probs_obj,
                     const py::object& draft_index_obj,
                     Dim lead0, Dim lead1, int64_t v, std::optional<TensorView>& q,
                     std::optional<TensorView>& di) {
  if (!draft_index_obj.is_none()) {
    if (draft_probs_obj.is_none()) {
      throw py::value_error(std::string(op) + ": draft_index needs draft_probs, got None");
    }
    di.emplace(TensorView::from(draft_index_obj, op, "draft_index"));
    di->expect({DType::kInt32}, {{"V", v}}).expect_contiguous();
  }
  if (draft_probs_obj.is_none()) return;
  q.emplace(TensorView::from(draft_probs_obj, op, "draft_probs"));
  q->expect({DType::kFloat32}, {lead0, lead1, di ? Dim{"W", kAnyDim} : Dim{"V", v}})
      .expect_last_dim_contiguous();
  if (di && q->size(2) < 1) {
    throw py::value_error(std::string(op) + ": draft_probs must have W >= 1 columns with "
                          "draft_index, got " + q->shape_str());
  }
}

void verify(const py::handle& target_logits_obj, const py::handle& draft_tokens_obj,
            const py::object& draft_probs_obj, const py::object& num_draft_obj,
            const py::handle& tokens_obj, const py::handle& num_emitted_obj,
            const py::handle& num_accepted_obj, const py::object& temperature,
            const py::object& top_k, const py::object& top_p, const py::object& min_p,
            const py::object& seed, const py::object& offset, intptr_t stream,
            bool check_errors, const py::object& workspace, const std::string& method,
            const py::object& draft_index_obj) {
  constexpr const char* op = "verify";
  if (method != "token" && method != "block") {
    throw py::value_error("verify: method must be 'token' or 'block', got '" + method + "'");
  }
  auto logits = TensorView::from(target_logits_obj, op, "target_logits");
  logits.expect({DType::kFloat32, DType::kBFloat16, DType::kFloat16},
                {{"B", kAnyDim}, {"K+1", kAnyDim}, {"V", kAnyDim}})
      .expect_last_dim_contiguous();
  const int64_t b = logits.size(0), k = logits.size(1) - 1, v = logits.size(2);
  if (k < 0) {
    throw py::value_error("verify: target_logits must be [B, K+1, V] with K+1 >= 1, got " +
                          logits.shape_str());
  }
  if (b > 0 && v == 0) throw py::value_error("verify: target_logits must have V >= 1, got V = 0");
  auto drafts = TensorView::from(draft_tokens_obj, op, "draft_tokens");
  drafts.expect({DType::kInt32}, {{"B", b}, {"K", k}}).expect_last_dim_contiguous();
  std::optional<TensorView> q, nd, di;
  compact_q_views(op, draft_probs_obj, draft_index_obj, {"B", b}, {"K", k}, v, q, di);
  if (!num_draft_obj.is_none()) {
    nd.emplace(TensorView::from(num_draft_obj, op, "num_draft"));
    nd->expect({DType::kInt32}, {{"B", b}}).expect_contiguous();
  }
  auto tokens = TensorView::from(tokens_obj, op, "tokens", /*writable=*/true);
  tokens.expect({DType::kInt32}, {{"B", b}, {"K+1", k + 1}}).expect_last_dim_contiguous();
  auto emitted = TensorView::from(num_emitted_obj, op, "num_emitted", true);
  emitted.expect({DType::kInt32}, {{"B", b}}).expect_contiguous();
  auto accepted = TensorView::from(num_accepted_obj, op, "num_accepted", true);
  accepted.expect({DType::kInt32}, {{"B", b}}).expect_contiguous();
  expect_same_device({&logits, &drafts, q ? &*q : nullptr, nd ? &*nd : nullptr, &tokens,
                      &emitted, &accepted, di ? &*di : nullptr});
  PolicyViews pv;
  RandomViews rv;
  VerifyArgs a;
  a.target_logits = logits.raw_data();
  a.target_logits_dtype = logits_dtype(logits);
  a.target_logits_stride_b = logits.stride(0);
  a.target_logits_stride_k = logits.stride(1);
  a.batch = b;
  a.num_spec = k;
  a.vocab = v;
  a.draft_tokens = drafts.data<int32_t>();
  a.draft_tokens_stride_b = drafts.stride(0);
  if (q) {
    a.draft_probs = q->data<float>();
    a.draft_probs_stride_b = q->stride(0);
    a.draft_probs_stride_k = q->stride(1);
  }
  if (di) {
    a.draft_index = di->data<int32_t>();
    a.draft_width = q->size(2);
  }
  a.num_draft = nd ? nd->data<int32_t>() : nullptr;
  a.method = method == "block" ? VerifyMethod::kBlock : VerifyMethod::kToken;
  a.policy = policy_params(op, b, logits, temperature, top_k, top_p, min_p, &pv);
  a.rng = random_params(op, logits, seed, offset, &rv);
  a.tokens = tokens.data<int32_t>();
  a.tokens_stride_b = tokens.stride(0);
  a.num_emitted = emitted.data<int32_t>();
  a.num_accepted = accepted.data<int32_t>();
  const Launch l = make_launch(op, stream, check_errors, workspace, logits);
  OpStatus s;
  {
    py::gil_scoped_release release;
    s = on_cuda(logits) ? verify_cuda(a, cuda_launch(l, logits)) : verify_cpu(a);
  }
  raise_status(op, OpKind::kVerify, s, k, v);
}

void verify_tree(const py::handle& target_logits_obj, const py::handle& tree_tokens_obj,
                 const py::handle& parents_obj, const py::object& draft_probs_obj,
                 const py::object& num_nodes_obj, bool replacement, const py::handle& tokens_obj,
                 const py::handle& num_emitted_obj, const py::handle& accepted_nodes_obj,
                 const py::object& temperature, const py::object& top_k,
                 const py::object& top_p, const py::object& min_p, const py::object& seed,
                 const py::object& offset, intptr_t stream, bool check_errors,
                 const py::object& workspace, const py::object& draft_index_obj) {
  constexpr const char* op = "verify_tree";
  auto logits = TensorView::from(target_logits_obj, op, "target_logits");
  logits.expect({DType::kFloat32, DType::kBFloat16, DType::kFloat16},
                {{"B", kAnyDim}, {"N+1", kAnyDim}, {"V", kAnyDim}})
      .expect_last_dim_contiguous();
  const int64_t b = logits.size(0), n = logits.size(1) - 1, v = logits.size(2);
  if (n < 0) {
    throw py::value_error("verify_tree: target_logits must be [B, N+1, V] with N+1 >= 1, got " +
                          logits.shape_str());
  }
  if (b > 0 && v == 0) {
    throw py::value_error("verify_tree: target_logits must have V >= 1, got V = 0");
  }
  auto tree_tokens = TensorView::from(tree_tokens_obj, op, "tree_tokens");
  tree_tokens.expect({DType::kInt32}, {{"B", b}, {"N", n}}).expect_last_dim_contiguous();
  auto parents = TensorView::from(parents_obj, op, "parents");
  parents.expect({DType::kInt32}, {{"B", b}, {"N", n}}).expect_last_dim_contiguous();
  std::optional<TensorView> q, nn, di;
  compact_q_views(op, draft_probs_obj, draft_index_obj, {"B", b}, {"N+1", n + 1}, v, q, di);
  if (!num_nodes_obj.is_none()) {
    nn.emplace(TensorView::from(num_nodes_obj, op, "num_nodes"));
    nn->expect({DType::kInt32}, {{"B", b}}).expect_contiguous();
  }
  auto tokens = TensorView::from(tokens_obj, op, "tokens", /*writable=*/true);
  tokens.expect({DType::kInt32}, {{"B", b}, {"N+1", n + 1}}).expect_last_dim_contiguous();
  auto emitted = TensorView::from(num_emitted_obj, op, "num_emitted", true);
  emitted.expect({DType::kInt32}, {{"B", b}}).expect_contiguous();
  auto nodes = TensorView::from(accepted_nodes_obj, op, "accepted_nodes", true);
  nodes.expect({DType::kInt32}, {{"B", b}, {"N", n}}).expect_last_dim_contiguous();
  expect_same_device({&logits, &tree_tokens, &parents, q ? &*q : nullptr, nn ? &*nn : nullptr,
                      &tokens, &emitted, &nodes, di ? &*di : nullptr});
  PolicyViews pv;
  RandomViews rv;
  VerifyTreeArgs a;
  a.target_logits = logits.raw_data();
  a.target_logits_dtype = logits_dtype(logits);
  a.target_logits_stride_b = logits.stride(0);
  a.target_logits_stride_n = logits.stride(1);
  a.batch = b;
  a.max_nodes = n;
  a.vocab = v;
  a.tree_tokens = tree_tokens.data<int32_t>();
  a.tree_tokens_stride_b = tree_tokens.stride(0);
  a.parents = parents.data<int32_t>();
  a.parents_stride_b = parents.stride(0);
  if (q) {
    a.draft_probs = q->data<float>();
    a.draft_probs_stride_b = q->stride(0);
    a.draft_probs_stride_n = q->stride(1);
  }
  if (di) {
    a.draft_index = di->data<int32_t>();
    a.draft_width = q->size(2);
  }
  a.num_nodes = nn ? nn->data<int32_t>() : nullptr;
  a.replacement = replacement;
  a.policy = policy_params(op, b, logits, temperature, top_k, top_p, min_p, &pv);
  a.rng = random_params(op, logits, seed, offset, &rv);
  a.tokens = tokens.data<int32_t>();
  a.tokens_stride_b = tokens.stride(0);
  a.num_emitted = emitted.data<int32_t>();
  a.accepted_nodes = nodes.data<int32_t>();
  a.accepted_nodes_stride_b = nodes.stride(0);
  const Launch l = make_launch(op, stream, check_errors, workspace, logits);
  OpStatus s;
  {
    py::gil_scoped_release release;
    s = on_cuda(logits) ? verify_tree_cuda(a, cuda_launch(l, logits)) : verify_tree_cpu(a);
  }
  raise_status(op, OpKind::kVerifyTree, s, n, v);
}

// A device error record left in a workspace by a call with check_errors=False.
void raise_device_error(const std::string& op_name, uint64_t record) {
  OpKind op;
  if (op_name == "apply_policy") op = OpKind::kApplyPolicy;
  else if (op_name == "sample") op = OpKind::kSample;
  else if (op_name == "verify") op = OpKind::kVerify;
  else if (op_name == "verify_tree") op = OpKind::kVerifyTree;
  else throw py::value_error("raise_device_error: op must be apply_policy, sample, verify or verify_tree, got " + op_name);
  raise_status(op_name.c_str(), op, decode_device_error(op, record));
}

}  // namespace

void register_ops(py::module_& m) {
  m.def("apply_policy", &apply_policy, py::arg("logits"), py::arg("probs"),
        py::arg("temperature"), py::arg("top_k"), py::arg("top_p"), py::arg("min_p"),
        py::kw_only(), py::arg("stream") = 0, py::arg("check_errors") = true,
        py::arg("workspace") = py::none(),
        "probs[N, V] (float32, written) = the sampling policy applied to logits[N, V] "
        "(float32/bfloat16/float16). Policy values: numbers or [N] tensors (float32; top_k "
        "int32) on the logits' device.");
  m.def("sample", &sample, py::arg("probs"), py::arg("tokens"), py::arg("seed"),
        py::arg("offset"), py::kw_only(), py::arg("stream") = 0,
        py::arg("check_errors") = true, py::arg("workspace") = py::none(),
        py::arg("row_seeds") = py::none(), py::arg("row_positions") = py::none(),
        "tokens[N] (int32, written) = one inverse-CDF draw per row of probs[N, V] (float32, "
        "need not be normalised) with the Philox coin (seed, offset, row, 0, SAMPLE); keyed "
        "(row_seeds, row_positions: int64 [N]): the exponential race of each row over the "
        "keyed stream of (row_seeds[n], row_positions[n]).");
  m.def("verify", &verify, py::arg("target_logits"), py::arg("draft_tokens"),
        py::arg("draft_probs"), py::arg("num_draft"), py::arg("tokens"), py::arg("num_emitted"),
        py::arg("num_accepted"), py::arg("temperature"), py::arg("top_k"), py::arg("top_p"),
        py::arg("min_p"), py::arg("seed"), py::arg("offset"),
        py::kw_only(), py::arg("stream") = 0, py::arg("check_errors") = true,
        py::arg("workspace") = py::none(), py::arg("method") = "token",
        py::arg("draft_index") = py::none(),
        "Speculative verification (ops.h): writes tokens[B, K+1] (int32, -1 padded), "
        "num_emitted[B] and num_accepted[B] (int32). method: 'token' or 'block' (block "
        "verification of sampled drafts). draft_index: [V] int32, a compact q (draft_probs "
        "[B, K, W] over a draft vocabulary; q(x) = draft_probs[.., draft_index[x]], 0 where "
        "it is -1).");
  m.def("verify_tree", &verify_tree, py::arg("target_logits"), py::arg("tree_tokens"),
        py::arg("parents"), py::arg("draft_probs"), py::arg("num_nodes"), py::arg("replacement"),
        py::arg("tokens"), py::arg("num_emitted"), py::arg("accepted_nodes"),
        py::arg("temperature"), py::arg("top_k"), py::arg("top_p"), py::arg("min_p"),
        py::arg("seed"), py::arg("offset"), py::kw_only(), py::arg("stream") = 0,
        py::arg("check_errors") = true, py::arg("workspace") = py::none(),
        py::arg("draft_index") = py::none(),
        "Tree verification (ops.h): writes tokens[B, N+1] (int32, -1 padded), "
        "num_emitted[B] (int32) and accepted_nodes[B, N] (int32, -1 padded).");
  m.def("check_policy", &check_policy, py::arg("temperature"), py::arg("top_k"),
        py::arg("top_p"), py::arg("min_p"),
        "The sampling policy's argument rule (policy_error, "
        "csrc/include/verispec/policy_rules.h): returns None when every value is in range, "
        "else raises ValueError naming the first bad argument, its range and the value. The "
        "caller prefixes its own name.");
  m.def("apply_policy_workspace_bytes", &apply_policy_cuda_workspace_bytes,
        "Bytes of the CUDA workspace of apply_policy.");
  m.def("sample_workspace_bytes", &sample_cuda_workspace_bytes,
        "Bytes of the CUDA workspace of sample.");
  m.def("verify_workspace_bytes", &verify_cuda_workspace_bytes, py::arg("batch"),
        py::arg("num_spec"), "Bytes of the CUDA workspace of verify for [B, K].");
  m.def("verify_tree_workspace_bytes", &verify_tree_cuda_workspace_bytes, py::arg("batch"),
        py::arg("max_nodes"), py::arg("vocab"),
        "Bytes of the CUDA workspace of verify_tree for B rows of N nodes over V tokens.");
  m.def("raise_device_error", &raise_device_error, py::arg("op"), py::arg("record"),
        "Raises the error of a device error record (a workspace's first 8 bytes as uint64, "
        "after a call with check_errors=False); does nothing if it records none.");
}

}  // namespace verispec

// Bindings of the model layers (csrc/layers/, headers under verispec/layers/): the CPU
// linear layer, the quantized products and their packing, RMS norms, RoPE, SiLU-mul and
// paged decode attention. `linear` and the quantized entry points checked here are the
// public ones (verispec.ops); the `_*_unchecked` entry points take raw pointers and are
// for the model layers' Python side alone (verispec.models), which has checked the
// shapes once per pass. Destination passing like the sampling ops; the GIL is released
// around every kernel.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "bindings.h"
#include "tensor_view.h"
#include "verispec/layers/decode_ops.h"
#include "verispec/layers/linear.h"
#include "verispec/layers/norm.h"
#include "verispec/layers/quant.h"

namespace py = pybind11;

namespace verispec {
namespace {

LinearIsa parse_isa(const std::string& name) {
  for (LinearIsa isa : {LinearIsa::kAuto, LinearIsa::kScalar, LinearIsa::kAvx2, LinearIsa::kAvx512})
    if (name == linear_isa_name(isa)) return isa;
  throw py::value_error("linear: isa must be one of 'auto', 'scalar', 'avx2', 'avx512', got '" +
                        name + "'");
}

void linear(const py::handle& x_obj, const py::handle& w_obj, const py::handle& out_obj,
            int num_threads, const std::string& isa_name, bool own_threads) {
  const LinearIsa isa = parse_isa(isa_name);
  const TensorView x = TensorView::from(x_obj, "linear", "x");
  const TensorView w = TensorView::from(w_obj, "linear", "weight");
  const TensorView out = TensorView::from(out_obj, "linear", "out", /*writable=*/true);
  x.expect({DType::kFloat32}, {{"M", kAnyDim}, {"K", kAnyDim}}).expect_cpu().expect_last_dim_contiguous();
  const int64_t m = x.size(0), k = x.size(1);
  w.expect({DType::kFloat32}, {{"N", kAnyDim}, {"K", k}}).expect_cpu();
  const int64_t n = w.size(0);
  // Either layout of a [N, K] weight: rows contiguous, or columns (w^T row-major).
  const bool w_rows = k <= 1 || w.stride(1) == 1;
  const bool w_cols = !w_rows && (n <= 1 || w.stride(0) == 1);
  if (!w_rows && !w_cols)
    throw py::value_error("linear: weight must have contiguous rows or contiguous columns, got "
                          "strides [" + std::to_string(w.stride(0)) + ", " +
                          std::to_string(w.stride(1)) + "]");
  out.expect({DType::kFloat32}, {{"M", m}, {"N", n}}).expect_cpu().expect_last_dim_contiguous();
  LinearArgs a;
  a.x = x.data<const float>();
  a.w = w.data<const float>();
  a.y = out.data<float>();
  a.m = m;
  a.n = n;
  a.k = k;
  // A size-1 dimension may carry any stride: a row's extent is what the kernel needs.
  a.ldx = m > 1 ? x.stride(0) : k;
  a.weight_kn = w_cols;
  a.ldw = w_cols ? (k > 1 ? w.stride(1) : n) : (n > 1 ? w.stride(0) : k);
  a.ldy = m > 1 ? out.stride(0) : n;
  a.num_threads = num_threads;
  a.isa = isa;
  a.own_threads = own_threads;
  std::string error;
  {
    py::gil_scoped_release release;
    error = linear_f32(a);
  }
  if (!error.empty()) throw py::value_error("linear: " + error);
}

// The model's hot path (verispec.models.llama): no DLPack import per call (three imports
// cost ~10 us, a tenth of a small product). Unchecked beyond what linear_f32 checks: the
// caller passes the data pointers of live float32 CPU tensors of the given sizes.
void linear_unchecked(uintptr_t x, uintptr_t w, uintptr_t out, int64_t m, int64_t n, int64_t k,
                      int64_t ldx, int64_t ldw, int64_t ldy, int num_threads, bool weight_kn) {
  LinearArgs a;
  a.x = reinterpret_cast<const float*>(x);
  a.w = reinterpret_cast<const float*>(w);
  a.y = reinterpret_cast<float*>(out);
  a.m = m;
  a.n = n;
  a.k = k;
  a.ldx = ldx;
  a.ldw = ldw;
  a.ldy = ldy;
  a.num_threads = num_threads;
  a.weight_kn = weight_kn;
  if (m > 0 && n > 0 && (out == 0 || (k > 0 && (x == 0 || w == 0))))
    throw py::value_error("linear: null data pointer");
  std::string error;
  {
    py::gil_scoped_release release;
    error = linear_f32(a);
  }
  if (!error.empty()) throw py::value_error("linear: " + error);
}

// RMSNorm for the model's hot path, unchecked like linear_unchecked (float32 CPU rows).
void rms_norm_unchecked(uintptr_t x, int64_t rows, int64_t dim, int64_t ldx, uintptr_t w,
                        double eps, uintptr_t out, int64_t ldy) {
  if (rows > 0 && (x == 0 || w == 0 || out == 0)) throw py::value_error("rms_norm: null data pointer");
  const std::string error =
      rms_norm_f32(reinterpret_cast<const float*>(x), rows, dim, ldx,
                   reinterpret_cast<const float*>(w), static_cast<float>(eps),
                   reinterpret_cast<float*>(out), ldy);
  if (!error.empty()) throw py::value_error("rms_norm: " + error);
}

// The rest of a decoder layer's hot path (verispec.models.llama), on raw pointers to
// live float32 CPU tensors like the above; each checks sizes, indices and positions.
void add_rms_norm_unchecked(uintptr_t x, int64_t rows, int64_t dim, int64_t ldx, uintptr_t delta,
                            int64_t ldd, uintptr_t w, double eps, uintptr_t out, int64_t ldy) {
  if (rows > 0 && (x == 0 || delta == 0 || w == 0 || out == 0))
    throw py::value_error("add_rms_norm: null data pointer");
  const std::string error = add_rms_norm_f32(
      reinterpret_cast<float*>(x), rows, dim, ldx, reinterpret_cast<const float*>(delta), ldd,
      reinterpret_cast<const float*>(w), static_cast<float>(eps), reinterpret_cast<float*>(out), ldy);
  if (!error.empty()) throw py::value_error("add_rms_norm: " + error);
}

void rope_kv_write_unchecked(uintptr_t qkv, int64_t ldqkv, int64_t tokens, int64_t num_heads,
                             int64_t num_kv_heads, int64_t head_dim, uintptr_t positions,
                             uintptr_t cos, uintptr_t sin, int64_t max_position, uintptr_t slots,
                             uintptr_t k_pool, uintptr_t v_pool, int64_t num_slots,
                             uintptr_t q_out, const std::string& isa) {
  RopeKvArgs a;
  a.qkv = reinterpret_cast<const float*>(qkv);
  a.ldqkv = ldqkv;
  a.tokens = tokens;
  a.num_heads = num_heads;
  a.num_kv_heads = num_kv_heads;
  a.head_dim = head_dim;
  a.positions = reinterpret_cast<const int64_t*>(positions);
  a.cos = reinterpret_cast<const float*>(cos);
  a.sin = reinterpret_cast<const float*>(sin);
  a.max_position = max_position;
  a.slots = reinterpret_cast<const int32_t*>(slots);
  a.k_pool = reinterpret_cast<float*>(k_pool);
  a.v_pool = reinterpret_cast<float*>(v_pool);
  a.num_slots = num_slots;
  a.q_out = reinterpret_cast<float*>(q_out);
  a.isa = parse_isa(isa);
  const std::string error = rope_kv_write_f32(a);
  if (!error.empty()) throw py::value_error(error);
}

// A forward's batch as the attention kernel reads it (the index tensors' pointers).
PagedAttentionArgs batch_attention_args(int64_t num_slots, int64_t tokens, int64_t num_heads,
                                        int64_t num_kv_heads, int64_t head_dim, int64_t rows,
                                        uintptr_t query_start, uintptr_t positions,
                                        uintptr_t context_lens, uintptr_t block_tables,
                                        int64_t table_stride, int64_t table_width,
                                        uintptr_t tree_mask, int64_t block_size, double scale,
                                        int num_threads) {
  PagedAttentionArgs a;
  a.num_slots = num_slots;
  a.tokens = tokens;
  a.num_heads = num_heads;
  a.num_kv_heads = num_kv_heads;
  a.head_dim = head_dim;
  a.rows = rows;
  a.query_start = reinterpret_cast<const int64_t*>(query_start);
  a.positions = reinterpret_cast<const int64_t*>(positions);
  a.context_lens = reinterpret_cast<const int32_t*>(context_lens);
  a.block_tables = reinterpret_cast<const int32_t*>(block_tables);
  a.tree_mask = reinterpret_cast<const uint8_t*>(tree_mask);
  a.table_stride = table_stride;
  a.table_width = table_width;
  a.block_size = block_size;
  a.scale = static_cast<float>(scale);
  a.num_threads = num_threads;
  return a;
}

void paged_attention_unchecked(uintptr_t q, uintptr_t k_pool, uintptr_t v_pool, int64_t num_slots,
                               int64_t tokens, int64_t num_heads, int64_t num_kv_heads,
                               int64_t head_dim, int64_t rows, uintptr_t query_start,
                               uintptr_t positions, uintptr_t context_lens,
                               uintptr_t block_tables, int64_t table_stride, int64_t table_width,
                               uintptr_t tree_mask, int64_t block_size, double scale,
                               uintptr_t out, int64_t max_queries, int num_threads,
                               const std::string& isa, bool check_only, int64_t window,
                               bool share_keys) {
  PagedAttentionArgs a = batch_attention_args(
      num_slots, tokens, num_heads, num_kv_heads, head_dim, rows, query_start, positions,
      context_lens, block_tables, table_stride, table_width, tree_mask, block_size, scale,
      num_threads);
  a.q = reinterpret_cast<const float*>(q);
  a.k_pool = reinterpret_cast<const float*>(k_pool);
  a.v_pool = reinterpret_cast<const float*>(v_pool);
  a.out = reinterpret_cast<float*>(out);
  a.max_queries = max_queries;
  a.isa = parse_isa(isa);
  a.check_only = check_only;
  a.window = window;
  a.share_keys = share_keys;
  std::string error;
  {
    py::gil_scoped_release release;
    error = paged_attention_f32(a);
  }
  if (!error.empty()) throw py::value_error(error);
}

void silu_mul_unchecked(uintptr_t gate_up, int64_t rows, int64_t inter, int64_t ld, uintptr_t out,
                        int64_t ldo, const std::string& isa) {
  const std::string error = silu_mul_f32(reinterpret_cast<const float*>(gate_up), rows, inter, ld,
                                         reinterpret_cast<float*>(out), ldo, parse_isa(isa));
  if (!error.empty()) throw py::value_error(error);
}

QuantType parse_quant_type(const char* fn, int type_id) {
  if (!quant_type_supported(type_id)) {
    std::string ids;
    for (QuantType t : kQuantTypes)
      ids += (ids.empty() ? "" : ", ") + std::to_string(static_cast<int>(t)) + " " + quant_type_name(t);
    throw py::value_error(std::string(fn) + ": quant_type must be a supported ggml type id (" + ids +
                          "), got " + std::to_string(type_id));
  }
  return static_cast<QuantType>(type_id);
}

// A quantized Llama's decoder layers, bound once (weights' data pointers: the Python
// owner keeps the tensors alive) and run per forward by decode_layers_f32.
class QuantDecodeLayers {
 public:
  // layers: [(attn_norm_ptr, mlp_norm_ptr, wqkv, wo, gate_up, down)], a matrix being
  // (n, k, [(quant_type, data_ptr, rows, row_bytes[, packed]), ...]) (packed: the part is
  // in QuantLayout::kPacked16, row_bytes then unused; absent: the file's layout).
  explicit QuantDecodeLayers(const py::list& layers) {
    for (const py::handle& item : layers) {
      const py::tuple layer = py::reinterpret_borrow<py::tuple>(item);
      if (layer.size() != 6) throw py::value_error("_QuantDecodeLayers: a layer is 6 entries");
      QuantLayerRef ref;
      ref.attn_norm = reinterpret_cast<const float*>(layer[0].cast<uintptr_t>());
      ref.mlp_norm = reinterpret_cast<const float*>(layer[1].cast<uintptr_t>());
      QuantMatrixRef* mats[4] = {&ref.wqkv, &ref.wo, &ref.gate_up, &ref.down};
      for (int i = 0; i < 4; ++i) {
        const py::tuple m = layer[2 + i].cast<py::tuple>();
        mats[i]->n = m[0].cast<int64_t>();
        mats[i]->k = m[1].cast<int64_t>();
        const py::list parts = m[2].cast<py::list>();
        if (parts.size() < 1 || parts.size() > QuantMatrixRef::kMaxParts)
          throw py::value_error("_QuantDecodeLayers: a matrix has 1.." +
                                std::to_string(QuantMatrixRef::kMaxParts) + " parts, got " +
                                std::to_string(parts.size()));
        mats[i]->parts = static_cast<int>(parts.size());
        for (size_t p = 0; p < parts.size(); ++p) {
          const py::tuple part = parts[p].cast<py::tuple>();
          mats[i]->type[p] = parse_quant_type("_QuantDecodeLayers", part[0].cast<int>());
          mats[i]->data[p] = reinterpret_cast<const uint8_t*>(part[1].cast<uintptr_t>());
          mats[i]->rows[p] = part[2].cast<int64_t>();
          mats[i]->ldw[p] = part[3].cast<int64_t>();
          if (part.size() != 4 && part.size() != 5)
            throw py::value_error("_QuantDecodeLayers: a part is (quant_type, data_ptr, rows, "
                                  "row_bytes[, packed]), got " + std::to_string(part.size()) + " entries");
          mats[i]->layout[p] = part.size() == 5 && part[4].cast<bool>() ? QuantLayout::kPacked16
                                                                        : QuantLayout::kRows;
        }
      }
      layers_.push_back(ref);
    }
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  void run(uintptr_t x, int64_t tokens, int64_t hidden, int64_t inter, double eps,
           const std::vector<uintptr_t>& k_pools, const std::vector<uintptr_t>& v_pools,
           int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, uintptr_t positions,
           uintptr_t cos, uintptr_t sin, int64_t max_position, uintptr_t slots, int64_t num_slots,
           int64_t rows, uintptr_t query_start, uintptr_t context_lens, uintptr_t block_tables,
           int64_t table_stride, int64_t table_width, uintptr_t tree_mask, int64_t block_size,
           double scale, int num_threads, bool int8) {
    if (k_pools.size() != layers_.size() || v_pools.size() != layers_.size())
      throw py::value_error("decode_layers: expected " + std::to_string(layers_.size()) +
                            " K and V pools, got " + std::to_string(k_pools.size()) + " and " +
                            std::to_string(v_pools.size()));
    std::vector<float*> kp, vp;
    for (size_t i = 0; i < layers_.size(); ++i) {
      kp.push_back(reinterpret_cast<float*>(k_pools[i]));
      vp.push_back(reinterpret_cast<float*>(v_pools[i]));
    }
    DecodeLayersArgs a;
    a.x = reinterpret_cast<float*>(x);
    a.tokens = tokens;
    a.hidden = hidden;
    a.inter = inter;
    a.eps = static_cast<float>(eps);
    a.layers = layers_.data();
    a.num_layers = num_layers();
    a.k_pools = kp.data();
    a.v_pools = vp.data();
    a.rope.tokens = tokens;
    a.rope.num_heads = num_heads;
    a.rope.num_kv_heads = num_kv_heads;
    a.rope.head_dim = head_dim;
    a.rope.positions = reinterpret_cast<const int64_t*>(positions);
    a.rope.cos = reinterpret_cast<const float*>(cos);
    a.rope.sin = reinterpret_cast<const float*>(sin);
    a.rope.max_position = max_position;
    a.rope.slots = reinterpret_cast<const int32_t*>(slots);
    a.rope.num_slots = num_slots;
    a.attention = batch_attention_args(num_slots, tokens, num_heads, num_kv_heads, head_dim,
                                       rows, query_start, positions, context_lens, block_tables,
                                       table_stride, table_width, tree_mask, block_size, scale,
                                       num_threads);
    a.num_threads = num_threads;
    a.arith = int8 ? QuantArith::kInt8 : QuantArith::kFloat;
    std::string error;
    {
      py::gil_scoped_release release;
      error = decode_layers_f32(a);
    }
    if (!error.empty()) throw py::value_error(error);
  }

 private:
  std::vector<QuantLayerRef> layers_;
};

// The uint8 weight of a quantized [N, K] matrix: [N, row_bytes] with rows contiguous
// (packed_rows < 0), or packed (QuantLayout::kPacked16) [ceil(N / 16), 16 row_bytes]
// contiguous holding N = packed_rows rows. Returns N.
int64_t expect_quant_weight(const char* fn, const TensorView& w, QuantType type, int64_t k,
                            int64_t packed_rows) {
  const int64_t row_bytes = k / quant_block_elems(type) * quant_block_bytes(type);
  if (packed_rows < 0) {
    w.expect({DType::kUInt8}, {{"N", kAnyDim}, {"row_bytes", row_bytes}}).expect_cpu()
        .expect_last_dim_contiguous();
    return w.size(0);
  }
  const int64_t groups = (packed_rows + kQuantPackRows - 1) / kQuantPackRows;
  w.expect({DType::kUInt8}, {{"groups", groups}, {"16 * row_bytes", kQuantPackRows * row_bytes}})
      .expect_cpu().expect_contiguous();
  (void)fn;
  return packed_rows;
}

QuantArith parse_arith(const char* fn, const std::string& name) {
  if (name == "int8") return QuantArith::kInt8;
  if (name == "float") return QuantArith::kFloat;
  throw py::value_error(std::string(fn) + ": arithmetic must be 'int8' or 'float', got '" + name + "'");
}

void quant_linear(const py::handle& x_obj, const py::handle& w_obj, int type_id,
                  const py::handle& out_obj, int num_threads, const std::string& isa_name,
                  bool own_threads, const std::string& arith_name, int64_t packed_rows) {
  const QuantArith arith = parse_arith("quant_linear", arith_name);
  const QuantType type = parse_quant_type("quant_linear", type_id);
  const LinearIsa isa = parse_isa(isa_name);
  const TensorView x = TensorView::from(x_obj, "quant_linear", "x");
  x.expect({DType::kFloat32}, {{"M", kAnyDim}, {"K", kAnyDim}}).expect_cpu().expect_last_dim_contiguous();
  const int64_t m = x.size(0), k = x.size(1);
  if (k % quant_block_elems(type) != 0)
    throw py::value_error("quant_linear: K must be a multiple of " +
                          std::string(quant_type_name(type)) + "'s block of " +
                          std::to_string(quant_block_elems(type)) + " weights, got K = " +
                          std::to_string(k));
  const TensorView w = TensorView::from(w_obj, "quant_linear", "weight");
  const int64_t n = expect_quant_weight("quant_linear", w, type, k, packed_rows);
  const TensorView out = TensorView::from(out_obj, "quant_linear", "out", /*writable=*/true);
  out.expect({DType::kFloat32}, {{"M", m}, {"N", n}}).expect_cpu().expect_last_dim_contiguous();
  QuantLinearArgs a;
  a.x = x.data<const float>();
  a.w = w.data<const uint8_t>();
  a.y = out.data<float>();
  a.m = m;
  a.n = n;
  a.k = k;
  a.ldx = m > 1 ? x.stride(0) : k;
  a.ldw = packed_rows >= 0 ? 0 : n > 1 ? w.stride(0) : w.size(1);
  a.layout = packed_rows >= 0 ? QuantLayout::kPacked16 : QuantLayout::kRows;
  a.ldy = m > 1 ? out.stride(0) : n;
  a.type = type;
  a.num_threads = num_threads;
  a.isa = isa;
  a.own_threads = own_threads;
  a.arith = arith;
  std::string error;
  {
    py::gil_scoped_release release;
    error = quant_linear_f32(a);
  }
  if (!error.empty()) throw py::value_error("quant_linear: " + error);
}

// verispec.models.llama's hot path, unchecked like linear_unchecked.
void quant_linear_unchecked(uintptr_t x, uintptr_t w, uintptr_t out, int64_t m, int64_t n,
                            int64_t k, int64_t ldx, int64_t ldw, int64_t ldy, int type_id,
                            int num_threads, bool int8, bool packed) {
  QuantLinearArgs a;
  a.x = reinterpret_cast<const float*>(x);
  a.w = reinterpret_cast<const uint8_t*>(w);
  a.y = reinterpret_cast<float*>(out);
  a.m = m;
  a.n = n;
  a.k = k;
  a.ldx = ldx;
  a.ldw = ldw;
  a.layout = packed ? QuantLayout::kPacked16 : QuantLayout::kRows;
  a.ldy = ldy;
  a.type = parse_quant_type("quant_linear", type_id);
  a.num_threads = num_threads;
  a.arith = int8 ? QuantArith::kInt8 : QuantArith::kFloat;
  if (m > 0 && n > 0 && (out == 0 || (k > 0 && (x == 0 || w == 0))))
    throw py::value_error("quant_linear: null data pointer");
  std::string error;
  {
    py::gil_scoped_release release;
    error = quant_linear_f32(a);
  }
  if (!error.empty()) throw py::value_error("quant_linear: " + error);
}

void quant_dequantize(const py::handle& w_obj, int type_id, int64_t k, const py::handle& rows_obj,
                      const py::handle& out_obj, const std::string& isa_name, int64_t packed_rows) {
  const QuantType type = parse_quant_type("quant_dequantize", type_id);
  const LinearIsa isa = parse_isa(isa_name);
  if (k <= 0 || k % quant_block_elems(type) != 0)
    throw py::value_error("quant_dequantize: k must be a positive multiple of " +
                          std::to_string(quant_block_elems(type)) + " for " +
                          quant_type_name(type) + ", got " + std::to_string(k));
  const TensorView w = TensorView::from(w_obj, "quant_dequantize", "weight");
  const int64_t n = expect_quant_weight("quant_dequantize", w, type, k, packed_rows);
  const int64_t* rows = nullptr;
  int64_t count = n;
  if (!rows_obj.is_none()) {
    const TensorView r = TensorView::from(rows_obj, "quant_dequantize", "rows");
    r.expect({DType::kInt64}, {{"R", kAnyDim}}).expect_cpu().expect_last_dim_contiguous();
    rows = r.data<const int64_t>();
    count = r.size(0);
  }
  const TensorView out = TensorView::from(out_obj, "quant_dequantize", "out", /*writable=*/true);
  out.expect({DType::kFloat32}, {{"R", count}, {"K", k}}).expect_cpu().expect_last_dim_contiguous();
  std::string error;
  {
    py::gil_scoped_release release;
    error = quant_dequantize_rows(type, w.data<const uint8_t>(), n, k,
                                  packed_rows >= 0 ? 0 : n > 1 ? w.stride(0) : w.size(1), rows,
                                  count, out.data<float>(), count > 1 ? out.stride(0) : k, isa,
                                  packed_rows >= 0 ? QuantLayout::kPacked16 : QuantLayout::kRows);
  }
  if (!error.empty()) throw py::value_error("quant_dequantize: " + error);
}

// out (uint8 [ceil(N / 16), 16 row_bytes]) = weight (uint8 [N, row_bytes]) packed.
void quant_pack16_py(const py::handle& w_obj, int type_id, int64_t k, const py::handle& out_obj) {
  const QuantType type = parse_quant_type("quant_pack16", type_id);
  if (k <= 0 || k % quant_block_elems(type) != 0)
    throw py::value_error("quant_pack16: k must be a positive multiple of " +
                          std::to_string(quant_block_elems(type)) + " for " +
                          quant_type_name(type) + ", got " + std::to_string(k));
  const TensorView w = TensorView::from(w_obj, "quant_pack16", "weight");
  const int64_t n = expect_quant_weight("quant_pack16", w, type, k, -1);
  const TensorView out = TensorView::from(out_obj, "quant_pack16", "out", /*writable=*/true);
  expect_quant_weight("quant_pack16", out, type, k, n);
  std::string error;
  {
    py::gil_scoped_release release;
    error = quant_pack16(type, w.data<const uint8_t>(), n, k, n > 1 ? w.stride(0) : w.size(1),
                         out.data<uint8_t>());
  }
  if (!error.empty()) throw py::value_error("quant_pack16: " + error);
}

// out (uint8 [N, row_bytes]) = the N rows of packed (uint8 [ceil(N / 16), 16 row_bytes]).
void quant_unpack16_py(const py::handle& p_obj, int type_id, int64_t k, int64_t n,
                       const py::handle& out_obj) {
  const QuantType type = parse_quant_type("quant_unpack16", type_id);
  if (k <= 0 || k % quant_block_elems(type) != 0)
    throw py::value_error("quant_unpack16: k must be a positive multiple of " +
                          std::to_string(quant_block_elems(type)) + " for " +
                          quant_type_name(type) + ", got " + std::to_string(k));
  if (n < 0) throw py::value_error("quant_unpack16: n must be >= 0, got " + std::to_string(n));
  const TensorView p = TensorView::from(p_obj, "quant_unpack16", "packed");
  expect_quant_weight("quant_unpack16", p, type, k, n);
  const TensorView out = TensorView::from(out_obj, "quant_unpack16", "out", /*writable=*/true);
  const int64_t rows = expect_quant_weight("quant_unpack16", out, type, k, -1);
  if (rows != n)
    throw py::value_error("quant_unpack16: out must have N = " + std::to_string(n) + " rows, got " +
                          std::to_string(rows));
  std::string error;
  {
    py::gil_scoped_release release;
    error = quant_unpack16(type, p.data<const uint8_t>(), n, k, 0, n, out.data<uint8_t>(),
                           n > 1 ? out.stride(0) : out.size(1));
  }
  if (!error.empty()) throw py::value_error("quant_unpack16: " + error);
}

py::dict quant_formats() {
  py::dict d;
  for (QuantType t : kQuantTypes)
    d[py::str(quant_type_name(t))] =
        py::make_tuple(static_cast<int>(t), quant_block_elems(t), quant_block_bytes(t));
  return d;
}

std::vector<std::string> supported_isas() {
  std::vector<std::string> names;
  for (LinearIsa isa : {LinearIsa::kScalar, LinearIsa::kAvx2, LinearIsa::kAvx512})
    if (linear_isa_supported(isa)) names.emplace_back(linear_isa_name(isa));
  return names;
}

}  // namespace

void write_attend_unchecked(uintptr_t q, int64_t q_head_stride, int64_t q_token_stride,
                            uintptr_t k, int64_t k_head_stride, int64_t k_token_stride,
                            uintptr_t v, int64_t v_head_stride, int64_t v_token_stride,
                            uintptr_t slots, uintptr_t k_pool, uintptr_t v_pool,
                            int64_t num_slots, int64_t tokens, int64_t num_heads,
                            int64_t num_kv_heads, int64_t head_dim, int64_t rows,
                            uintptr_t query_start, uintptr_t positions, uintptr_t context_lens,
                            uintptr_t block_tables, int64_t table_stride, int64_t table_width,
                            uintptr_t tree_mask, int64_t block_size, double scale, uintptr_t out,
                            int num_threads, int64_t window) {
  WriteAttendArgs w;
  w.attention = batch_attention_args(num_slots, tokens, num_heads, num_kv_heads, head_dim, rows,
                                     query_start, positions, context_lens, block_tables,
                                     table_stride, table_width, tree_mask, block_size, scale,
                                     num_threads);
  w.attention.out = reinterpret_cast<float*>(out);
  w.attention.window = window;
  w.q = {reinterpret_cast<const float*>(q), q_head_stride, q_token_stride};
  w.k = {reinterpret_cast<const float*>(k), k_head_stride, k_token_stride};
  w.v = {reinterpret_cast<const float*>(v), v_head_stride, v_token_stride};
  w.slots = reinterpret_cast<const int32_t*>(slots);
  w.k_pool = reinterpret_cast<float*>(k_pool);
  w.v_pool = reinterpret_cast<float*>(v_pool);
  std::string error;
  {
    py::gil_scoped_release release;
    error = write_attend_f32(w);
  }
  if (!error.empty()) throw py::value_error(error);
}

void rotate_half_rope_unchecked(uintptr_t q, int64_t q_head_stride, int64_t q_token_stride,
                                int64_t num_heads, uintptr_t k, int64_t k_head_stride,
                                int64_t k_token_stride, int64_t num_kv_heads, int64_t tokens,
                                int64_t head_dim, uintptr_t cos, uintptr_t sin, int64_t cs_stride,
                                uintptr_t q_out, uintptr_t k_out) {
  RotateHalfArgs a;
  a.q = {reinterpret_cast<const float*>(q), q_head_stride, q_token_stride};
  a.k = {reinterpret_cast<const float*>(k), k_head_stride, k_token_stride};
  a.num_heads = num_heads;
  a.num_kv_heads = num_kv_heads;
  a.tokens = tokens;
  a.head_dim = head_dim;
  a.cos = reinterpret_cast<const float*>(cos);
  a.sin = reinterpret_cast<const float*>(sin);
  a.cs_stride = cs_stride;
  a.q_out = reinterpret_cast<float*>(q_out);
  a.k_out = reinterpret_cast<float*>(k_out);
  const std::string error = rotate_half_rope_f32(a);
  if (!error.empty()) throw py::value_error(error);
}

void register_layers(py::module_& m) {
  m.def("linear", &linear, py::arg("x"), py::arg("weight"), py::arg("out"),
        py::arg("num_threads"), py::arg("isa") = "auto", py::arg("own_threads") = false,
        "out[M, N] = x[M, K] @ weight[N, K]^T (float32, CPU); see verispec.ops.linear");
  m.def("_linear_unchecked", &linear_unchecked, py::arg("x_ptr"), py::arg("w_ptr"),
        py::arg("out_ptr"), py::arg("m"), py::arg("n"), py::arg("k"), py::arg("ldx"),
        py::arg("ldw"), py::arg("ldy"), py::arg("num_threads"), py::arg("weight_kn") = false,
        "linear on raw float32 CPU pointers (verispec.models.llama's hot path; no checks)");
  m.def("_rms_norm_unchecked", &rms_norm_unchecked, py::arg("x_ptr"), py::arg("rows"),
        py::arg("dim"), py::arg("ldx"), py::arg("w_ptr"), py::arg("eps"), py::arg("out_ptr"),
        py::arg("ldy"), "RMSNorm on raw float32 CPU pointers (verispec.models.llama; no checks)");
  m.def("_add_rms_norm_unchecked", &add_rms_norm_unchecked, py::arg("x_ptr"), py::arg("rows"),
        py::arg("dim"), py::arg("ldx"), py::arg("delta_ptr"), py::arg("ldd"), py::arg("w_ptr"),
        py::arg("eps"), py::arg("out_ptr"), py::arg("ldy"),
        "x += delta, out = RMSNorm(x) on raw float32 CPU pointers (verispec.models.llama)");
  m.def("_rope_kv_write_unchecked", &rope_kv_write_unchecked, py::arg("qkv_ptr"),
        py::arg("ldqkv"), py::arg("tokens"), py::arg("num_heads"), py::arg("num_kv_heads"),
        py::arg("head_dim"), py::arg("positions_ptr"), py::arg("cos_ptr"), py::arg("sin_ptr"),
        py::arg("max_position"), py::arg("slots_ptr"), py::arg("k_pool_ptr"),
        py::arg("v_pool_ptr"), py::arg("num_slots"), py::arg("q_out_ptr"), py::arg("isa") = "auto",
        "RoPE of q and k, k and v written to the cache slots (verispec/layers/decode_ops.h)");
  m.def("_paged_attention_unchecked", &paged_attention_unchecked, py::arg("q_ptr"),
        py::arg("k_pool_ptr"), py::arg("v_pool_ptr"), py::arg("num_slots"), py::arg("tokens"),
        py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("rows"),
        py::arg("query_start_ptr"), py::arg("positions_ptr"), py::arg("context_lens_ptr"),
        py::arg("block_tables_ptr"), py::arg("table_stride"), py::arg("table_width"),
        py::arg("tree_mask_ptr"), py::arg("block_size"), py::arg("scale"), py::arg("out_ptr"),
        py::arg("max_queries"), py::arg("num_threads"), py::arg("isa") = "auto",
        py::arg("check_only") = false, py::arg("window") = 0, py::arg("share_keys") = true,
        "attention of new tokens over the paged cache (verispec/layers/decode_ops.h)");
  m.def("_write_attend_unchecked", &write_attend_unchecked, py::arg("q_ptr"),
        py::arg("q_head_stride"), py::arg("q_token_stride"), py::arg("k_ptr"),
        py::arg("k_head_stride"), py::arg("k_token_stride"), py::arg("v_ptr"),
        py::arg("v_head_stride"), py::arg("v_token_stride"), py::arg("slots_ptr"),
        py::arg("k_pool_ptr"), py::arg("v_pool_ptr"), py::arg("num_slots"), py::arg("tokens"),
        py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("rows"),
        py::arg("query_start_ptr"), py::arg("positions_ptr"), py::arg("context_lens_ptr"),
        py::arg("block_tables_ptr"), py::arg("table_stride"), py::arg("table_width"),
        py::arg("tree_mask_ptr"), py::arg("block_size"), py::arg("scale"), py::arg("out_ptr"),
        py::arg("num_threads"), py::arg("window") = 0,
        "strided new tokens' K/V written to the cache, then their attention "
        "(verispec/layers/decode_ops.h write_attend_f32; verispec.models.HFModel's hot path)");
  m.def("_rotate_half_rope_unchecked", &rotate_half_rope_unchecked, py::arg("q_ptr"),
        py::arg("q_head_stride"), py::arg("q_token_stride"), py::arg("num_heads"),
        py::arg("k_ptr"), py::arg("k_head_stride"), py::arg("k_token_stride"),
        py::arg("num_kv_heads"), py::arg("tokens"), py::arg("head_dim"), py::arg("cos_ptr"),
        py::arg("sin_ptr"), py::arg("cs_stride"), py::arg("q_out_ptr"), py::arg("k_out_ptr"),
        "transformers' rotate-half RoPE of strided queries and keys, bit for bit "
        "(verispec/layers/decode_ops.h rotate_half_rope_f32; verispec.models.HFModel)");
  m.def("_silu_mul_unchecked", &silu_mul_unchecked, py::arg("gate_up_ptr"), py::arg("rows"),
        py::arg("inter"), py::arg("ld"), py::arg("out_ptr"), py::arg("ldo"), py::arg("isa") = "auto",
        "out = silu(gate) * up of a fused [rows, 2 inter] product (verispec/layers/decode_ops.h)");
  py::class_<QuantDecodeLayers>(m, "_QuantDecodeLayers",
                                "a quantized Llama's decoder layers run in one native call "
                                "(verispec.models.llama; decode_layers_f32)")
      .def(py::init<const py::list&>(), py::arg("layers"))
      .def_property_readonly("num_layers", &QuantDecodeLayers::num_layers)
      .def("run", &QuantDecodeLayers::run, py::arg("x_ptr"), py::arg("tokens"),
           py::arg("hidden"), py::arg("inter"), py::arg("eps"), py::arg("k_pools"),
           py::arg("v_pools"), py::arg("num_heads"), py::arg("num_kv_heads"),
           py::arg("head_dim"), py::arg("positions_ptr"), py::arg("cos_ptr"), py::arg("sin_ptr"),
           py::arg("max_position"), py::arg("slots_ptr"), py::arg("num_slots"), py::arg("rows"),
           py::arg("query_start_ptr"), py::arg("context_lens_ptr"), py::arg("block_tables_ptr"),
           py::arg("table_stride"), py::arg("table_width"), py::arg("tree_mask_ptr"),
           py::arg("block_size"), py::arg("scale"), py::arg("num_threads"), py::arg("int8"));
  m.def("decode_exp", &decode_exp, py::arg("x"),
        "exp(x) as the decode ops compute it (tests compare against it)");
  m.def("quant_linear", &quant_linear, py::arg("x"), py::arg("weight"), py::arg("quant_type"),
        py::arg("out"), py::arg("num_threads"), py::arg("isa") = "auto",
        py::arg("own_threads") = false, py::arg("arithmetic") = "int8", py::arg("packed_rows") = -1,
        "out[M, N] = x[M, K] @ dequant(weight)[N, K]^T, weight uint8 [N, row_bytes] in ggml "
        "blocks (CPU), or packed_rows >= 0: weight packed by quant_pack16 holding N = "
        "packed_rows rows; see verispec.ops.quant_linear");
  m.def("_quant_linear_unchecked", &quant_linear_unchecked, py::arg("x_ptr"), py::arg("w_ptr"),
        py::arg("out_ptr"), py::arg("m"), py::arg("n"), py::arg("k"), py::arg("ldx"),
        py::arg("ldw"), py::arg("ldy"), py::arg("quant_type"), py::arg("num_threads"),
        py::arg("int8") = true, py::arg("packed") = false,
        "quant_linear on raw CPU pointers (verispec.models.llama's hot path; no checks)");
  m.def("quant_dequantize", &quant_dequantize, py::arg("weight"), py::arg("quant_type"),
        py::arg("k"), py::arg("rows"), py::arg("out"), py::arg("isa") = "auto", py::arg("packed_rows") = -1,
        "out[R, K] = float32 weights of rows (int64 [R], or None: all) of a quantized matrix "
        "(packed_rows >= 0: weight packed by quant_pack16, holding that many rows)");
  m.def("quant_pack16", &quant_pack16_py, py::arg("weight"), py::arg("quant_type"), py::arg("k"),
        py::arg("out"),
        "out (uint8 [ceil(N / 16), 16 * row_bytes]) = weight (uint8 [N, row_bytes]) in the "
        "packed layout the int8 kernel reads (16 rows' fields side by side; verispec/layers/quant.h)");
  m.def("quant_unpack16", &quant_unpack16_py, py::arg("packed"), py::arg("quant_type"), py::arg("k"),
        py::arg("n"), py::arg("out"),
        "out (uint8 [N, row_bytes]) = the N rows of a packed matrix in the file's layout");
  m.attr("QUANT_PACK_ROWS") = kQuantPackRows;
  m.def("quant_int8_path", [](const std::string& isa) {
          return std::string(quant_int8_path_name(parse_isa(isa)));
        }, py::arg("isa") = "auto",
        "the int8 quantized kernel's code path for isa (auto: the best): avx512-vnni, avx-vnni, "
        "avx2-maddubs or scalar (all compute the same bits)");
  m.def("_quant_int8_force_path", [](const std::string& name) {
          const std::string error = quant_int8_force_path(name);
          if (!error.empty()) throw py::value_error("_quant_int8_force_path: " + error);
        }, py::arg("name"),
        "tests: run every int8 quantized product on the named path ('' undoes it)");
  m.def("quant_formats", &quant_formats,
        "{name: (ggml type id, weights per block, bytes per block)} of the quantized kernels");
  m.def("linear_isas", &supported_isas, "instruction sets the linear kernel can use here");
  m.def("linear_best_isa", [] { return std::string(linear_isa_name(linear_best_isa())); },
        "the instruction set isa='auto' uses");
  m.def("read_stream",
        [](const py::handle& buf_obj, int num_threads) {
          const TensorView buf = TensorView::from(buf_obj, "read_stream", "buffer");
          buf.expect({DType::kUInt8}, {{"bytes", kAnyDim}}).expect_cpu().expect_contiguous();
          if (num_threads < 1)
            throw py::value_error("read_stream: num_threads must be >= 1, got " +
                                  std::to_string(num_threads));
          py::gil_scoped_release release;
          return read_stream(buf.raw_data(), buf.size(0), num_threads);
        },
        py::arg("buffer"), py::arg("num_threads"),
        "reads a 1-D contiguous uint8 CPU tensor once on the product kernels' threads and "
        "returns its 64-bit words XORed (a memory-bandwidth probe for the benchmarks)");
  m.def("linear_threads", [] { return std::string(linear_threads_name()); },
        "whose threads split calls run on: 'openmp' (the process's runtime) or 'verispec'");
  m.attr("LINEAR_ROW_BLOCK") = kLinearRowBlock;
}

}  // namespace verispec

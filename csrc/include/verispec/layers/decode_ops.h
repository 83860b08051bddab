// The small per-layer ops of a decoder step on float32 CPU rows, each one pass over its
// data: RoPE with the K/V cache write, attention over the paged cache, and SwiGLU's
// silu(gate) * up. Framework-free: raw pointers, sizes, strides.
//
// Why they exist: a SmolLM2 decode step is 30 layers of four few-row matrix products and
// ~25 small torch ops (RoPE is six, attention ten); on a CPU those small ops cost about a
// third of a token. These replace them with three calls a layer.
//
// The rounding rule (batch invariance, as linear.h): each output element is computed by
// the same sequence of float operations whatever the batch, the row's place in it, the
// number of tokens a row brings and the number of threads. So a token attends to its
// keys bit for bit the same in a one-token decode pass, a verify pass of several tokens
// and a batch of many rows, and speculative greedy decoding returns the plain greedy
// tokens. The sequence is also the same on every instruction set (no fused multiply-add,
// lane sums in a fixed order, exp by one polynomial).
#pragma once

#include <cstdint>
#include <string>

#include "verispec/layers/linear.h"
#include "verispec/layers/quant.h"

namespace verispec {

// RoPE of the new tokens' queries and keys, their keys and values written to the cache:
//   q_out[t, h]              = rope(q[t, h])          (h < num_heads)
//   k_pool[slots[t], h]      = rope(k[t, h])          (h < num_kv_heads; slots[t] < 0: no write)
//   v_pool[slots[t], h]      = v[t, h]
// with qkv[t] = [q heads | k heads | v heads] (head_dim each) and
// rope(x)[i] = x[i] * cos[p, i] + x[(i + d/2) % d] * sin[p, i], p = positions[t], d =
// head_dim; the tables hold [cos, cos] and [-sin, sin] per position (rotate-half RoPE,
// transformers' order: x * cos, then the swapped half * sin, then the sum). A padding
// token (position -1, slot < 0) gets a zero query and writes nothing.
struct RopeKvArgs {
  const float* qkv = nullptr;  // [tokens, (num_heads + 2 num_kv_heads) head_dim], row stride ldqkv
  int64_t ldqkv = 0;
  int64_t tokens = 0, num_heads = 0, num_kv_heads = 0, head_dim = 0;
  const int64_t* positions = nullptr;  // [tokens]
  const float* cos = nullptr;          // [max_position, head_dim]
  const float* sin = nullptr;          // [max_position, head_dim]
  int64_t max_position = 0;
  const int32_t* slots = nullptr;      // [tokens]
  float* k_pool = nullptr;             // [num_slots, num_kv_heads, head_dim]
  float* v_pool = nullptr;             // [num_slots, num_kv_heads, head_dim]
  int64_t num_slots = 0;
  float* q_out = nullptr;              // [tokens, num_heads head_dim]
  LinearIsa isa = LinearIsa::kAuto;    // code path only: every path computes the same bits
};

// Returns "" or what is wrong with the arguments (nothing is written then).
std::string rope_kv_write_f32(const RopeKvArgs& args);

// Attention of the new tokens over their rows' cached keys (grouped-query: query head h
// reads KV head h / (num_heads / num_kv_heads)). Token t of row b (query_start[b] <= t <
// query_start[b + 1]) sees the row's keys 0..positions[t]; with a tree mask (a draft
// tree, verispec.models.PagedBatch.tree_mask), the keys before the row's n new tokens
// (j < context_lens[b] - n) and new token u (cached at j = context_lens[b] - n + u -
// query_start[b]) where tree_mask[t, u]. Keys are visited in cache order, so a tree
// node attends bit for bit as the same path decoded as a chain. A padding token
// (position -1, chains only) sees nothing: its output is zero. Key j of row b sits at slot
// block_tables[b][j / block_size] * block_size + j % block_size of the pools:
//   out[t, h] = sum_j softmax_j(scale * q[t, h] . k_j) v_j
// Scores and probabilities are float32; the softmax subtracts the row maximum, and the
// weighted sum of values is divided by the sum of exponentials at the end.
struct PagedAttentionArgs {
  const float* q = nullptr;       // [tokens, num_heads head_dim], contiguous rows
  const float* k_pool = nullptr;  // [num_slots, num_kv_heads, head_dim]
  const float* v_pool = nullptr;  // [num_slots, num_kv_heads, head_dim]
  int64_t num_slots = 0;
  int64_t tokens = 0, num_heads = 0, num_kv_heads = 0, head_dim = 0;
  int64_t rows = 0;
  const int64_t* query_start = nullptr;   // [rows + 1], from 0 up to tokens
  const int64_t* positions = nullptr;     // [tokens]: 0 <= positions[t] < context_lens[row]
  const int32_t* context_lens = nullptr;  // [rows]
  const int32_t* block_tables = nullptr;  // [rows, table_width], row stride table_stride
  const uint8_t* tree_mask = nullptr;     // [tokens, tokens] 0 / 1, or nullptr (chains)
  int64_t table_stride = 0, table_width = 0;
  int64_t block_size = 0;
  float scale = 0.0f;
  float* out = nullptr;                   // [tokens, num_heads head_dim], contiguous rows
  // > 0: a sliding window (transformers' rule): a token at position p sees only keys
  // whose position is > p - window (a key's position is its cache index, a new tree
  // node's its entry of positions). 0: no window.
  int64_t window = 0;
  // > 0: rows with more new tokens than this (a long prefill, which the caller attends
  // with a blocked kernel) are skipped: their outputs are not written. 0: every row.
  int64_t max_queries = 0;
  int num_threads = 1;
  LinearIsa isa = LinearIsa::kAuto;       // code path only: every path computes the same bits
  // How the work is cut (the same bits either way): true, the tokens of a chain row share
  // each key read (and a decode token's query heads share theirs), and when that leaves
  // threads idle a long context's key chunks run on several; false, each token's keys
  // are read for it alone, by one thread (the layout before; bench/bench_attention.py
  // compares the two).
  bool share_keys = true;
  // Only check the arguments (q and out are not read): a forward checks its batch once,
  // before it writes the first layer's cache.
  bool check_only = false;
};

// Returns "" or what is wrong with the arguments (nothing is written then). Every block
// a row reads is checked against the pools before anything is computed.
std::string paged_attention_f32(const PagedAttentionArgs& args);

// A transformers attention function's new tokens, where they lie: query, key and value
// as strided [heads, tokens, head_dim] views (element h, t, i at data + h head_stride +
// t token_stride + i). Their keys and values are written to the cache,
//   k_pool[slots[t], h] = k[h, t], v_pool[slots[t], h] = v[h, t]   (slots[t] < 0: no write)
// then the queries attend as paged_attention_f32 computes it (the same bits: the queries
// are copied into rows first). One call a layer instead of the views, copies and cache
// writes a framework would make of them.
struct StridedHeads {
  const float* data = nullptr;
  int64_t head_stride = 0, token_stride = 0;
};
struct WriteAttendArgs {
  PagedAttentionArgs attention;  // its q and pools are set from the fields below
  StridedHeads q, k, v;          // [num_heads | num_kv_heads, tokens, head_dim]
  const int32_t* slots = nullptr;  // [tokens]
  float* k_pool = nullptr;         // [num_slots, num_kv_heads, head_dim]
  float* v_pool = nullptr;
};

// Returns "" or what is wrong (nothing is written then: the slots and the attention's
// batch are checked before the first write).
std::string write_attend_f32(const WriteAttendArgs& args);

// transformers' rotate-half RoPE (apply_rotary_pos_emb) of a layer's queries and keys as
// strided [heads, tokens, head_dim] views, with one cos and one sin row per token:
//   out[h, t, i] = x[h, t, i] * cos[t, i] + r[h, t, i] * sin[t, i],
//   r[h, t, i] = -x[h, t, i + d/2] for i < d/2, x[h, t, i - d/2] otherwise (d = head_dim)
// each product and the sum rounded on its own (no fused multiply-add): bit for bit what
// torch computes for `q * cos + rotate_half(q) * sin` in float32. out is a contiguous
// [heads, tokens, head_dim]. verispec.models.HFModel runs it in place of a model's own
// apply_rotary_pos_emb once that is checked to compute the same bits.
struct RotateHalfArgs {
  StridedHeads q, k;             // [num_heads | num_kv_heads, tokens, head_dim]
  int64_t num_heads = 0, num_kv_heads = 0, tokens = 0, head_dim = 0;
  const float* cos = nullptr;    // [tokens, head_dim], row stride cs_stride
  const float* sin = nullptr;
  int64_t cs_stride = 0;
  float* q_out = nullptr;        // [num_heads, tokens, head_dim]
  float* k_out = nullptr;        // [num_kv_heads, tokens, head_dim]
};

// Returns "" or what is wrong with the arguments (nothing is written then).
std::string rotate_half_rope_f32(const RotateHalfArgs& args);

// out[r, i] = silu(g[r, i]) * u[r, i] with g = gate_up[r, 0..inter), u = gate_up[r,
// inter..2 inter); silu(g) = g / (1 + exp(-g)). Returns "" or what is wrong.
std::string silu_mul_f32(const float* gate_up, int64_t rows, int64_t inter, int64_t ld,
                         float* out, int64_t ldo, LinearIsa isa = LinearIsa::kAuto);

// A quantized matrix [n, k] of a layer: its rows in up to 4 parts, each of one format
// (a fused projection whose pieces a file stores in different formats).
struct QuantMatrixRef {
  static constexpr int kMaxParts = 4;
  int parts = 0;
  QuantType type[kMaxParts] = {};
  const uint8_t* data[kMaxParts] = {};
  int64_t rows[kMaxParts] = {};
  int64_t ldw[kMaxParts] = {};  // bytes per row (kRows)
  QuantLayout layout[kMaxParts] = {};
  int64_t n = 0, k = 0;
};

// One Llama layer with quantized matrices: norms [hidden] float32, fused QKV
// [(nh + 2 nkv) hd, hidden], O [hidden, nh hd], fused gate/up [2 inter, hidden],
// down [hidden, inter].
struct QuantLayerRef {
  const float* attn_norm = nullptr;
  const float* mlp_norm = nullptr;
  QuantMatrixRef wqkv, wo, gate_up, down;
};

// A forward's decoder layers in one call (the quantized model's few-token passes):
//   h = norm(x); per layer: q = rope_kv_write(h Wqkv); x += attention(q) Wo;
//   x += (silu_mul(norm(x) Wgu)) Wd
// with every step as the ops above and quant_linear_f32 (so the same bits as the
// layer-by-layer calls). rope and attention carry the forward's indices; their q / out /
// pool pointers are set per layer from k_pools / v_pools. x [tokens, hidden] is updated
// in place. Everything is checked before the first layer writes the cache.
struct DecodeLayersArgs {
  float* x = nullptr;
  int64_t tokens = 0, hidden = 0, inter = 0;
  float eps = 0.0f;
  const QuantLayerRef* layers = nullptr;
  int64_t num_layers = 0;
  float* const* k_pools = nullptr;  // [num_layers]
  float* const* v_pools = nullptr;
  RopeKvArgs rope;
  PagedAttentionArgs attention;
  int num_threads = 1;
  QuantArith arith = QuantArith::kFloat;
};

std::string decode_layers_f32(const DecodeLayersArgs& args);

// exp(x) as these ops compute it (a polynomial after Cody-Waite range reduction; within
// 2 ulp of exp for x in [-87, 88]; exp(-87) below, exp(88) above): tests compare with it.
float decode_exp(float x);

}  // namespace verispec

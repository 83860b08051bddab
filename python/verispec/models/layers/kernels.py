"""verispec's CPU layer kernels (``csrc/layers/``), as thin Python wrappers on tensors.

This module is the only caller of the compiled ``_C.*_unchecked`` entry points (a test,
tests/test_source_rules.py, holds it to that). Those take raw pointers and check only
what the kernels cannot survive (index ranges); a wrapper here reads the pointers and
strides off its tensors, so a caller never handles an address. What a wrapper does not
check per call (dtypes, devices, contiguity: a decode step calls these ~20 times a layer,
and the Python around a call costs about as much as the call) is its documented
precondition, which the callers establish once, when they bind their weights or plan a
forward (``LlamaModel._bind_weights``, ``PagedPlan``, ``hf.patch``'s checks).

Shapes: ``T`` tokens of a forward, ``H`` query heads, ``KvH`` KV heads, ``D`` head size.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from verispec import _C

__all__ = ["add_rms_norm", "native_linear", "native_rms_norm", "paged_attention",
           "quant_decode_layers", "quant_linear", "rope_kv_write", "rotate_half_rope",
           "silu_mul", "write_attend"]


def native_linear(x: torch.Tensor, w: torch.Tensor, threads: int) -> torch.Tensor:
    """x @ w^T on verispec's float32 CPU kernel (``_C._linear_unchecked``): x [..., k]
    contiguous, w [n, k] row-major or column-major (read as w^T [k, n]; matmul_layout's
    two layouts), both float32 CPU, checked by the caller -> a new [..., n], written in
    its final shape (no view around it: at a decode step's sizes the Python around a
    product costs about as much as the product)."""
    dims = list(x.shape)  # (a list: torch.empty parses a sliced torch.Size ~2x slower)
    k = dims[-1]
    n = dims[-1] = w.shape[0]
    out = torch.empty(dims, dtype=torch.float32)
    ld_n, ld_k = w.stride()
    kn = ld_k != 1
    _C._linear_unchecked(x.data_ptr(), w.data_ptr(), out.data_ptr(), x.numel() // k, n, k, k,
                         ld_k if kn else ld_n, n, threads, kn)
    return out


def native_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension in one pass of verispec's float32 CPU kernel
    (``_C._rms_norm_unchecked``; rounds as transformers' float32 RMSNorm): x [..., dim]
    and weight [dim] contiguous float32 CPU, checked by the caller -> a new tensor."""
    dim = weight.shape[0]
    out = torch.empty_like(x)
    _C._rms_norm_unchecked(x.data_ptr(), x.numel() // dim if dim else 0, dim, dim,
                           weight.data_ptr(), eps, out.data_ptr(), dim)
    return out


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """x += delta in place and the RMSNorm of the sum, in one pass
    (``_C._add_rms_norm_unchecked``): x and delta [rows, dim], weight [dim], contiguous
    float32 CPU -> the norm, a new [rows, dim]."""
    rows, dim = x.shape
    out = torch.empty_like(x)
    _C._add_rms_norm_unchecked(x.data_ptr(), rows, dim, dim, delta.data_ptr(), dim,
                               weight.data_ptr(), eps, out.data_ptr(), dim)
    return out


def silu_mul(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    """silu(gate) * up of gate_up [rows, 2 * inter] (rows dense in their last dimension,
    float32 CPU) -> a new [rows, inter] (``_C._silu_mul_unchecked``)."""
    rows = gate_up.shape[0]
    out = torch.empty((rows, inter), dtype=torch.float32)
    _C._silu_mul_unchecked(gate_up.data_ptr(), rows, inter, gate_up.stride(0), out.data_ptr(),
                           inter)
    return out


def rope_kv_write(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                  index: Any, cos: torch.Tensor, sin: torch.Tensor, k_pool: torch.Tensor,
                  v_pool: torch.Tensor) -> torch.Tensor:
    """RoPE of the fused projection's q and k, and k and v written to the pools at the
    forward's slots, in one call (``_C._rope_kv_write_unchecked``): qkv [T, (H + 2 KvH)
    * D] rows dense, cos / sin [max_pos, D] (LlamaModel's tables), contiguous float32 CPU
    pools, ``index`` a ``paged.NativeIndex`` -> q [T, H, D]."""
    t = qkv.shape[0]
    q = torch.empty((t, num_heads, head_dim), dtype=torch.float32)
    _C._rope_kv_write_unchecked(
        qkv.data_ptr(), qkv.stride(0), t, num_heads, num_kv_heads, head_dim,
        index.positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), cos.shape[0],
        index.slots.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), index.num_slots,
        q.data_ptr())
    return q


def rotate_half_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                     ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """rotate_half_rope_f32 (verispec/layers/decode_ops.h) of a forward's [1, H, T, D]
    queries and keys with [1, T, D] cos / sin rows, all float32 on the CPU, the last
    dimension dense; -> contiguous (q, k) as transformers' apply_rotary_pos_emb returns
    them, or None for any other input (checked here: the caller then runs its own)."""
    if not (q.dtype == k.dtype == cos.dtype == sin.dtype == torch.float32
            and q.dim() == 4 and k.dim() == 4 and cos.dim() == 3 and q.is_cpu and k.is_cpu
            and cos.is_cpu and sin.is_cpu):
        return None
    _, h, t, d = q.shape
    kvh = k.shape[1]
    if (q.shape[0] != 1 or k.shape[0] != 1 or k.shape[2] != t or k.shape[3] != d or d % 2
            or cos.shape != (1, t, d) or sin.shape != cos.shape
            or q.stride(3) != 1 or k.stride(3) != 1):
        return None
    if cos.stride(2) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    q_out = torch.empty((1, h, t, d), dtype=torch.float32)
    k_out = torch.empty((1, kvh, t, d), dtype=torch.float32)
    _C._rotate_half_rope_unchecked(
        q.data_ptr(), q.stride(1), q.stride(2), h, k.data_ptr(), k.stride(1), k.stride(2), kvh,
        t, d, cos.data_ptr(), sin.data_ptr(), cos.stride(1), q_out.data_ptr(), k_out.data_ptr())
    return q_out, k_out


def paged_attention(index: Any, k_pool: torch.Tensor, v_pool: torch.Tensor,
                    q: Optional[torch.Tensor], out: Optional[torch.Tensor], num_heads: int,
                    num_kv_heads: int, head_dim: int, scale: float, max_queries: int,
                    threads: int, check_only: bool = False) -> None:
    """Every row of the batch attends over its cached keys through its block table in
    verispec's paged kernel (``_C._paged_attention_unchecked``; one rounding for decode,
    verify, tree, batched rows and prefill chunks): q [T, H, D] -> out [T, H * D],
    contiguous float32 CPU pools [blocks, block_size, KvH, D], ``index`` a
    ``paged.NativeIndex``. Rows of more than ``max_queries`` new tokens are skipped (0:
    none). ``check_only``: check the index (positions, lengths, tables) and attend
    nothing (q and out may be None)."""
    tables = index.tables
    q_ptr = k_pool.data_ptr() if q is None else q.data_ptr()          # unread when checking
    out_ptr = k_pool.data_ptr() if out is None else out.data_ptr()
    _C._paged_attention_unchecked(
        q_ptr, k_pool.data_ptr(), v_pool.data_ptr(), index.num_slots, index.num_tokens,
        num_heads, num_kv_heads, head_dim, tables.shape[0], index.query_start.data_ptr(),
        index.positions.data_ptr(), index.context_lens.data_ptr(), tables.data_ptr(),
        tables.stride(0), tables.shape[1], index.tree_ptr, index.block_size, scale, out_ptr,
        max_queries, threads, check_only=check_only)


def write_attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, index: Any,
                 k_pool: torch.Tensor, v_pool: torch.Tensor, scaling: float,
                 window: Optional[int]) -> torch.Tensor:
    """One call that writes a layer's new K/V to its pools at the forward's slots and
    attends (``_C._write_attend_unchecked``), reading the strided [1, H, T, D] /
    [1, KvH, T, D] tensors a transformers module passes, last dimension dense; float32
    CPU, contiguous pools [blocks, block_size, KvH, D]; ``window`` a sliding window (None:
    none) -> [1, T, H, D]."""
    _, h, t, d = query.shape
    out = torch.empty((1, t, h, d), dtype=torch.float32)
    qs, ks, vs = query.stride(), key.stride(), value.stride()
    tables = index.tables
    _C._write_attend_unchecked(
        query.data_ptr(), qs[1], qs[2], key.data_ptr(), ks[1], ks[2],
        value.data_ptr(), vs[1], vs[2], index.slots.data_ptr(), k_pool.data_ptr(),
        v_pool.data_ptr(), k_pool.shape[0] * k_pool.shape[1], t, h, key.shape[1], d,
        tables.shape[0], index.query_start.data_ptr(), index.positions.data_ptr(),
        index.context_lens.data_ptr(), tables.data_ptr(), tables.stride(0), tables.shape[1],
        index.tree_ptr, index.block_size, scaling, out.data_ptr(), torch.get_num_threads(),
        window=window if window is not None and window > 0 else 0)
    return out


def quant_linear(x: torch.Tensor, data: torch.Tensor, out: torch.Tensor, n0: int, n: int,
                 k: int, type_id: int, threads: int, int8: bool, packed: bool) -> None:
    """out[:, n0:n0 + n] = x @ W^T for one quantized part W (``_C._quant_linear_unchecked``,
    verispec/layers/quant.h): x [M, k] float32 rows dense, ``data`` the part's blocks
    (ggml type ``type_id``; ``packed``: the 16-row packed layout), out [M, N] float32."""
    _C._quant_linear_unchecked(x.data_ptr(), data.data_ptr(), out.data_ptr() + 4 * n0,
                               x.shape[0], n, k, x.stride(0), data.stride(0), out.stride(0),
                               type_id, threads, int8, packed)


def quant_decode_layers(layers: Any, x: torch.Tensor, kv: Any, inter: int, eps: float,
                        num_heads: int, num_kv_heads: int, head_dim: int, index: Any,
                        cos: torch.Tensor, sin: torch.Tensor, threads: int, int8: bool) -> None:
    """Every decoder layer of a quantized model in one native call
    (``_C._QuantDecodeLayers.run``): x [T, hidden] becomes the last layer's output."""
    t = index.tables
    layers.run(
        x.data_ptr(), x.shape[0], x.shape[1], inter, eps,
        [p.data_ptr() for p in kv.k], [p.data_ptr() for p in kv.v], num_heads, num_kv_heads,
        head_dim, index.positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), cos.shape[0],
        index.slots.data_ptr(), index.num_slots, t.shape[0], index.query_start.data_ptr(),
        index.context_lens.data_ptr(), t.data_ptr(), t.stride(0), t.shape[1], index.tree_ptr,
        index.block_size, 1.0 / math.sqrt(head_dim), threads, int8)

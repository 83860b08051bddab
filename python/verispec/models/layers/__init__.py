"""The model layers' Python side: one home for what LlamaModel and HFModel share.

- ``kernels``: thin wrappers over verispec's CPU layer kernels (``csrc/layers/``); the
  only module that calls the compiled ``_C.*_unchecked`` entry points.
- ``paged``: the paged-attention plan of a forward (``PagedPlan``: row groups, gather
  indices, masks for chains, trees and sliding windows, the native kernels' index).
- ``attention``: the attention backends over that plan ("native", "sdpa",
  "flashinfer") and ``select_backend``.
- ``graphs``: LlamaModel's forwards captured as CUDA graphs per (rows, queries, key
  blocks) bucket, with static inputs, padding that writes nowhere and a bit check
  against eager before a graph is trusted (``GraphCache``, ``bucket_for``).

The C++ side is ``csrc/layers/`` (headers ``csrc/include/verispec/layers/``).
"""

from verispec.models.layers.attention import (BACKENDS, FlashInferAttention, TorchAttention,
                                              attend_matmul, flashinfer_available,
                                              select_backend)
from verispec.models.layers.kernels import (add_rms_norm, native_linear, native_rms_norm,
                                            paged_attention, quant_decode_layers, quant_linear,
                                            rope_kv_write, rotate_half_rope, silu_mul,
                                            write_attend)
from verispec.models.layers.paged import (KERNEL_MAX_QUERIES, SMALL_ROW_QUERIES, NativeIndex,
                                          PagedPlan, RowGroup)

__all__ = ["BACKENDS", "FlashInferAttention", "KERNEL_MAX_QUERIES", "NativeIndex",
           "PagedPlan", "RowGroup", "SMALL_ROW_QUERIES", "TorchAttention", "add_rms_norm",
           "attend_matmul", "flashinfer_available", "native_linear", "native_rms_norm",
           "paged_attention", "quant_decode_layers", "quant_linear", "rope_kv_write",
           "rotate_half_rope", "select_backend", "silu_mul", "write_attend"]

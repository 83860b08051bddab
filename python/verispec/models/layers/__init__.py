"""The model layers' Python side: one home for what LlamaModel and HFModel share. Nothing
here imports models/llama.py or models/hf/ (they stand side by side on top of it).

- ``kernels``: thin wrappers over verispec's CPU layer kernels (``csrc/layers/``); the
  only module that calls the compiled ``_C.*_unchecked`` entry points.
- ``linear``: the products' layout (``matmul_layout``), the rows verispec's linear
  kernel takes (``NATIVE_LINEAR_MIN_ROWS`` .. ``NATIVE_LINEAR_MAX_ROWS``) and the checked
  linear entry points ``verispec.ops`` re-exports (``linear``, ``quant_linear``,
  ``quant_pack``).
- ``quantized``: ``QuantizedMatrix``, weights kept in GGUF block formats, and the
  quantized arithmetic's settings.
- ``norm_rope``: RMSNorm, rotate-half RoPE and RoPE frequencies in torch ops.
- ``tp``: the tensor-parallel splits (heads, units, vocabulary) of both models.
- ``paged``: the paged-attention plan of a forward (``PagedPlan``: row groups, gather
  indices, masks for chains, trees and sliding windows, the native kernels' index).
- ``attention`` (a package): the attention-backend interface (``AttentionBackend``:
  ``plan`` once a forward, ``attend`` per layer over the 4-D pools), the registry of
  backends by name (``REGISTRY``, ``select_backend``, ``resolve_backend``) and the
  backends, one file each ("native", "sdpa", "flashinfer"; the batch-invariant mode's).
- ``batch_invariant``: fixed-shape torch ops whose rounding does not depend on the batch
  (the batch-invariant mode off verispec's CPU kernels).
- ``graphs``: LlamaModel's forwards captured as CUDA graphs per (rows, queries, key
  blocks) bucket, with static inputs, padding that writes nowhere and a bit check
  against eager before a graph is trusted (``GraphCache``, ``bucket_for``).
- ``layer_ops``: the four ways a LlamaModel forward runs the steps between its products
  (torch, batch-invariant, CUDA-graph bucket, verispec's CPU kernels).

The C++ side is ``csrc/layers/`` (headers ``csrc/include/verispec/layers/``).
"""

from verispec.models.layers.attention import (BACKENDS, FlashInferAttention, TorchAttention,
                                              attend_matmul, flashinfer_available,
                                              select_backend)
from verispec.models.layers.kernels import (add_rms_norm, native_linear, native_rms_norm,
                                            paged_attention, quant_decode_layers, quant_linear,
                                            rope_kv_write, rotate_half_rope, silu_mul,
                                            write_attend)
from verispec.models.layers.linear import (NATIVE_LINEAR_MAX_ROWS, NATIVE_LINEAR_MIN_ROWS,
                                           matmul_layout)
from verispec.models.layers.norm_rope import apply_rope, rms_norm, rope_inv_freq
from verispec.models.layers.paged import (KERNEL_MAX_QUERIES, SMALL_ROW_QUERIES, NativeIndex,
                                          PagedPlan, RowGroup)
from verispec.models.layers.tp import split_evenly, split_heads, split_vocab

__all__ = ["BACKENDS", "FlashInferAttention", "KERNEL_MAX_QUERIES", "NATIVE_LINEAR_MAX_ROWS",
           "NATIVE_LINEAR_MIN_ROWS", "NativeIndex", "PagedPlan", "RowGroup",
           "SMALL_ROW_QUERIES", "TorchAttention", "add_rms_norm", "apply_rope",
           "attend_matmul", "flashinfer_available", "matmul_layout", "native_linear",
           "native_rms_norm", "paged_attention", "quant_decode_layers", "quant_linear",
           "rms_norm", "rope_inv_freq", "rope_kv_write", "rotate_half_rope", "select_backend",
           "silu_mul", "split_evenly", "split_heads", "split_vocab", "write_attend"]

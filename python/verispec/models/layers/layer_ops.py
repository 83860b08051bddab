"""The four ways a LlamaModel forward runs the steps between its matrix products (RoPE
with the cache write, attention, residual adds with RMSNorm, SwiGLU): one object per
forward, chosen by ``LlamaModel.forward``.

- ``_TorchLayerOps``: torch ops (any device, dtype);
- ``_BatchInvariantOps``: the torch batch-invariant mode (``layers.batch_invariant``);
- ``_BucketLayerOps``: a CUDA graph's captured forward at a bucket's fixed shapes
  (``layers.graphs``);
- ``_NativeLayerOps``: verispec's CPU kernels (``layers.kernels``), three calls a layer.

Attention is not theirs: each holds the forward's attention backend
(``layers.attention.AttentionBackend``, resolved by the model), plans it once and calls
``attend`` with the layer's pools as they are ([blocks, block_size, KvH, D]); the bucket
calls the backend's capturable ``attend_static``. ``_NativeLayerOps`` runs with a backend
whose class says ``layer_kernels`` (the native one: its cache write is fused with RoPE
here), the batch-invariant mode with ``BatchInvariantAttention``.

Each takes the model as an argument and reads its attributes (``_nh``, ``_nkv``,
``config``, ``geometry``, the RoPE tables ``_cos``/``_sin``, ``_norm_fn()``); this module
does not import models/llama.py (it sits below it).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F

from verispec.models.base import PagedBatch
from verispec.models.layers import batch_invariant as _bi
from verispec.models.layers import kernels
from verispec.models.layers import quantized as _quantized
from verispec.models.layers.attention import AttentionBackend, BatchInvariantAttention
from verispec.models.layers.graphs import GraphInputs
from verispec.models.layers.kernels import native_rms_norm
from verispec.models.layers.norm_rope import apply_rope
from verispec.models.layers.paged import PagedPlan


class _TorchLayerOps:
    """A forward's steps between the matrix products in torch ops (any device, dtype)."""

    def __init__(self, model: Any, batch: PagedBatch, num_tokens: int,
                 positions: torch.Tensor, attention: AttentionBackend):
        g = model.geometry
        self.model, self.nh, self.nkv, self.hd = model, model._nh, model._nkv, model.config.head_dim
        # the forward's paged plan; the backend planned (and the batch checked) before any
        # write
        self.plan = PagedPlan(batch, g.device, who="LlamaModel.forward")
        self.write = self.plan.write
        self.attention = attention
        attention.plan(self.plan)
        self.scaling = 1.0 / math.sqrt(self.hd)
        self.norm = model._norm_fn()
        self.cos = model._cos[positions][:, None, :]                          # [T, 1, hd]
        self.sin = model._sin[positions][:, None, :]
        self.num_tokens = num_tokens

    def rope_write(self, qkv: torch.Tensor, k_pool: torch.Tensor,
                   v_pool: torch.Tensor) -> torch.Tensor:
        """RoPE of q and k, k and v written to the pools; returns q [T, nh, hd]."""
        nh, nkv, hd = self.nh, self.nkv, self.hd
        qkv = qkv.view(self.num_tokens, nh + 2 * nkv, hd)
        qk = apply_rope(qkv[:, :nh + nkv], self.cos, self.sin)               # q and k together
        self.write(k_pool.view(-1, nkv, hd), qk[:, nh:])
        self.write(v_pool.view(-1, nkv, hd), qkv[:, nh + nkv:])
        return qk[:, :nh]

    def attend(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> torch.Tensor:
        """q [T, nh, hd] against each row's cached context -> [T, nh * hd]."""
        out = self.attention.attend(self.plan, q, k_pool, v_pool, scaling=self.scaling)
        return out.reshape(self.num_tokens, self.nh * self.hd)

    def add_norm(self, x: torch.Tensor, delta: torch.Tensor,
                 weight: Optional[torch.Tensor]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """x + delta, and its norm with ``weight`` (None: no norm)."""
        x = x + delta
        return x, None if weight is None else self.norm(x, weight)

    @staticmethod
    def silu_mul(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
        return F.silu(gate_up[:, :inter]) * gate_up[:, inter:]


class _BatchInvariantOps(_TorchLayerOps):
    """A forward's steps between the products in the torch batch-invariant mode
    (``verispec.models.layers.batch_invariant``): RMSNorm in fixed chunks of ROWS rows, every
    token's attention over its own visible keys in fixed-shape steps
    (``BatchInvariantAttention``); RoPE, the cache write, residual adds and SwiGLU are
    element-wise as in _TorchLayerOps."""

    def __init__(self, model: Any, batch: PagedBatch, num_tokens: int,
                 positions: torch.Tensor):
        g = model.geometry
        self.model, self.nh, self.nkv, self.hd = model, model._nh, model._nkv, model.config.head_dim
        self.plan = PagedPlan(batch, g.device, who="LlamaModel.forward")
        self.attention = BatchInvariantAttention(batch_invariant=True)
        self.attention.plan(self.plan)
        self.write = self.plan.write
        eps = model.config.rms_norm_eps
        self.norm = lambda x, weight: _bi.rms_norm(x, weight, eps)
        self.cos = model._cos[positions][:, None, :]                          # [T, 1, hd]
        self.sin = model._sin[positions][:, None, :]
        self.num_tokens = num_tokens
        self.scaling = 1.0 / math.sqrt(self.hd)


class _BucketLayerOps(_TorchLayerOps):
    """A captured forward's steps between the products (``layers.graphs``): the torch
    ops of _TorchLayerOps at a bucket's fixed shapes, writing through the bucket's
    static slots and attending through the backend's capturable path
    (``attend_static``: nothing read from the host)."""

    def __init__(self, model: Any, inputs: GraphInputs, attention: AttentionBackend):
        self.model, self.nh, self.nkv, self.hd = model, model._nh, model._nkv, model.config.head_dim
        self.inputs = inputs
        self.attention = attention
        self.write = inputs.write
        self.scaling = 1.0 / math.sqrt(self.hd)
        self.norm = model._norm_fn()
        self.cos = model._cos[inputs.positions][:, None, :]                   # [N, 1, hd]
        self.sin = model._sin[inputs.positions][:, None, :]
        self.num_tokens = inputs.bucket.tokens

    def attend(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> torch.Tensor:
        out = self.attention.attend_static(self.inputs, q, k_pool, v_pool, scaling=self.scaling)
        return out.reshape(self.num_tokens, self.nh * self.hd)


class _NativeLayerOps:
    """A forward's steps between the matrix products in verispec's CPU kernels
    (``layers.kernels``: verispec/layers/decode_ops.h; float32 CPU tensors, contiguous
    pools): three native calls a layer, the attention the native backend's
    (``layers.attention.NativeAttention``: every row in the paged kernel, one rounding for
    decode, verify, tree, batched rows and prefill chunks, except rows of more than
    KERNEL_MAX_QUERIES new tokens without a tree, a long prompt at once, which attend
    row by row in SDPA)."""

    def __init__(self, model: Any, batch: PagedBatch, num_tokens: int,
                 positions: torch.Tensor, attention: AttentionBackend):
        self.nh, self.nkv, self.hd = model._nh, model._nkv, model.config.head_dim
        self.num_tokens = num_tokens
        self.eps = model.config.rms_norm_eps
        self.threads = torch.get_num_threads()
        self.cos, self.sin = model._cos, model._sin
        self.scaling = 1.0 / math.sqrt(self.hd)
        self.plan = PagedPlan(batch, model.geometry.device, who="LlamaModel.forward")
        # Index tensors as the kernels read them (kept alive for the forward's calls);
        # positions, context lengths and block tables checked by the backend's plan,
        # before the first layer writes the cache (a bad batch changes nothing).
        self.index = self.plan.native_index
        self.attention = attention
        attention.plan(self.plan)

    @property
    def long_rows(self) -> list:
        """Rows the backend attends in SDPA (long prefills): (first token, last + 1, row)."""
        return getattr(self.attention, "long_rows", [])

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return native_rms_norm(x if x.is_contiguous() else x.contiguous(), weight, self.eps)

    def rope_write(self, qkv: torch.Tensor, k_pool: torch.Tensor,
                   v_pool: torch.Tensor) -> torch.Tensor:
        return kernels.rope_kv_write(qkv, self.nh, self.nkv, self.hd, self.index, self.cos,
                                     self.sin, k_pool, v_pool)

    def attend(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> torch.Tensor:
        out = self.attention.attend(self.plan, q, k_pool, v_pool, scaling=self.scaling)
        return out.reshape(self.num_tokens, self.nh * self.hd)

    def add_norm(self, x: torch.Tensor, delta: torch.Tensor,
                 weight: Optional[torch.Tensor]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """x += delta in place, and the norm of the sum with ``weight`` (None: no norm)."""
        delta = delta if delta.is_contiguous() else delta.contiguous()
        if weight is None:
            x += delta
            return x, None
        return x, kernels.add_rms_norm(x, delta, weight, self.eps)

    def run_layers(self, layers: Any, x: torch.Tensor, kv: Any, inter: int) -> None:
        """Every decoder layer of a quantized model in one native call
        (_C._QuantDecodeLayers): x [T, hidden] becomes the last layer's output."""
        kernels.quant_decode_layers(layers, x, kv, inter, self.eps, self.nh, self.nkv, self.hd,
                                    self.index, self.cos, self.sin, self.threads,
                                    _quantized.ARITHMETIC == "int8")

    @staticmethod
    def silu_mul(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
        return kernels.silu_mul(gate_up, inter)
